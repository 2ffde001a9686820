"""The Triton verification kernels equal spec.verify bit for bit on the same uniforms (Triton's
interpreter on CPU): ragged batches with k from 0 to 15, vocabularies spanning several blocks,
tiny probabilities (the fp64 cumsum rounds there), truncated supports, one-hot rows and p == q."""
import pytest
import torch

from agentrt.decoding.sampling import sample_from_probs
from agentrt.errors import SpecError
from agentrt.kernels.triton.verify import verify_coupled, verify_drafts, verify_greedy
from agentrt.spec import verify as cpu


def ragged_batch(seed: int, vocab: int, num_seqs: int, point_mass: bool, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randint(0, 16, (num_seqs,), generator=gen)
    k[0] = 0  # always a sequence without drafts
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), k.cumsum(0)])
    num_drafts = int(cu[-1])

    def dists(n):
        logits = torch.randn(n, vocab, generator=gen) * 6  # a long tail of tiny probabilities
        probs = logits.softmax(-1)
        probs[torch.rand(n, vocab, generator=gen) < 0.3] = 0.0  # truncated supports (top-k/top-p)
        probs[torch.arange(n), logits.argmax(-1)] += 1e-3
        onehot = torch.rand(n, generator=gen) < 0.15
        probs[onehot] = torch.nn.functional.one_hot(logits.argmax(-1)[onehot], vocab).float()
        return (probs / probs.sum(-1, keepdim=True)).to(dtype)

    target = dists(num_drafts + num_seqs)
    seq_of_draft = torch.repeat_interleave(torch.arange(num_seqs), k)
    rows = torch.arange(num_drafts) + seq_of_draft
    q = None if point_mass else dists(num_drafts)
    if q is None or num_drafts == 0:
        tokens = torch.randint(0, vocab, (num_drafts,), generator=gen)
    else:
        tokens = torch.multinomial(q.float(), 1, generator=gen).squeeze(1)
        same = torch.rand(num_drafts, generator=gen) < 0.15  # p == q: the residual has no mass
        q[same] = target[rows[same]]
    steer = torch.rand(num_drafts, generator=gen) < 0.6  # long accepted runs
    tokens[steer] = target[rows].float().argmax(-1)[steer]
    return target, tokens, cu, q, torch.rand(num_drafts, generator=gen), torch.rand(num_seqs, generator=gen)


def assert_same(kernel, reference):
    assert torch.equal(kernel.num_accepted, reference.num_accepted)
    assert torch.equal(kernel.output_tokens, reference.output_tokens)
    assert torch.equal(kernel.num_emitted, reference.num_emitted)


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("vocab,seeds", [(37, range(12)), (1000, range(3)), (4099, range(2))])
def test_verify_drafts_equals_the_cpu_path(vocab, seeds, point_mass):
    for seed in seeds:
        args = ragged_batch(seed, vocab, num_seqs=5, point_mass=point_mass)
        assert_same(verify_drafts(*args), cpu.verify_drafts(*args))


def test_half_precision_rows_and_a_batch_without_drafts():
    args = ragged_batch(7, 1000, num_seqs=4, point_mass=False, dtype=torch.float16)
    assert_same(verify_drafts(*args), cpu.verify_drafts(*args))
    target, _, _, _, _, u = ragged_batch(8, 1000, num_seqs=3, point_mass=False)
    no_drafts = (target[:3], torch.zeros(0, dtype=torch.long), torch.zeros(4, dtype=torch.long),
                 torch.zeros(0, 1000), torch.zeros(0), u)
    assert_same(verify_drafts(*no_drafts), cpu.verify_drafts(*no_drafts))


def test_ties_in_the_cdf_are_skipped_like_searchsorted():
    """Zero-probability tokens repeat the cdf value before them; uniforms that land exactly on a
    cdf value, at 0 and at 1, pick the same token as the CPU sampler."""
    target = torch.zeros(3, 70)
    target[:, [3, 40, 41, 66]] = torch.tensor([0.25, 0.25, 0.25, 0.25])
    cu = torch.tensor([0, 0, 0, 0])
    for u in ([0.0, 0.25, 0.5], [0.75, 0.9999999, 1.0]):
        args = (target, torch.zeros(0, dtype=torch.long), cu, None, torch.zeros(0), torch.tensor(u))
        assert_same(verify_drafts(*args), cpu.verify_drafts(*args))


@pytest.mark.parametrize("seed", range(4))
def test_greedy_and_coupled_equal_the_cpu_path(seed):
    target, tokens, cu, _, _, _ = ragged_batch(seed, 1000, num_seqs=6, point_mass=True)
    best = target.argmax(-1)
    assert_same(verify_greedy(best, tokens, cu), cpu.verify_greedy(best, tokens, cu))
    u_rows = torch.rand(target.shape[0], generator=torch.Generator().manual_seed(seed))
    own = sample_from_probs(target, u_rows)
    tokens = torch.where(torch.rand(tokens.shape) < 0.7, own[torch.arange(len(tokens)) + torch.repeat_interleave(
        torch.arange(len(cu) - 1), cu.diff())], tokens)  # mostly the rows' own draws: long coupled runs
    assert_same(verify_coupled(target, tokens, cu, u_rows), cpu.verify_greedy(own, tokens, cu))


def test_bad_input_is_named():
    target, tokens, cu, q, ua, us = ragged_batch(0, 37, num_seqs=3, point_mass=False)
    with pytest.raises(SpecError, match="cu_num_draft"):
        verify_drafts(target, tokens, cu.flip(0), q, ua, us)
    with pytest.raises(SpecError, match="draft_probs"):
        verify_drafts(target, tokens, cu, q[:, :5], ua, us)
    with pytest.raises(SpecError, match="no positive finite mass"):
        verify_drafts(torch.zeros_like(target), tokens, cu, None, ua, us)


@pytest.mark.parametrize("point_mass", [False, True])
def test_uniforms_on_cdf_edges_pick_the_cpu_token(point_mass, edge_uniforms):
    """The recovered/bonus token at uniforms where a one-ulp change of the cdf would change it:
    the kernel's cdf (fp64 left-to-right, rounded to fp32) is the CPU's, value for value."""
    target, tokens, cu, q, ua, us = ragged_batch(3, 4099, num_seqs=8, point_mass=point_mass)

    def final_token(u):
        res = cpu.verify_drafts(target, tokens, cu, q, ua, u)
        return res.output_tokens.gather(1, res.num_accepted.unsqueeze(1)).squeeze(1)

    for u in edge_uniforms(final_token, us * 0.9):
        assert_same(verify_drafts(target, tokens, cu, q, ua, u), cpu.verify_drafts(target, tokens, cu, q, ua, u))
