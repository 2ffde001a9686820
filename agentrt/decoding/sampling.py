"""Logit processing and inverse-CDF sampling, shared by the target and by drafters.

Exact speculative decoding preserves the distribution it is given. That distribution is the
*processed* one: `process_logits` applies temperature, top-k and top-p (in that order) and both
the target rows p and any draft rows q must go through it before `verify_drafts` sees them.
The guarantee "speculation emits tokens distributed as p" holds with respect to these processed
probabilities, not the raw softmax of the logits.

Every random number is passed in (`uniform`); nothing here draws from a generator, so a caller
that fixes its uniforms gets the same tokens on every run and on every backend.
"""
from __future__ import annotations

import torch

from agentrt.errors import RequestError, SpecError


def _check_params(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise SpecError(f"logits must be a float tensor [N, V], got {tuple(logits.shape)} {logits.dtype}")
    n = logits.shape[0]
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if t.shape != (n,):
            raise SpecError(f"{name} must have shape [{n}] (one per logits row), got {tuple(t.shape)}")
    if top_k.is_floating_point():
        raise SpecError(f"top_k must be an integer tensor, got {top_k.dtype}")
    if n == 0:
        return
    if not bool(torch.all(temperature >= 0)):
        raise RequestError(f"temperature must be >= 0, got {temperature.tolist()}")
    if not bool(torch.all(top_k >= 0)):
        raise RequestError(f"top_k must be >= 0 (0 = off), got {top_k.tolist()}")
    if not bool(torch.all((top_p > 0) & (top_p <= 1))):
        raise RequestError(f"top_p must be in (0, 1] (1 = off), got {top_p.tolist()}")


def _greedy_one_hot(logits: torch.Tensor) -> torch.Tensor:
    # torch.argmax returns the first maximal index: ties go to the lowest token id.
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)  # [N, V]
    return probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _mask_top_k(scaled: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose logit is >= the k-th largest (ties at the k-th value are all kept)."""
    vocab = scaled.shape[1]
    active = (top_k > 0) & (top_k < vocab)  # [N]
    k = torch.where(active, top_k, torch.ones_like(top_k))  # [N]
    top_values = scaled.topk(int(k.max()), dim=-1).values  # [N, max_k]
    kth = top_values.gather(1, (k - 1).unsqueeze(1))  # [N, 1]
    kth = kth.masked_fill(~active.unsqueeze(1), float("-inf"))
    return scaled.masked_fill(scaled < kth, float("-inf"))


_TOP_P_FIRST_CANDIDATES = 256  # LM distributions are peaked: the nucleus is usually far smaller


def _mask_top_p(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p, plus any token tied
    with the least likely one kept (so the result does not depend on how ties are ordered).

    Sorting a 49152-wide row costs ~12 ms on one CPU core; the nucleus is found among the top
    candidates instead, widening the search (x16, then a full sort) while some row's candidates
    hold less than its top_p.
    """
    vocab = scaled.shape[1]
    active = (top_p < 1).unsqueeze(1)  # [N, 1]
    log_total = scaled.logsumexp(dim=-1, keepdim=True)  # [N, 1]
    num_candidates = min(_TOP_P_FIRST_CANDIDATES, vocab)
    while True:
        if num_candidates < vocab:
            values = scaled.topk(num_candidates, dim=-1).values  # [N, C] descending
        else:
            values = scaled.sort(dim=-1, descending=True).values  # [N, V]
        probs = (values - log_total).exp()
        mass_before = probs.cumsum(dim=-1) - probs  # [N, C] mass of strictly better candidates
        reached = (mass_before[:, -1:] + probs[:, -1:] >= top_p.unsqueeze(1)) | ~active
        if num_candidates == vocab or bool(reached.all()):
            break
        num_candidates = num_candidates * 16 if num_candidates * 16 <= vocab // 4 else vocab
    num_kept = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp(min=1)  # [N, 1]
    threshold = values.gather(1, num_kept - 1)  # [N, 1] logit of the least likely kept token
    threshold = threshold.masked_fill(~active, float("-inf"))
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def process_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Turn logits into the processed distribution that sampling and verification both use.

    logits [N, V] any float dtype (computed in fp32); temperature [N] float (0 = greedy);
    top_k [N] int (0 or >= V = off); top_p [N] float in (0, 1] (1 = off). Returns probs [N, V] fp32.

    Order: temperature, then top-k (ties with the k-th logit are kept), then top-p on the top-k
    renormalised distribution (smallest set of most likely tokens with mass >= top_p, ties with
    the least likely kept token are kept; the most likely token always is). Rows with temperature == 0 are a one-hot of argmax(logits)
    (ties -> lowest index). Without any top-k/top-p row this never sorts the vocabulary.
    """
    _check_params(logits, temperature, top_k, top_p)
    device = logits.device
    temperature = temperature.to(device=device, dtype=torch.float32)
    top_k = top_k.to(device=device, dtype=torch.int64)
    top_p = top_p.to(device=device, dtype=torch.float32)
    logits = logits.float()  # [N, V]
    if logits.shape[0] == 0:
        return logits.clone()

    greedy = temperature == 0  # [N]
    any_greedy = bool(greedy.any())
    if any_greedy and bool(greedy.all()):
        return _greedy_one_hot(logits)

    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    vocab = logits.shape[1]
    sampled = ~greedy
    if bool(((top_k > 0) & (top_k < vocab) & sampled).any()):
        scaled = _mask_top_k(scaled, torch.where(sampled, top_k, torch.zeros_like(top_k)))
    if bool(((top_p < 1) & sampled).any()):
        scaled = _mask_top_p(scaled, torch.where(sampled, top_p, torch.ones_like(top_p)))
    probs = scaled.softmax(dim=-1)  # [N, V]
    if any_greedy:
        probs = torch.where(greedy.unsqueeze(1), _greedy_one_hot(logits), probs)
    return probs


_MASK64 = (1 << 64) - 1


def position_uniforms(seed: int, first: int, n: int) -> torch.Tensor:
    """U[0, 1) draws for output positions first..first+n-1 of a request with this seed: [n] fp32.

    Each is a function of (seed, position) alone, the position-th output of SplitMix64 (Steele et
    al., "Fast Splittable Pseudorandom Number Generators", 2014) from state `seed`, top 24 bits.
    Keyed by position rather than drawn from a stream, the token sampled at a position does not
    depend on how many steps, drafts or batch neighbours came before it."""
    out = []
    for i in range(first, first + n):
        z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out.append(((z ^ (z >> 31)) >> 40) / 16777216.0)
    return torch.tensor(out, dtype=torch.float32)


def sample_from_probs(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: token i such that cdf[i-1] <= u * total < cdf[i].

    probs [N, V] non-negative (need not sum to 1: the row total is used), uniform [N] in [0, 1).
    Returns tokens [N] int64. Never returns a zero-probability token and never indexes out of
    range, whatever the rounding of the cumulative sum: a token i with probs[i] == 0 has
    cdf[i] == cdf[i-1], so `right=True` search skips it, and u == 1 is clamped to the last
    token that adds mass. Every row must have positive finite mass.
    """
    if probs.dim() != 2 or not probs.is_floating_point():
        raise SpecError(f"probs must be a float tensor [N, V], got {tuple(probs.shape)} {probs.dtype}")
    if uniform.shape != (probs.shape[0],):
        raise SpecError(f"uniform must have shape [{probs.shape[0]}], got {tuple(uniform.shape)}")
    return sample_from_cdf(probs.float().cumsum(dim=-1), uniform)


def sample_from_cdf(cdf: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """`sample_from_probs` for a caller that already holds cdf = probs.cumsum(-1) [N, V] fp32."""
    if cdf.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=cdf.device)
    total = cdf[:, -1:].contiguous()  # [N, 1]
    usable = (total > 0) & torch.isfinite(total)
    if not bool(usable.all()):
        bad = (~usable).squeeze(1).nonzero().flatten().tolist()
        raise SpecError(f"probs rows {bad} have no positive finite mass to sample from")
    target = uniform.to(device=cdf.device, dtype=torch.float32).clamp(0.0, 1.0).unsqueeze(1) * total
    tokens = torch.searchsorted(cdf, target, right=True)  # [N, 1]
    # The first index where cdf reaches its final value always adds mass; u == 1 lands past it.
    last_with_mass = torch.searchsorted(cdf, total, right=False)  # [N, 1]
    return torch.minimum(tokens, last_with_mass).squeeze(1)
