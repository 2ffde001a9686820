"""verify_drafts: equal to the per-position reference, greedy identity, layout and errors."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrt.errors import SpecError
from agentrt.spec.verify import verify_drafts, verify_greedy, verify_reference


def random_batch(seed: int, deterministic: bool, onehot_share: float = 0.2):
    """A ragged batch with zeros, one-hot rows and draft tokens both from q and arbitrary."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = int(torch.randint(1, 9, (1,), generator=gen))
    vocab = int(torch.randint(2, 13, (1,), generator=gen))
    k = torch.randint(0, 6, (num_seqs,), generator=gen)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), k.cumsum(0)])
    num_drafts = int(cu[-1])

    def dists(n):
        logits = torch.randn(n, vocab, generator=gen) * 2
        probs = logits.softmax(-1)
        probs[torch.rand(n, vocab, generator=gen) < 0.3] = 0.0  # truncated supports (top-k/top-p)
        probs[torch.arange(n), logits.argmax(-1)] += 1e-3  # keep every row's mass positive
        onehot = torch.rand(n, generator=gen) < onehot_share
        probs[onehot] = torch.nn.functional.one_hot(logits.argmax(-1)[onehot], vocab).float()
        return probs / probs.sum(-1, keepdim=True)

    target = dists(num_drafts + num_seqs)
    draft_probs = None if deterministic else dists(num_drafts)
    if draft_probs is None or num_drafts == 0:
        tokens = torch.randint(0, vocab, (num_drafts,), generator=gen)
    else:
        tokens = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1)
        arbitrary = torch.rand(num_drafts, generator=gen) < 0.15  # q(x) may be 0 here
        tokens[arbitrary] = torch.randint(0, vocab, (int(arbitrary.sum()),), generator=gen)
        # steer some drafts to the target's argmax so long accepted runs happen
    steer = torch.rand(num_drafts, generator=gen) < 0.4
    seq_of_draft = torch.repeat_interleave(torch.arange(num_seqs), k)
    rows = torch.arange(num_drafts) + seq_of_draft
    tokens[steer] = target[rows].argmax(-1)[steer]
    if draft_probs is not None:
        draft_probs[steer] = torch.nn.functional.one_hot(tokens[steer], vocab).float()
    uniform_accept = torch.rand(num_drafts, generator=gen)
    uniform_sample = torch.rand(num_seqs, generator=gen)
    return target, tokens, cu, draft_probs, uniform_accept, uniform_sample


def assert_same(a, b):
    assert torch.equal(a.num_accepted, b.num_accepted)
    assert torch.equal(a.output_tokens, b.output_tokens)
    assert torch.equal(a.num_emitted, b.num_emitted)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), deterministic=st.booleans())
def test_batched_equals_reference(seed, deterministic):
    args = random_batch(seed, deterministic)
    assert_same(verify_drafts(*args), verify_reference(*args))


def test_one_hot_draft_rows_equal_deterministic_drafts():
    # a mixed batch passes point-mass q rows for its deterministic sequences: same result as None
    for seed in range(40):
        target, tokens, cu, _, ua, us = random_batch(seed, deterministic=True)
        point_mass = torch.nn.functional.one_hot(tokens, target.shape[1]).float()
        assert_same(verify_drafts(target, tokens, cu, point_mass, ua, us), verify_drafts(target, tokens, cu, None, ua, us))


