"""The fused quantized decoder (agentrt/engine/models/quant_forward.py) on the embedded SmolLM2's
GGUF blocks, against the PyTorch path of the same model object (`quant_fused = False`).

Both compute the same model: the same Q4_1/Q8_0 blocks, the same int8 activation blocks before
every linear, bf16 queries and softmax numerators in the attention. They differ by fp32 summation
order (RMSNorm's mean, attention, the softmax sum) and exp() rounding, and such a last-bit
difference moves an activation's int8 rounding by one step (amax/127 of its block of 32) when it
sits at a rounding tie (or a numerator's bf16 rounding). Hence the bounds:
- one layer on the PyTorch path's own input: a token row agrees to 1e-5 of the layer's update
  (fp32 order alone: observed <= 1.4e-6) unless a flip hit it; >= 90% of the rows of layers
  1..29 do (observed 96%), every row of every layer is within 2e-2 (a flip moves a row by <1%:
  observed 6.8e-3). Layer 0 reads the Q8_0 embedding, whose normalized rows hit exact ties
  (x * 127/amax = k + 1/2 up to rounding: 0.1% of the activations, 500x chance), so nearly every
  row flips somewhere there (observed 1e-2 at most);
- the whole model: flips in 30 layers add up to ~3% of the logits (relative L2 per position), as
  far as the PyTorch path is from its own batch-invariant variant (models/invariant.py: the same
  ops summed in another order): fused mean <= 1.5x that distance (observed 1.0x), median < 6%,
  max < 35% (observed 3% and 9%; the invariant variant 12%, the scalar build against the AVX2
  one 19% at one position), the same argmax at >= 90% of positions (observed 54 of 56).
"""
from __future__ import annotations

import collections
import functools

import pytest
import torch

from agentrt.engine import SamplingParams, SpecConfig
from agentrt.engine.kv.block_manager import BlockManager
from agentrt.engine.kv.kv_cache import KVCache
from agentrt.engine.models import quant_forward as qf
from agentrt.engine.models.attention import build_attention_metadata
from agentrt.engine.models.layers import apply_rotary, rms_norm
from agentrt.engine.models.llama import ForwardBatch
from agentrt.kernels import quant_build
from agentrt.kernels.quant_decoder import quant_attention_reference, quant_decoder_layers, quant_model_forward

CHATS = [  # tests/engine/test_spec_engine.py's
    [{"role": "user", "content": "Repeat exactly: red green blue, red green blue, red green blue."}],
    [{"role": "user", "content": 'Write JSON with keys "city" and "days" for Paris, 3.'}],
    [{"role": "user", "content": "Count from 1 to 12."}],
    [{"role": "user", "content": "What is a hash table?"}],
]
PROMPTS = ["The quick brown fox jumps over the lazy dog. The capital of France is", "def fib(n):\n    return",
           "Write a haiku about the sea.", "In 1492, Columbus sailed across the Atlantic Ocean and reached the "
           "islands of the Caribbean, which he believed to be"]


@pytest.fixture(scope="module")
def quant(smollm2_quant):
    assert smollm2_quant.model.quant_fused  # on by default wherever it can run
    yield smollm2_quant
    smollm2_quant.model.quant_fused = True


class Cache:
    """A KV cache and its block manager; step() feeds each sequence's new tokens."""

    def __init__(self, m, blocks=64, block_size=16):
        self.m, self.done = m, {}
        self.bm, self.kv = BlockManager(blocks, block_size), KVCache(m.cfg, blocks * block_size, block_size, m.kv_dtype)

    def batch(self, feeds: list[list[int]], logits_indices=None) -> ForwardBatch:
        ids, pos, slots, ctx = [], [], [], []
        for sid, f in enumerate(feeds):
            s = self.done.get(sid, 0)
            self.bm.grow(sid, s + len(f))
            ids += f
            pos += range(s, s + len(f))
            slots += self.bm.slots(sid, s, s + len(f))
            ctx.append(s + len(f))
            self.done[sid] = s + len(f)
        positions = torch.tensor(pos)
        meta = build_attention_metadata([len(f) for f in feeds], ctx, positions,
                                        [self.bm.tables[i] for i in range(len(feeds))], self.bm.block_size,
                                        torch.device("cpu"))
        return ForwardBatch(torch.tensor(ids), positions, torch.tensor(slots), meta, logits_indices)

    def step(self, feeds, fused=True, logits_indices=None, **kw):
        self.m.quant_fused = fused
        try:
            return self.m.forward(self.batch(feeds, logits_indices), self.kv, **kw)
        finally:
            self.m.quant_fused = True


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # per row
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def _torch_layer(m, li: int, h: torch.Tensor, kv: KVCache, batch: ForwardBatch) -> torch.Tensor:
    """Layer li of LlamaModel.forward's PyTorch path."""
    cfg, layer, T = m.cfg, m.layers[li], h.shape[0]
    nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cos, sin = m.rope.tables(batch.positions, m.dtype)
    q, k, v = layer.qkv(rms_norm(h, layer.attn_norm, cfg.rms_norm_eps)).split([nq * d, nkv * d, nkv * d], dim=-1)
    q, k = apply_rotary(q.view(T, nq, d), cos, sin), apply_rotary(k.view(T, nkv, d), cos, sin)
    kv.write(li, batch.slot_mapping, k, v.view(T, nkv, d))
    a = batch.attn  # the attention's roundings as the fused decoder's (bf16 queries, bf16 numerators per chunk)
    attn = quant_attention_reference(q, kv.k[li], kv.v[li], a.cu_q, a.positions, a.block_tables, a.block_size, m.scale)
    h = h + layer.o(attn.reshape(T, nq * d))
    gate, up = layer.gate_up(rms_norm(h, layer.mlp_norm, cfg.rms_norm_eps)).chunk(2, dim=-1)
    return h + layer.down(torch.nn.functional.silu(gate) * up)


