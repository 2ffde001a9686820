"""The paged KV cache: its tensors (kv_cache.py), who owns which block (block_manager.py) and the
radix tree over full blocks that lets a later prompt reuse them (prefix_cache.py)."""
