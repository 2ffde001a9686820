"""Grammar-masked argmax and sampling kernels (Triton's interpreter on CPU) against the CPU path:
xgrammar's masking, argmax_reference, process_logits and sample_from_probs."""
import pytest
import torch

from agentrt.decoding.sampling import process_logits, sample_from_probs
from agentrt.errors import SpecError
from agentrt.kernels.argmax import argmax_reference, unpack_bitmask
from agentrt.kernels.triton.masked_sample import masked_argmax, masked_sample
from agentrt.structured.grammar import apply_masks


def random_masks(gen: torch.Generator, rows: int, vocab: int, density: float) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32 bitmasks with about `density` of the tokens allowed."""
    allowed = torch.rand(rows, vocab, generator=gen) < density
    words = (vocab + 31) // 32
    bits = torch.zeros(rows, words * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    packed = (bits.view(rows, words, 32) << torch.arange(32)).sum(-1)  # bit j of word w: token 32 w + j
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [1000, 4099])
def test_masked_argmax_equals_the_reference_and_xgrammar_masking(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-4, 5, (8, vocab), generator=gen).to(dtype)  # many exact ties
    logits[1, 17] = logits[1, 900] = float("nan")  # a NaN ranks above everything, the first one wins
    mask = random_masks(gen, 8, vocab, density=0.05)
    mask[3] = 0  # nothing allowed: token 0, as argmax over -inf
    mask[1, 0] |= 1 << 17  # both NaNs allowed
    mask[1, 28] |= 1 << 4
    mask_rows = torch.tensor([0, 1, 2, 3, -1, 5, 6, 7])  # row 4 unmasked
    got = masked_argmax(logits, mask, mask_rows)
    assert torch.equal(got, argmax_reference(logits, mask, mask_rows))
    assert int(got[3]) == 0 and int(got[1]) == 17
    masked = logits.float().clone()
    apply_masks(masked, mask, [0, 1, 2, 3, 5, 6, 7])  # what the engine's CPU path does before argmax
    assert torch.equal(got, masked.argmax(-1))
    assert torch.equal(masked_argmax(logits), logits.argmax(-1))  # no mask: torch.argmax


def test_a_mask_narrower_than_the_vocabulary_allows_nothing_past_it():
    logits = torch.arange(100, dtype=torch.float32).unsqueeze(0)  # the best tokens are the last
    mask = torch.full((1, 2), -1, dtype=torch.int32)  # tokens 0..63 allowed
    assert int(masked_argmax(logits, mask)[0]) == 63
    assert torch.equal(masked_argmax(logits, mask), argmax_reference(logits, mask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_masked_sample_equals_the_engine_cpu_sampling(dtype):
    """The engine masks the logits, processes them (temperature, top-k, top-p) and samples by
    inverse CDF; the kernel on those probabilities, with the mask, draws the same token."""
    gen = torch.Generator().manual_seed(1)
    vocab, rows = 4099, 6
    logits = torch.randn(rows, vocab, generator=gen) * 4
    mask = random_masks(gen, rows, vocab, density=0.3)
    masked = logits.clone()
    apply_masks(masked, mask, list(range(rows)))
    probs = process_logits(masked, torch.tensor([1.0, 0.7, 1.3, 0.0, 1.0, 0.9]),
                           torch.tensor([0, 50, 0, 0, 0, 7]), torch.tensor([1.0, 1.0, 0.9, 1.0, 1.0, 0.5])).to(dtype)
    u = torch.rand(rows, generator=gen)
    assert torch.equal(masked_sample(probs, u, mask), sample_from_probs(probs, u))


def test_masked_sample_on_cdf_edges_equals_sampling_the_masked_probabilities(edge_uniforms):
    """Uniforms where a one-ulp change of any cdf value changes the token; unmasked probabilities
    masked in the kernel (rows -1: no mask) against the CPU sampler on a masked copy."""
    gen = torch.Generator().manual_seed(2)
    vocab, rows = 4099, 8
    probs = (torch.randn(rows, vocab, generator=gen) * 6).softmax(-1)  # tiny tails: the fp64 sums round
    mask = random_masks(gen, rows, vocab, density=0.5)
    mask_rows = torch.tensor([0, 1, -1, 3, 4, 5, 6, 7])
    allowed = unpack_bitmask(mask[mask_rows.clamp(min=0)], vocab) | (mask_rows < 0).unsqueeze(1)
    masked = probs.masked_fill(~allowed, 0.0)
    for u in edge_uniforms(lambda u: sample_from_probs(masked, u), torch.rand(rows, generator=gen) * 0.95):
        assert torch.equal(masked_sample(probs, u, mask, mask_rows), sample_from_probs(masked, u))


def test_temperature_rows_masked_after_processing_draw_what_the_engine_draws():
    """Masking the logits before softmax or the probabilities after it gives the same distribution;
    away from cdf edges (ulp-level differences of the two softmaxes) the same token."""
    gen = torch.Generator().manual_seed(3)
    vocab, rows = 1000, 16
    logits = torch.randn(rows, vocab, generator=gen) * 3
    mask = random_masks(gen, rows, vocab, density=0.2)
    ones, zeros = torch.ones(rows), torch.zeros(rows, dtype=torch.long)
    masked = logits.clone()
    apply_masks(masked, mask, list(range(rows)))
    u = torch.rand(rows, generator=gen)
    engine = sample_from_probs(process_logits(masked, ones * 0.8, zeros, ones), u)
    assert torch.equal(masked_sample(process_logits(logits, ones * 0.8, zeros, ones), u, mask), engine)


def test_bad_input_is_named():
    probs = torch.rand(2, 64)
    with pytest.raises(SpecError, match="no positive finite mass"):
        masked_sample(probs, torch.rand(2), torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(SpecError, match="int32 bitmask"):
        masked_argmax(probs, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(SpecError, match="mask_rows"):
        masked_argmax(probs, torch.zeros(2, 2, dtype=torch.int32), torch.tensor([0, 5]))
    with pytest.raises(SpecError, match="uniform"):
        masked_sample(probs, torch.rand(3))