def test_output_layout():
    target, tokens, cu, q, ua, us = random_batch(7, deterministic=False)
    before = [t.clone() for t in (target, tokens, cu, q, ua, us)]
    out = verify_drafts(target, tokens, cu, q, ua, us)
    assert all(torch.equal(a, b) for a, b in zip(before, (target, tokens, cu, q, ua, us)))
    k = cu[1:] - cu[:-1]
    assert out.output_tokens.shape == (len(k), int(k.max()) + 1)
    assert torch.equal(out.num_emitted, out.num_accepted + 1)
    assert bool((out.num_accepted <= k).all())
    for i in range(len(k)):
        n = int(out.num_accepted[i])
        row = out.output_tokens[i]
        assert row[:n].tolist() == tokens[cu[i] : cu[i] + n].tolist()
        assert 0 <= int(row[n]) < target.shape[1]
        assert bool((row[n + 1 :] == -1).all())


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_identity_on_one_hot_targets(with_q):
    gen = torch.Generator().manual_seed(11)
    vocab, k = 7, torch.tensor([0, 1, 3, 5, 5, 2, 4])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), k.cumsum(0)])
    argmax = torch.randint(0, vocab, (int(cu[-1]) + len(k),), generator=gen)
    target = torch.nn.functional.one_hot(argmax, vocab).float()
    seq_of_draft = torch.repeat_interleave(torch.arange(len(k)), k)
    rows = torch.arange(int(cu[-1])) + seq_of_draft
    tokens = torch.where(torch.rand(int(cu[-1]), generator=gen) < 0.7, argmax[rows], torch.randint(0, vocab, rows.shape, generator=gen))
    q = torch.rand(int(cu[-1]), vocab, generator=gen).softmax(-1) if with_q else None
    for uniform_value in (0.0, 0.5, 1.0 - 2**-24):
        ua = torch.full((int(cu[-1]),), uniform_value)
        us = torch.full((len(k),), uniform_value)
        out = verify_drafts(target, tokens, cu, q, ua, us)
        for i in range(len(k)):
            expected = []
            for j in range(int(k[i])):
                row = int(cu[i]) + i + j
                if int(tokens[cu[i] + j]) != int(argmax[row]):
                    break
                expected.append(int(argmax[row]))
            expected.append(int(argmax[int(cu[i]) + i + len(expected)]))
            assert out.output_tokens[i, : len(expected)].tolist() == expected
            assert int(out.num_accepted[i]) == len(expected) - 1


@settings(max_examples=100, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), deterministic=st.booleans())
def test_verify_greedy_equals_verify_drafts_on_one_hot_rows(seed, deterministic):
    """The engine's temperature-0 path: same result for any q and any uniforms."""
    target, tokens, cu, q, ua, us = random_batch(seed, deterministic, onehot_share=1.0)
    best = target.argmax(-1)
    assert_same(verify_greedy(best, tokens, cu), verify_drafts(target, tokens, cu, q, ua, us))


def test_all_k_zero_emits_one_target_sample_each():
    target = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
    cu = torch.zeros(3, dtype=torch.int64)
    out = verify_drafts(target, torch.zeros(0, dtype=torch.int64), cu, None, torch.zeros(0), torch.tensor([0.3, 0.7]))
    assert out.output_tokens.tolist() == [[1], [2]]
    assert out.num_accepted.tolist() == [0, 0]


def test_residual_without_mass_falls_back_to_target():
    # p == q with u landing on the boundary at p(x) == q(x) == 0: rejected, residual is empty
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    cu = torch.tensor([0, 1])
    out = verify_drafts(p, torch.tensor([2]), cu, p[:1].clone(), torch.tensor([0.5]), torch.tensor([0.9]))
    assert out.num_accepted.tolist() == [0]
    assert out.output_tokens.tolist() == [[1, -1]]


def test_bad_inputs_name_the_argument():
    p = torch.full((3, 4), 0.25)
    cu = torch.tensor([0, 2])
    tok = torch.tensor([1, 2])
    ok = dict(draft_probs=None, uniform_accept=torch.rand(2), uniform_sample=torch.rand(1))
    verify_drafts(p, tok, cu, **ok)
    with pytest.raises(SpecError, match="target_probs"):
        verify_drafts(p[:2], tok, cu, **ok)
    with pytest.raises(SpecError, match="cu_num_draft"):
        verify_drafts(p, tok, torch.tensor([0, 3]), **ok)
    with pytest.raises(SpecError, match="draft_tokens"):
        verify_drafts(p, torch.tensor([1, 4]), cu, **ok)
    with pytest.raises(SpecError, match="draft_probs"):
        verify_drafts(p, tok, cu, torch.full((2, 3), 1 / 3), ok["uniform_accept"], ok["uniform_sample"])
    with pytest.raises(SpecError, match="uniform_accept"):
        verify_drafts(p, tok, cu, None, torch.rand(3), ok["uniform_sample"])
    with pytest.raises(SpecError, match="uniform_sample"):
        verify_drafts(p, tok, cu, None, ok["uniform_accept"], torch.rand(2))
