"""What one step emits per row: penalties on each verified row, then the greedy argmax or the
processed p, and exact verification of the drafts (spec.verify) or plain sampling. The results
are returned (`Sampled`); the engine commits them (Sequence.commit).

Sampling is keyed by position: the token at output position n is drawn from its processed p
with the request's uniform for n (decoding.sampling.position_uniforms). Drafts that are tokens, not
distributions (the template and suffix drafters'), are verified by coupling:
a draft is accepted iff it equals the target's own draw at its position (spec.verify:
verify_greedy), which accepts x with probability p(x), as the rejection rule does for a point
mass. So a seeded request samples the same tokens with or without drafts, at any k, whatever
runs beside it. Drafts with a distribution q (layer-skip and draft models) go through the
rejection rule with uniforms from each request's generator, for every row of the step.

The logits hold only sampling rows, k + 1 per row from its first_row: the next token's and one
after each draft token. Greedy rows skip the [rows, vocab] distributions altogether: the argmax
under the grammar mask is exactly what masking, one-hot processing and sampling or verification
would return (~1 ms of a 10-16 ms batch-1 step, more with drafts).

The greedy argmax, the draw and both verifications run on the model's kernel backend: the
Triton kernels (kernels/triton: masked_sample, verify; equal bit for bit to the torch ones on the
same uniforms) where the model's device takes Triton, else the CPU kernels and torch.
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from agentrt.decoding.penalties import penalize
from agentrt.decoding.sampling import position_uniforms, process_logits, sample_from_probs
from agentrt.engine.step.constraints import StepMasks, greedy_tokens
from agentrt.engine.outputs import TokenLogprob
from agentrt.engine.step.step_rows import StepRow
from agentrt.engine.step.step_tree import chain_parents, row_output_offsets
from agentrt.kernels.backend import KernelBackend
from agentrt.spec.tree_verify import verify_tree_greedy
from agentrt.spec.verify import VerifyResult, verify_drafts, verify_greedy


@dataclass(frozen=True)
class _SamplingOps:
    greedy: Callable  # (logits, masks) -> [rows] the argmax under each row's mask
    sample: Callable  # (probs, uniform) -> [rows] the inverse-CDF draw
    verify_greedy: Callable  # spec.verify.verify_greedy's arguments and result fields
    verify_drafts: Callable  # spec.verify.verify_drafts's


_CPU_OPS = _SamplingOps(greedy_tokens, sample_from_probs, verify_greedy, verify_drafts)


@functools.cache
def _triton_ops() -> _SamplingOps:
    """Imported on first use only: a process that never takes the Triton path never imports triton."""
    from agentrt.kernels.triton import masked_sample, verify

    def greedy(logits: torch.Tensor, masks: StepMasks | None) -> torch.Tensor:
        if masks is None:
            return masked_sample.masked_argmax(logits)
        mask_rows = torch.full((logits.shape[0],), -1, dtype=torch.long)
        mask_rows[masks.rows] = torch.tensor(masks.rows, dtype=torch.long)  # a masked row obeys its own mask row
        return masked_sample.masked_argmax(logits, masks.bitmask, mask_rows)

    return _SamplingOps(greedy, masked_sample.masked_sample, verify.verify_greedy, verify.verify_drafts)


@dataclass(frozen=True)
class Sampled:
    """What one sampling row emitted in a step."""

    emitted: list[int]  # the accepted drafts, then the target's own token
    accepted: int  # drafts the target accepted
    accepted_nodes: tuple[int, ...] = ()  # a token tree's accepted path (draft indices)
    raw_logprobs: torch.Tensor | None = None  # [k + 1, vocab] log-softmax, when the request asks for logprobs
    logprobs: list[TokenLogprob] | None = None  # per emitted token, when the request asks


def sample_rows(rows: list[StepRow], logits: torch.Tensor, masks: StepMasks | None,
                backend: KernelBackend = KernelBackend.CPU) -> dict[StepRow, Sampled]:
    """What every sampling row emits (with logprobs where asked). logits [logits rows, vocab] is
    modified (penalties, masks). backend: the model's kernel backend."""
    ops = _triton_ops() if backend is KernelBackend.TRITON else _CPU_OPS
    sampling = [r for r in rows if r.samples]
    if not sampling:
        return {}
    raw = _raw_logprobs(sampling, logits)  # the model's own distribution, before anything edits it
    _penalize(sampling, logits)
    drafts = _flat_drafts(sampling) if any(r.draft for r in sampling) else None
    trees = any(r.parents is not None for r in sampling)
    nodes: list[tuple[int, ...]] = [()] * len(sampling)
    if trees and all(r.seq.params.temperature == 0 for r in sampling):
        emitted, nodes = _verify_trees(sampling, ops.greedy(logits, masks))
    elif trees:
        emitted, nodes = _verify_trees(sampling, _own_draws(sampling, logits, masks, ops))
    elif all(r.seq.params.temperature == 0 for r in sampling):
        best = ops.greedy(logits, masks)  # [logits rows]
        emitted = _unpack(ops.verify_greedy(best, *drafts)) if drafts else [[t] for t in best.tolist()]
    else:
        emitted = _sample(sampling, logits, masks, drafts, ops)
    return {r: Sampled(toks, max(0, len(toks) - 1) if r.draft else 0, tuple(path), raw.get(r),
                       token_logprobs(raw[r], toks, r.seq.params.logprobs) if r in raw else None)
            for r, toks, path in zip(sampling, emitted, nodes)}


