"""Text in and out of the engine: the tokenizer with its chat template, stop tokens and incremental
detokenizer (tokenizer.py), chat messages checked before the template renders them (messages.py),
and where a chat prompt's tokens go, message by message (prompt_parts.py)."""