def test_one_layer_matches_the_torch_path(quant):
    """Each layer on the PyTorch path's input to it: bounds in the module docstring."""
    m = quant.model
    ids = quant.tokenizer.encode(PROMPTS[0])
    ref, fused = Cache(m), Cache(m)
    batch = ref.batch([ids])
    table, dec = m.quant_decoder.table(fused.kv), m.quant_decoder
    h, errs = m.embed[batch.input_ids], []
    for li in range(m.num_layers):
        want = _torch_layer(m, li, h, ref.kv, batch)
        got = h.clone()
        quant_decoder_layers(table[li:], 1, dec.dims, got, batch.positions, dec.cos, dec.sin, batch.slot_mapping,
                             fused.kv.k[0].shape[0], batch.attn.cu_q, batch.attn.block_tables, batch.attn.block_size)
        errs.append((got - want).norm(dim=-1) / (want - h).norm(dim=-1))  # relative to the layer's update
        h = want
    errs = torch.stack(errs)  # [layers, T]
    assert errs.max() <= 2e-2, errs.max()
    assert (errs[1:] <= 1e-5).float().mean() >= 0.9, errs[1:]


def test_whole_model_logits_close_to_the_torch_path(quant):
    """Bounds in the module docstring, over the positions of four prompts."""
    m, rel, rel_inv, agree = quant.model, [], [], []
    for p in PROMPTS:
        ids = quant.tokenizer.encode(p)
        fused = Cache(m).step([ids]).logits
        ref = Cache(m).step([ids], fused=False).logits
        inv = Cache(m).step([ids], fused=False, batch_invariant=True).logits
        rel.append(_rel(fused, ref))
        rel_inv.append(_rel(inv, ref))
        agree.append(fused.argmax(-1) == ref.argmax(-1))
    rel, rel_inv, agree = torch.cat(rel), torch.cat(rel_inv), torch.cat(agree)
    assert agree.float().mean() >= 0.9, agree
    assert rel.median() < 0.06 and rel.max() < 0.35, rel
    assert rel.mean() <= 1.5 * rel_inv.mean(), (rel.mean(), rel_inv.mean())


def test_logits_are_batch_and_thread_invariant(quant):
    """A sequence's logits bits: alone or in a batch of 3 (prefill, then decode), its k+1 verify
    rows at once or one at a time, on 1 thread or all."""
    m, tok = quant.model, quant.tokenizer
    seqs = [tok.encode(p) for p in PROMPTS[:3]]
    draft = tok.encode(" Paris, and the capital of")[:5]
    alone, together = Cache(m), Cache(m)
    a = alone.step([seqs[0]]).logits
    b = together.step(seqs).logits
    assert torch.equal(a, b[: len(seqs[0])])
    a = alone.step([draft]).logits  # verification: 5 rows at once
    b = together.step([draft, draft[:1], draft[:3]]).logits
    assert torch.equal(a, b[: len(draft)])
    one_by_one = Cache(m)
    one_by_one.step([seqs[0]])
    rows = [one_by_one.step([[t]]).logits for t in draft]
    assert torch.equal(a, torch.cat(rows))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = Cache(m).step(seqs).logits
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, Cache(m).step(seqs).logits)


@pytest.mark.parametrize("tiles", [False, True], ids=["vector-attention", "amx-tile-attention"])
def test_greedy_identity_with_speculation_without_batch_invariant(quant, make_engine, tiles):
    """Suffix drafting (k=6) at batch 4, 28 tokens: the same tokens as plain decoding, with the
    engine's default batch_invariant=False (the fused decoder is invariant by itself); and so with
    the attention on AMX tiles, where a decode row's 3 queries and a verification's 21 take the
    same tile arithmetic."""
    lib = quant_build.quant_kernels()
    if tiles:
        try:
            quant_build.attention_tiles(lib, True)
        except ValueError as e:
            pytest.skip(str(e))
    try:
        params = SamplingParams(max_tokens=28, temperature=0)
        base = make_engine(quant)
        assert not base.config.batch_invariant and base.model.quant_fused
        want = [r.token_ids for r in base.generate(CHATS, params)]
        got = make_engine(quant, spec=SpecConfig(drafter="suffix", k=6)).generate(CHATS, params)
    finally:
        quant_build.attention_tiles(lib, False)
    assert [r.token_ids for r in got] == want
    total = collections.Counter()
    for r in got:
        total.update({k: v for k, v in r.spec.total.to_dict().items() if isinstance(v, int)})
    assert total["drafted"] > 0 and total["emitted"] == sum(len(w) for w in want)


