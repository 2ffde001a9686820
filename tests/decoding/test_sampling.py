"""process_logits (temperature, top-k, top-p, greedy) and the inverse-CDF sampler."""
import pytest
import torch

import agentrt.decoding.sampling as sampling
from agentrt.decoding.sampling import process_logits, sample_from_probs
from agentrt.errors import RequestError, SpecError


def params(n, temperature=1.0, top_k=0, top_p=1.0):
    return (
        torch.full((n,), float(temperature)),
        torch.full((n,), int(top_k), dtype=torch.int64),
        torch.full((n,), float(top_p)),
    )


def test_temperature_is_softmax_of_scaled_logits():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    probs = process_logits(logits, *params(5, temperature=0.7))
    torch.testing.assert_close(probs, (logits / 0.7).softmax(-1))
    assert probs.dtype == torch.float32


def test_greedy_rows_are_one_hot_of_argmax_with_lowest_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, 0.5, 0.4]])
    temperature, top_k, top_p = params(3, temperature=0.0)
    probs = process_logits(logits, temperature, top_k, top_p)
    expected = torch.zeros(3, 4)
    expected[0, 1] = expected[1, 0] = expected[2, 2] = 1.0
    assert torch.equal(probs, expected)


def test_mixed_batch_rows_match_rows_processed_alone():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 20, generator=gen)
    temperature = torch.tensor([0.0, 1.0, 0.5, 1.3, 0.0, 0.9])
    top_k = torch.tensor([0, 5, 0, 3, 2, 0])
    top_p = torch.tensor([1.0, 1.0, 0.7, 0.9, 0.5, 1.0])
    batched = process_logits(logits, temperature, top_k, top_p)
    for i in range(6):
        alone = process_logits(logits[i : i + 1], temperature[i : i + 1], top_k[i : i + 1], top_p[i : i + 1])
        torch.testing.assert_close(batched[i : i + 1], alone)


def test_top_k_keeps_the_k_largest_and_ties_at_the_kth():
    logits = torch.tensor([[0.0, 4.0, 1.0, 3.0, 2.0], [1.0, 2.0, 2.0, 2.0, 0.0]])
    probs = process_logits(logits, *params(2, top_k=2))
    kept = probs > 0
    assert kept[0].tolist() == [False, True, False, True, False]
    assert kept[1].tolist() == [False, True, True, True, False]  # three-way tie at the 2nd value
    torch.testing.assert_close(probs[0, [1, 3]], logits[0, [1, 3]].softmax(-1))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    base = torch.tensor([[0.45, 0.25, 0.15, 0.1, 0.05]])
    logits = base.log()
    kept = lambda p: (process_logits(logits, *params(1, top_p=p)) > 0)[0].tolist()  # noqa: E731
    assert kept(0.4) == [True, False, False, False, False]
    assert kept(0.6) == [True, True, False, False, False]
    assert kept(0.72) == [True, True, True, False, False]
    assert kept(0.99) == [True, True, True, True, True]
    probs = process_logits(logits, *params(1, top_p=0.72))
    torch.testing.assert_close(probs[0, :3], base[0, :3] / base[0, :3].sum())


def test_top_k_applies_before_top_p():
    base = torch.tensor([[0.35, 0.3, 0.2, 0.15]])
    # top-k 2 leaves {0.54, 0.46}: top-p 0.5 then keeps one token (on the raw p it would keep two)
    probs = process_logits(base.log(), *params(1, top_k=2, top_p=0.5))
    assert (probs > 0)[0].tolist() == [True, False, False, False]
    assert (process_logits(base.log(), *params(1, top_p=0.5)) > 0)[0].tolist() == [True, True, False, False]


def test_top_p_keeps_ties_with_the_last_kept_token():
    base = torch.tensor([[0.4, 0.2, 0.2, 0.2]])
    assert (process_logits(base.log(), *params(1, top_p=0.5)) > 0)[0].tolist() == [True, True, True, True]


def test_top_p_on_a_flat_wide_vocabulary_widens_its_search():
    # the nucleus of a flat 5000-token distribution is far more than the first candidates
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(4)) * 0.1
    top_p = torch.tensor([0.9, 1.0, 0.3])
    probs = process_logits(logits, torch.ones(3), torch.zeros(3, dtype=torch.int64), top_p)
    for row in range(3):
        ordered = logits[row].softmax(-1).sort(descending=True).values
        needed = int((ordered.cumsum(0) - ordered < top_p[row]).sum())
        assert int((probs[row] > 0).sum()) == needed


