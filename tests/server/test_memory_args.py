"""`agentrt serve`'s memory flags become engine settings; bad values are refused naming the flag."""
from __future__ import annotations

import argparse

import pytest

from agentrt.errors import RunConfigError
from agentrt.server.memory_args import SERVE_STEP_LOG_STEPS, add_memory_arguments, engine_memory


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_memory_arguments(p)
    return p.parse_args(list(argv))


def test_defaults_keep_the_engines_and_map_the_kv_cache_at_start():
    engine, spec = engine_memory(parse())
    assert engine == {"prefault_kv": True, "step_log_steps": SERVE_STEP_LOG_STEPS} and spec == {}


def test_each_flag_sets_its_bound():
    engine, spec = engine_memory(parse("--kv-cache-tokens", "4096", "--no-prefault-kv", "--grammar-cache-mb", "1.5",
                                       "--draft-history-tokens", "1024"))
    assert engine == {"prefault_kv": False, "step_log_steps": SERVE_STEP_LOG_STEPS, "kv_cache_tokens": 4096,
                      "grammar_cache_bytes": 1536 * 1024}
    assert spec == {"history_tokens": 1024}


@pytest.mark.parametrize("argv, flag", [(("--kv-cache-tokens", "8"), "--kv-cache-tokens"),
                                        (("--grammar-cache-mb", "-1"), "--grammar-cache-mb"),
                                        (("--grammar-cache-mb", "nan"), "--grammar-cache-mb"),
                                        (("--draft-history-tokens", "1"), "--draft-history-tokens")])
def test_bad_values_name_the_flag(argv, flag):
    with pytest.raises(RunConfigError, match=flag):
        engine_memory(parse(*argv))
