"""The fused quantized decoder on Qwen3 and Gemma 3 layers (QK-norm; Gemma's (1 + w) post-norms,
GeGLU, embedding scale, logit soft-capping, sliding-window layers with their own rotary base)
against the PyTorch path of the same quantized model: tiny random models written as llama.cpp
writes them (tests/engine/tiny_models.py; Q8_0 projections, Gemma's window 6).

The bounds are test_quant_forward.py's reasoning: both paths compute the same model and differ by
fp32 summation order, which now and then moves an int8 activation rounding of a later linear (a
"flip"). Without one a position agrees to ~1e-7 (observed <= 3.4e-7 relative L2); a flip moves
it by a few percent (observed 2.7e-2 at most).
"""
from __future__ import annotations

import pytest
import torch
from engine_runs import forward_step

from agentrt.engine.kv.block_manager import BlockManager
from agentrt.engine.kv.kv_cache import KVCache
from agentrt.engine.models import quant_forward as qf
from agentrt.kernels.quant_build import unsupported_reason

FAMILIES = ["qwen3", "gemma3"]
# past Gemma's window of 6; 140 and 300 cross attention chunks of 64 (a window starting inside
# one), and a lone decode token at 300 runs its chunks as separate tasks on 2+ threads
LENGTHS = (12, 26, 5, 140, 300)
DECODE_STEPS = 3

pytestmark = pytest.mark.skipif(unsupported_reason() is not None, reason=f"quantized kernels: {unsupported_reason()}")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """quantized(family) -> the tiny model loaded on its GGUF blocks."""
    from tiny_models import save_tiny_gguf

    from agentrt.engine.loading.model_loader import load_model

    made = {}

    def get(family: str):
        if family not in made:
            d = tmp_path_factory.mktemp(f"quant-{family}")
            path = save_tiny_gguf(d / f"{family}.gguf", hf_dir=d / "hf", variant=family, projections="Q8_0")
            with pytest.MonkeyPatch.context() as m:
                m.setenv("AGENTRT_CACHE", str(d / "cache"))  # the GGUF's conversion goes here
                made[family] = load_model(str(path), "quantized", progress=False)
        return made[family]

    return get


def _seqs(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


class _Run:
    """One KV cache; feed() runs a ragged step of the given sequences (ids in `seqs`)."""

    def __init__(self, m, fused: bool):
        self.m, self.fused = m, fused
        self.bm, self.kv = BlockManager(256, 4), KVCache(m.cfg, 1024, 4, m.kv_dtype)

    def feed(self, feeds: list[list[int]], starts: list[int]) -> torch.Tensor:
        self.m.quant_fused = self.fused
        try:
            return forward_step(self.m, self.kv, self.bm, feeds, starts)
        finally:
            self.m.quant_fused = True


def _logits(m, seqs: list[list[int]], fused: bool) -> list[torch.Tensor]:
    """Each sequence's logits at every position: the prefills in one ragged batch, then decode
    steps of all sequences together."""
    run, n = _Run(m, fused), [len(s) - DECODE_STEPS for s in seqs]
    rows = [list(run.feed([s[:k] for s, k in zip(seqs, n)], [0] * len(seqs)).split(n))]
    for step in range(DECODE_STEPS):
        pos = [k + step for k in n]
        rows.append(list(run.feed([[s[p]] for s, p in zip(seqs, pos)], pos).split(1)))
    return [torch.cat(r) for r in zip(*rows)]


@pytest.mark.parametrize("family", FAMILIES)
def test_runs_on_the_fused_decoder(family, quantized):
    m = quantized(family).model
    assert qf.quant_support(m) is None and m.quant_fused
    assert m.cfg.triton_gaps()  # what the Triton layer ops still lack
    if family == "gemma3":
        dec = m.quant_decoder
        assert [ly.window for ly in dec.layers] == [6, None, 6] and [ly.gelu for ly in dec.layers] == [True] * 3
        assert dec.layers[0].cos is dec.local_cos and dec.layers[1].cos is None
        assert dec.embed_scale == pytest.approx(m.cfg.hidden_size**0.5) and dec.softcap == 30.0


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_the_torch_path(family, quantized):
    """Prefill + decode over every position of five sequences, three past the window."""
    m = quantized(family).model
    seqs = _seqs(m.cfg.vocab_size)
    fused, ref = _logits(m, seqs, True), _logits(m, seqs, False)
    rels = [(a - b).norm(dim=-1) / b.norm(dim=-1) for a, b in zip(fused, ref)]
    rel = torch.cat(rels)
    agree = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(fused, ref)])
    # Both paths round K/V to the fp16 cache; where their fp32 sums differ across a rounding
    # boundary a cached value differs by one fp16 step, and later int8 activation roundings
    # amplify that to ~1e-2. The short sequences meet no such flip: the same ops, to 1e-5.
    short = torch.cat([r for r, s in zip(rels, seqs) if len(s) <= 12])
    assert (short < 1e-5).all(), short
    assert rel.max() < 0.1, rel.max()
    assert agree.float().mean() >= 0.98


