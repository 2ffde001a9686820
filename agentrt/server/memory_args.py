"""`agentrt serve`'s bounds on what its engine keeps in memory (docs/limits.md, "Memory of a
long-lived server"): the KV cache (and whether it is mapped at start), compiled grammars, the
drafters' history of earlier outputs, and the engine's own step log."""
from __future__ import annotations

import argparse
from typing import Any

# The server reads no engine step log (its traces and metrics take steps as they happen); a short
# one is kept for a debugger's look at the last steps.
SERVE_STEP_LOG_STEPS = 256


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    """The flags; each left out keeps the engine's default (no torch import here: --help stays fast)."""
    p.add_argument("--kv-cache-tokens", type=int, default=None, metavar="N",
                   help="tokens the KV cache holds, all requests together (default 32768); its memory is fixed "
                        "by this: 2 x layers x KV heads x head size x 4 bytes a token (45 KB for the embedded model)")
    p.add_argument("--prefault-kv", action=argparse.BooleanOptionalAction, default=True,
                   help="map the whole KV cache at start (default), so the memory at /ready is what the "
                        "server keeps under load and a machine without it fails at start; --no-prefault-kv "
                        "maps it as it is first used")
    p.add_argument("--grammar-cache-mb", type=float, default=None, metavar="MB",
                   help="compiled grammars of constrained outputs kept, least recently used dropped past this "
                        "(default 64)")
    p.add_argument("--draft-history-tokens", type=int, default=None, metavar="N",
                   help="tokens of earlier outputs the suffix and template drafters draft from, ~0.1-1.1 KB "
                        "each (default 65536)")


def engine_memory(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(EngineConfig keyword arguments, SpecConfig keyword arguments) from the flags."""
    from agentrt.errors import RunConfigError

    engine: dict[str, Any] = {"prefault_kv": args.prefault_kv, "step_log_steps": SERVE_STEP_LOG_STEPS}
    spec: dict[str, Any] = {}
    if args.kv_cache_tokens is not None:
        if args.kv_cache_tokens < 16:
            raise RunConfigError(f"--kv-cache-tokens must be at least one block (16 tokens), got {args.kv_cache_tokens}")
        engine["kv_cache_tokens"] = args.kv_cache_tokens
    if args.grammar_cache_mb is not None:
        if not args.grammar_cache_mb >= 0:
            raise RunConfigError(f"--grammar-cache-mb must be >= 0, got {args.grammar_cache_mb}")
        engine["grammar_cache_bytes"] = int(args.grammar_cache_mb * 2**20)
    if args.draft_history_tokens is not None:
        if args.draft_history_tokens < 2:
            raise RunConfigError(f"--draft-history-tokens must be at least 2, got {args.draft_history_tokens}")
        spec["history_tokens"] = args.draft_history_tokens
    return engine, spec


def kv_cache_line(engine: Any) -> str:
    """What the KV cache takes, for the start-up log: it is most of a small model's memory."""
    from agentrt.engine.kv_cache import KVCache

    tokens = engine.kv.num_blocks * engine.kv.block_size
    nbytes = tokens * KVCache.bytes_per_token(engine.model.cfg, engine.model.dtype)
    how = "mapped at start" if engine.config.prefault_kv else "mapped as it is used"
    return f"KV cache: {tokens} tokens, {nbytes / 2**30:.2f} GiB ({how}; --kv-cache-tokens)"