@pytest.mark.parametrize("num_layers", [12, None])
def test_layer_skip_logits_indices_and_hidden(quant, num_layers):
    """num_layers (a layer-skip draft: later layers' caches untouched), logits_indices and
    return_hidden as on the PyTorch path: same shapes, values within the whole-model bounds
    (observed <= 4%), the chosen rows bit-equal to those of an all-rows forward, and
    logits = lm_head(hidden)."""
    m = quant.model
    ids = quant.tokenizer.encode(PROMPTS[3])
    rows = torch.tensor([len(ids) - 1, 0, 7])
    fused_cache = Cache(m)
    fused = fused_cache.step([ids], logits_indices=rows, num_layers=num_layers, return_hidden=True)
    ref = Cache(m).step([ids], fused=False, logits_indices=rows, num_layers=num_layers, return_hidden=True)
    assert fused.logits.shape == ref.logits.shape == (3, m.cfg.vocab_size)
    assert fused.hidden.shape == ref.hidden.shape == (3, m.cfg.hidden_size)
    assert _rel(fused.logits, ref.logits).max() < 0.35 and _rel(fused.hidden, ref.hidden).max() < 0.35
    assert torch.equal(fused.logits, m.lm_head(fused.hidden))
    everything = Cache(m).step([ids], num_layers=num_layers).logits
    assert torch.equal(fused.logits, everything[rows])
    n = num_layers or m.num_layers
    assert all(not fused_cache.kv.k[i].any() and not fused_cache.kv.v[i].any() for i in range(n, m.num_layers))
    assert all(fused_cache.kv.k[i].any() for i in range(n))


@pytest.mark.parametrize("num_layers", [12, None])
def test_one_call_equals_three(quant, monkeypatch, num_layers):
    """The one-call forward (embedding, layers, norm, head: quant_model_forward) against the
    embedding lookup, the decoder call and the head call it replaces: the same bits, logits and
    hidden, for chosen rows and a batch of two; an id outside the vocabulary raises IndexError
    before any cache row is written."""
    m, tok = quant.model, quant.tokenizer
    feeds = [tok.encode(PROMPTS[1]), tok.encode(PROMPTS[2])]
    rows = torch.tensor([len(feeds[0]) - 1, 0, len(feeds[0]) + 2])
    one = Cache(m).step(feeds, logits_indices=rows, num_layers=num_layers, return_hidden=True)
    monkeypatch.setattr(m.quant_decoder, "embedding", None)  # the model table's switch
    monkeypatch.setattr(qf, "quant_model_forward", lambda *a, **k: pytest.fail("the one-call path ran"))
    three = Cache(m).step(feeds, logits_indices=rows, num_layers=num_layers, return_hidden=True)
    assert torch.equal(one.logits, three.logits) and torch.equal(one.hidden, three.hidden)
    monkeypatch.undo()
    cache = Cache(m)
    with pytest.raises(IndexError, match="quant_model_forward"):
        cache.step([[1, 2, m.cfg.vocab_size]])
    assert not any(k.any() for k in cache.kv.k)


def test_scalar_build_matches_the_native_one(quant, monkeypatch):
    """The whole model on the scalar fallback's build (embedding, decoder and head): as close to
    the AVX2 build as the PyTorch path is (bounds in the module docstring; observed median 2.9%,
    max 19%, the same argmax everywhere)."""
    m = quant.model
    ids = quant.tokenizer.encode(PROMPTS[0])
    native = Cache(m).step([ids]).logits
    scalar_lib = quant_build.quant_kernels(scalar=True)
    assert scalar_lib is not None
    monkeypatch.setattr(qf, "quant_model_forward", functools.partial(quant_model_forward, lib=scalar_lib))
    scalar = Cache(m).step([ids]).logits
    rel = _rel(scalar, native)
    assert rel.median() < 0.06 and rel.max() < 0.35, rel
    assert (scalar.argmax(-1) == native.argmax(-1)).float().mean() >= 0.9


def test_switches(quant, monkeypatch):
    """quant_fused=False runs the PyTorch path; AGENTRT_KERNELS=0 leaves the fused path unsupported;
    a model without the decoder cannot turn it on."""
    m = quant.model
    monkeypatch.setattr("agentrt.engine.models.llama.quant_forward", lambda *a, **k: pytest.fail("the fused path ran"))
    Cache(m).step([[1, 2, 3]], fused=False)
    monkeypatch.setenv("AGENTRT_KERNELS", "0")
    monkeypatch.setattr(quant_build, "_loaded", {})
    assert "AGENTRT_KERNELS=0" in qf.quant_support(m)
    monkeypatch.setattr(m, "quant_decoder", None)
    with pytest.raises(ValueError, match="fused quantized decoder cannot run"):
        m.quant_fused = True