def test_low_precision_logits_are_processed_in_fp32():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    for dtype in (torch.float16, torch.bfloat16):
        probs = process_logits(logits.to(dtype), *params(3, temperature=0.8, top_p=0.9))
        assert probs.dtype == torch.float32
        torch.testing.assert_close(probs.sum(-1), torch.ones(3))


def test_fast_path_never_sorts(monkeypatch):
    def no_sort(*args, **kwargs):
        raise AssertionError("sorted the vocabulary without top-k/top-p")

    monkeypatch.setattr(sampling, "_mask_top_p", no_sort)
    monkeypatch.setattr(sampling, "_mask_top_k", no_sort)
    logits = torch.randn(4, 100)
    process_logits(logits, torch.tensor([0.0, 1.0, 0.5, 2.0]), torch.zeros(4, dtype=torch.int64), torch.ones(4))
    # top-k/top-p on greedy rows is irrelevant, so it must not trigger the slow path either
    process_logits(logits, torch.zeros(4), torch.full((4,), 3), torch.full((4,), 0.5))


def test_bad_parameters_name_the_parameter():
    logits = torch.zeros(2, 4)
    with pytest.raises(RequestError, match="temperature"):
        process_logits(logits, torch.tensor([1.0, -0.1]), torch.zeros(2, dtype=torch.int64), torch.ones(2))
    with pytest.raises(RequestError, match="top_p"):
        process_logits(logits, torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.tensor([1.0, 0.0]))
    with pytest.raises(RequestError, match="top_k"):
        process_logits(logits, torch.ones(2), torch.tensor([0, -1]), torch.ones(2))
    with pytest.raises(SpecError, match="temperature"):
        process_logits(logits, torch.ones(3), torch.zeros(2, dtype=torch.int64), torch.ones(2))


def test_inverse_cdf_follows_the_probabilities_exactly_on_a_uniform_grid():
    probs = torch.tensor([[0.1, 0.0, 0.4, 0.0, 0.5]]).repeat(1000, 1)
    uniform = (torch.arange(1000) + 0.5) / 1000
    counts = torch.bincount(sample_from_probs(probs, uniform), minlength=5)
    assert counts.tolist() == [100, 0, 400, 0, 500]


def test_sampler_never_returns_zero_probability_tokens_or_out_of_range():
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(400, 64, generator=gen)
    probs[probs < 0.7] = 0.0  # sparse rows; trailing zeros are common
    probs[:, -5:] = 0.0
    probs[0] = 0.0
    probs[0, 0] = 1e-30  # a single tiny mass
    uniform = torch.cat([torch.tensor([0.0, 1.0, 1.0 - 2**-24, 0.5]), torch.rand(396, generator=gen)])
    tokens = sample_from_probs(probs, uniform)
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 64
    assert bool((probs.gather(1, tokens.unsqueeze(1)) > 0).all())
    assert tokens[0] == 0


def test_unnormalised_rows_scale_by_their_total():
    probs = torch.tensor([[2.0, 6.0], [0.0, 3.0]])
    tokens = sample_from_probs(probs, torch.tensor([0.26, 0.1]))
    assert tokens.tolist() == [1, 1]


def test_rows_without_mass_are_rejected():
    with pytest.raises(SpecError, match=r"rows \[1\]"):
        sample_from_probs(torch.tensor([[1.0, 0.0], [0.0, 0.0]]), torch.tensor([0.5, 0.5]))
    with pytest.raises(SpecError, match="uniform"):
        sample_from_probs(torch.ones(2, 3), torch.rand(3))


def test_position_uniforms_are_keyed_by_seed_and_position():
    from agentrt.decoding.sampling import position_uniforms

    u = position_uniforms(7, 0, 10)
    assert u.dtype == torch.float32 and u.shape == (10,)
    assert torch.equal(position_uniforms(7, 4, 6), u[4:])  # a position's draw does not depend on where a call starts
    assert not torch.equal(position_uniforms(8, 0, 10), u)
    assert position_uniforms(7, 0, 0).shape == (0,)


def test_position_uniforms_are_uniform():
    """20 equal bins over 20,000 draws (1,000 seeds x 20 positions): chi-square with 19 degrees of
    freedom stays under 43.8 with probability 0.999 for uniform draws."""
    from agentrt.decoding.sampling import position_uniforms

    u = torch.cat([position_uniforms(seed, 0, 20) for seed in range(1000)])
    assert bool(((u >= 0) & (u < 1)).all())
    counts = torch.histc(u, bins=20, min=0.0, max=1.0)
    chi2 = float(((counts - 1000.0) ** 2 / 1000.0).sum())
    assert chi2 < 43.8, chi2
