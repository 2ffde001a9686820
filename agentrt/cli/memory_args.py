"""`agentrt serve`'s bounds on what its engine keeps in memory (docs/limits.md, "Memory of a
long-lived server"): the KV cache (and whether it is mapped at start), compiled grammars, the
drafters' history of earlier outputs, and the engine's own step log; and the heap trimmer that
gives freed memory back to the OS."""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import logging
from typing import Any, Callable

log = logging.getLogger("agentrt.server")

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
    p.add_argument("--heap-trim-interval", type=float, default=10.0, metavar="S",
                   help="every S seconds, give the heap memory freed since back to the OS (glibc malloc_trim; "
                        "0: never)")
    p.add_argument("--draft-history-tokens", type=int, default=None, metavar="N",
                   help="tokens of earlier outputs the suffix and template drafters draft from, ~0.1-1.1 KB "
                        "each (default 65536)")
    p.add_argument("--draft-tree-width", type=int, default=None, metavar="W",
                   help="widest token tree the template and suffix drafters propose where several "
                        "continuations fit (enum members, quoted values), verified in one pass (default 1: chain "
                        "drafts only; trees measured no gain yet)")


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
    if not args.heap_trim_interval >= 0:
        raise RunConfigError(f"--heap-trim-interval must be >= 0 seconds, got {args.heap_trim_interval}")
    if args.draft_history_tokens is not None:
        if args.draft_history_tokens < 2:
            raise RunConfigError(f"--draft-history-tokens must be at least 2, got {args.draft_history_tokens}")
        spec["history_tokens"] = args.draft_history_tokens
    if args.draft_tree_width is not None:
        if args.draft_tree_width < 1:
            raise RunConfigError(f"--draft-tree-width must be at least 1 (1: chains), got {args.draft_tree_width}")
        spec["tree_width"] = args.draft_tree_width
    return engine, spec


def kv_cache_line(engine: Any) -> str:
    """What the KV cache takes, for the start-up log: it is most of a small model's memory."""
    from agentrt.engine.kv.kv_cache import KVCache

    tokens = engine.kv.num_blocks * engine.kv.block_size
    nbytes = tokens * KVCache.bytes_per_token(engine.model.cfg, engine.model.kv_dtype)
    how = "mapped at start" if engine.config.prefault_kv else "mapped as it is used"
    return f"KV cache: {tokens} tokens, {nbytes / 2**30:.2f} GiB ({how}; --kv-cache-tokens)"


def heap_trimmer() -> Callable[[], int] | None:
    """glibc's malloc_trim(0), or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


async def trim_heap_every(interval_s: float, trim: Callable[[], int] | None = None) -> None:
    """Until cancelled: every interval_s, malloc_trim(0) on a worker thread. glibc keeps what a
    thread frees in that thread's arena for its next allocations and returns only the top of an
    arena to the OS; the engine thread's steps (and the C kernels' scratch buffers, which grow to
    the largest step) free and allocate megabytes at a time, so under varied load the arenas'
    resident memory creeps up by a few MB per hundred runs while the memory in use stays flat
    (`agentrt bench serve --soak`). A trim gives the free pages back (~0.1 ms)."""
    trim = trim or heap_trimmer()
    if trim is None or interval_s <= 0:
        return
    while True:
        await asyncio.sleep(interval_s)
        try:
            await asyncio.to_thread(trim)
        except Exception:  # noqa: BLE001 - a failed trim costs memory, never the server
            log.exception("malloc_trim failed; the heap is no longer trimmed")
            return