def test_the_window_and_local_rope_are_applied(quantized):
    """Gemma's sliding layers on the fused decoder: dropping the window (or the local rotary base)
    changes the logits past the window and not within it."""
    m = quantized("gemma3").model
    seq = _seqs(m.cfg.vocab_size)[3]
    base = _logits(m, [seq], True)[0]
    dec, layers = m.quant_decoder, m.quant_decoder.layers
    for change in ({"window": None}, {"cos": dec.cos, "sin": dec.sin}):
        dec.layers = [ly if ly.window is None else _replace(ly, **change) for ly in layers]
        dec._tables.clear(), dec._models.clear()
        try:
            other = _logits(m, [seq], True)[0]
        finally:
            dec.layers = layers
            dec._tables.clear(), dec._models.clear()
        if "window" in change:
            assert torch.equal(other[:6], base[:6])
        assert (other[6:] - base[6:]).abs().max() > 1e-2


def _replace(layer, **kw):
    import dataclasses

    return dataclasses.replace(layer, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_row_alone_is_the_same_row_in_a_batch(family, quantized):
    """Bitwise: a sequence's prefill and decode logits alone, and beside others (a batch long
    enough that attention runs a task per token, where the lone decode step runs a task per
    chunk), and with three verify rows at once against one at a time."""
    m = quantized(family).model
    seqs = _seqs(m.cfg.vocab_size)
    long, others = seqs[4], seqs[:3]
    alone, together = _Run(m, True), _Run(m, True)
    n = len(long) - 4
    a = alone.feed([long[:n]], [0])
    b = together.feed([long[:n]] + others, [0, 0, 0, 0])
    assert torch.equal(a, b[:n])
    a = alone.feed([[long[n]]], [n])  # decode: alone, its attention split into chunk tasks
    b = together.feed([[long[n]]] + [[7]] * 3, [n] + [len(s) for s in others])
    assert torch.equal(a, b[:1])
    a = alone.feed([long[n + 1:]], [n + 1])  # three verify rows at once
    rows = [together.feed([[t]], [n + 1 + i]) for i, t in enumerate(long[n + 1:])]
    assert torch.equal(a, torch.cat(rows))


def test_three_calls_equal_one(quantized, monkeypatch):
    """The embedding scale and soft-cap in the one-call forward equal the Python ones around
    quant_decoder_layers (the path a model with a float embedding or head takes)."""
    m = quantized("gemma3").model
    seqs = _seqs(m.cfg.vocab_size)[:3]
    one = _logits(m, seqs, True)
    monkeypatch.setattr(qf.QuantDecoder, "model_table", lambda self, kv: None)
    three = _logits(m, seqs, True)
    for a, b in zip(one, three):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_scalar_build_matches_the_native_one(family, quantized, monkeypatch):
    """The scalar fallback's build (its own gelu, QK-norm and window loops) against the AVX2 one:
    the same model up to flips, as the PyTorch path is."""
    import functools

    from agentrt.kernels import quant_build
    from agentrt.kernels.quant_decoder import quant_model_forward

    m = quantized(family).model
    seqs = _seqs(m.cfg.vocab_size)[:4]
    native = _logits(m, seqs, True)
    monkeypatch.setattr(qf, "quant_model_forward", functools.partial(quant_model_forward,
                                                                     lib=quant_build.quant_kernels(scalar=True)))
    scalar = _logits(m, seqs, True)
    rel = torch.cat([(a - b).norm(dim=-1) / b.norm(dim=-1) for a, b in zip(scalar, native)])
    assert rel.median() < 1e-5 and rel.max() < 0.1, rel
