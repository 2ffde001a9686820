"""`agentrt serve`'s memory flags become engine settings; bad values are refused naming the flag."""
from __future__ import annotations

import argparse
import asyncio
import sys

import pytest

from agentrt.cli.memory_args import (SERVE_STEP_LOG_STEPS, add_memory_arguments, engine_memory, heap_trimmer,
                                     trim_heap_every)
from agentrt.errors import RunConfigError


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_memory_arguments(p)
    return p.parse_args(list(argv))


def test_defaults_keep_the_engines_and_map_the_kv_cache_at_start():
    engine, spec = engine_memory(parse())
    assert engine == {"prefault_kv": True, "step_log_steps": SERVE_STEP_LOG_STEPS} and spec == {}


def test_each_flag_sets_its_bound():
    engine, spec = engine_memory(parse("--kv-cache-tokens", "4096", "--no-prefault-kv", "--grammar-cache-mb", "1.5",
                                       "--draft-history-tokens", "1024", "--draft-tree-width", "1"))
    assert engine == {"prefault_kv": False, "step_log_steps": SERVE_STEP_LOG_STEPS, "kv_cache_tokens": 4096,
                      "grammar_cache_bytes": 1536 * 1024}
    assert spec == {"history_tokens": 1024, "tree_width": 1}


@pytest.mark.parametrize("argv, flag", [(("--kv-cache-tokens", "8"), "--kv-cache-tokens"),
                                        (("--grammar-cache-mb", "-1"), "--grammar-cache-mb"),
                                        (("--grammar-cache-mb", "nan"), "--grammar-cache-mb"),
                                        (("--draft-history-tokens", "1"), "--draft-history-tokens"),
                                        (("--draft-tree-width", "0"), "--draft-tree-width"),
                                        (("--heap-trim-interval", "-1"), "--heap-trim-interval")])
def test_bad_values_name_the_flag(argv, flag):
    with pytest.raises(RunConfigError, match=flag):
        engine_memory(parse(*argv))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
async def test_the_heap_is_trimmed_every_interval_until_cancelled():
    trim = heap_trimmer()
    assert trim is not None and trim() in (0, 1)
    calls = []
    task = asyncio.get_running_loop().create_task(trim_heap_every(0.01, lambda: calls.append(trim())))
    await asyncio.sleep(0.2)
    task.cancel()
    assert len(calls) >= 3
    n = len(calls)
    await asyncio.sleep(0.05)
    assert len(calls) == n  # stopped
    await trim_heap_every(0, trim)  # 0: never; returns at once
