"""Penalties, logit bias and min_tokens (agentrt.decoding.penalties): every verify row equals the
plain one-position rule applied after its own prefix (output + the drafts before it), for
random logits, prefixes and drafts."""
from __future__ import annotations

import random

import pytest
import torch

from agentrt.decoding.penalties import Penalties, penalize, penalize_reference

CASES = [
    Penalties(frequency=0.7),
    Penalties(presence=-0.4),
    Penalties(repetition=1.3),
    Penalties(repetition=0.8, frequency=0.2, presence=0.5),
    Penalties(logit_bias=((3, 5.0), (7, -100.0))),
    Penalties(min_tokens=4, stop_ids=(0, 2)),
    Penalties(frequency=1.5, presence=2.0, repetition=2.0, logit_bias=((1, 1.0),), min_tokens=3, stop_ids=(0,)),
]


@pytest.mark.parametrize("pen", CASES, ids=lambda p: repr(p)[10:60])
@pytest.mark.parametrize("seed", range(4))
def test_every_row_is_the_rule_after_its_own_prefix(pen, seed):
    rng = random.Random(seed)
    vocab, k = 11, rng.randint(0, 5)
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
    output = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
    drafts = [rng.randrange(vocab) for _ in range(k)]
    logits = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    got = logits.clone()
    penalize(got, pen, prompt, output, drafts)
    for j in range(k + 1):
        want = penalize_reference(logits[j], pen, prompt, output + drafts[:j])
        torch.testing.assert_close(got[j], want, rtol=1e-6, atol=1e-6)


def test_inactive_penalties_are_recognised():
    assert not Penalties().active
    assert not Penalties(stop_ids=(0,)).active  # stop ids alone (no min_tokens) change nothing
    assert all(p.active for p in CASES)


def test_min_tokens_masks_only_rows_before_the_minimum():
    logits = torch.zeros(4, 5)
    penalize(logits, Penalties(min_tokens=3, stop_ids=(4,)), [1], [2], [1, 1, 1])  # 1 generated so far
    assert logits[:, 4].tolist() == [float("-inf"), float("-inf"), 0.0, 0.0]