def _flat_drafts(sampling: list[StepRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's draft tokens flat [sum k] and their cu offsets [rows + 1]."""
    draft_tokens = torch.tensor([t for r in sampling for t in r.draft], dtype=torch.long)
    cu = torch.tensor([0] + list(itertools.accumulate(r.k for r in sampling)), dtype=torch.long)
    return draft_tokens, cu


def _sample(sampling: list[StepRow], logits: torch.Tensor, masks: StepMasks | None,
            drafts: tuple[torch.Tensor, torch.Tensor] | None, ops: _SamplingOps) -> list[list[int]]:
    probs = _processed(sampling, logits, masks)
    q = _draft_q(sampling, probs.shape[-1]) if drafts is not None else None
    if q is None:
        u = torch.cat([position_uniforms(r.seq.seed, len(r.seq.output_ids), r.num_rows) for r in sampling])
        own = ops.sample(probs, u)  # [logits rows]: each position's own draw
        return _unpack(ops.verify_greedy(own, *drafts)) if drafts is not None else [[t] for t in own.tolist()]
    gens = [r.seq.generator for r in sampling]
    u_acc = torch.cat([torch.rand(r.k, generator=g) for r, g in zip(sampling, gens)])  # [sum k]
    u_smp = torch.stack([torch.rand((), generator=g) for g in gens])  # [rows]
    draft_tokens, cu = drafts
    return _unpack(ops.verify_drafts(probs, draft_tokens, cu, q, u_acc, u_smp))


def _verify_trees(sampling: list[StepRow], own: torch.Tensor) -> tuple[list[list[int]], list[tuple[int, ...]]]:
    """The coupled rule on a step with token trees (spec.tree_verify.verify_tree_greedy; chains
    are trees too): own [logits rows] is each row's own token. Each row's emitted tokens and its
    accepted path (draft indices)."""
    draft_tokens = torch.tensor([t for r in sampling for t in r.draft], dtype=torch.long)
    parents = torch.tensor([p for r in sampling for p in (r.parents if r.parents is not None
                                                           else chain_parents(r.k))], dtype=torch.long)
    cu = torch.tensor([0] + list(itertools.accumulate(r.k for r in sampling)), dtype=torch.long)
    res = verify_tree_greedy(own, draft_tokens, parents, cu)
    return ([toks[:n] for toks, n in zip(res.output_tokens.tolist(), res.num_emitted.tolist())],
            [tuple(nodes) if r.parents is not None else () for r, nodes in zip(sampling, res.accepted_nodes)])


def _own_draws(sampling: list[StepRow], logits: torch.Tensor, masks: StepMasks | None,
               ops: _SamplingOps) -> torch.Tensor:
    """Each logits row's draw from its processed p at the uniform of the output position it
    samples (a tree node's: its depth + 1 past the row's first), as _sample draws a chain's."""
    probs = _processed(sampling, logits, masks)
    u = []
    for r in sampling:
        offsets = row_output_offsets(r)
        at = position_uniforms(r.seq.seed, len(r.seq.output_ids), max(offsets) + 1)
        u.append(at[torch.tensor(offsets)])
    return ops.sample(probs, torch.cat(u))


def _processed(sampling: list[StepRow], logits: torch.Tensor, masks: StepMasks | None) -> torch.Tensor:
    """[logits rows, vocab] processed p: masks, then each request's temperature, top-k, top-p."""
    if masks is not None:
        masks.apply(logits)
    per_row = torch.tensor([r.num_rows for r in sampling])
    rep = lambda vals: torch.tensor(vals).repeat_interleave(per_row)  # noqa: E731
    ps = [r.seq.params for r in sampling]
    return process_logits(logits, rep([p.temperature for p in ps]).float(), rep([p.top_k for p in ps]).long(),
                          rep([p.top_p for p in ps]).float())


def _unpack(res: VerifyResult) -> list[list[int]]:  # or the Triton kernels' VerifyOutput: the same fields
    return [toks[:n] for toks, n in zip(res.output_tokens.tolist(), res.num_emitted.tolist())]


def _draft_q(sampling: list[StepRow], vocab: int) -> torch.Tensor | None:
    """[sum k, V] q for verification, or None when every draft is deterministic (a point mass)."""
    drafted = [r for r in sampling if r.draft]
    if all(r.q is None for r in drafted):
        return None
    return torch.cat([(r.q if r.q is not None else torch.nn.functional.one_hot(torch.tensor(r.draft), vocab)).float()
                      for r in drafted])


def _penalize(sampling: list[StepRow], logits: torch.Tensor) -> None:
    if all(r.seq.penalties is None for r in sampling):
        return
    with torch.inference_mode():  # the logits are the forward's inference tensor
        for r in sampling:  # each row penalized with its own prefix's state
            if r.seq.penalties is not None:
                seq = r.seq
                penalize(logits[r.first_row : r.first_row + r.num_rows], seq.penalties, seq.prompt_ids,
                         seq.output_ids, r.draft)


def _raw_logprobs(sampling: list[StepRow], logits: torch.Tensor) -> dict[StepRow, torch.Tensor]:
    """Per row that asked for logprobs, log-softmax of its rows, [k + 1, vocab]."""
    return {r: torch.log_softmax(logits[r.first_row : r.first_row + r.num_rows].float(), dim=-1)
            for r in sampling if r.seq.params.logprobs is not None}


def token_logprobs(lp: torch.Tensor, toks: list[int], top_n: int) -> list[TokenLogprob]:
    """Each token's log-probability in its row of lp [rows, vocab], with the top_n alternatives."""
    top = lp[: len(toks)].topk(top_n, dim=-1) if top_n else None
    return [TokenLogprob(t, float(lp[j, t]), tuple(zip(top.indices[j].tolist(), top.values[j].tolist()))
                         if top is not None else ()) for j, t in enumerate(toks)]
