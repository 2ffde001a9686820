"""Exact verification of a token tree of deterministic drafts in one target pass (multi-round
rejection of SpecInfer: Miao et al., "SpecInfer: Accelerating Large Language Model Serving with
Tree-based Speculative Inference and Verification", 2024).

A sequence's draft is a tree: node j has a token and a parent (-1: the root, the sequence's last
known token; parents come before their children). The target gives one processed distribution
per node and one for the root: p at a node is conditioned on the context plus the path to it.
Drafts from the model-free drafters (template, suffix) are point masses, so at a node with
candidate children c_1..c_m (in the drafter's order):

* greedy (and the engine's coupled rule, `verify_tree_greedy`): the target's own token t at the
  node (its argmax, or its draw at the position's uniform); descend to the child whose token is
  t, else emit t and stop. The emitted tokens are exactly those decoding without drafts gives.
* sampling (`verify_tree`): c_1 is accepted when u_1 < p(c_1); else p <- p with c_1 zeroed (the
  residual of a point mass) and c_2 is accepted when u_2 * mass_2 < p(c_2), mass_2 = 1 - p(c_1)
  (the residual's normalisation, kept out of p so that p's bits stay the chain's), and so on; if
  no candidate is accepted, one token is drawn from the residual. Each step emits exactly p:
  the probability of emitting x is P(reach x's round) * p(x) / mass + P(no candidate) * residual(x)
  summed over the rounds, which telescopes to p(x) (SpecInfer, Theorem 4.2, point-mass case).
  Descending into an accepted child repeats the rule on its row; at a leaf a bonus token is drawn.

For m = 1 at every node (a chain) this is bit for bit spec.verify.verify_drafts with
draft_probs=None on the same uniforms: the same comparisons (u * 1.0 < p), the same residual
and the same inverse-CDF draw (tests/spec/test_tree_verify.py).

Ragged layout, as spec.verify: sequence i has n_i = cu[i+1] - cu[i] nodes stored flat in
draft_tokens[cu[i] : cu[i+1]] with `parents` holding each node's parent as an index local to its
sequence (-1 for the root), and n_i + 1 target rows from row cu[i] + i: the root's, then node
j's at cu[i] + i + 1 + j. One uniform per node (its acceptance test) and one per sequence (the
recovered or bonus token).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrt.decoding.sampling import sample_from_cdf
from agentrt.errors import SpecError


@dataclass(frozen=True)
class TreeVerifyResult:
    num_accepted: torch.Tensor  # [B] int64, nodes accepted (the accepted path's depth)
    output_tokens: torch.Tensor  # [B, max_depth + 1] int64: the path's tokens, then the recovered/bonus token, -1 pad
    num_emitted: torch.Tensor  # [B] int64, num_accepted + 1
    accepted_nodes: tuple[tuple[int, ...], ...]  # per sequence, the accepted path's nodes (local indices), root first


def node_depths(parents: list[int]) -> list[int]:
    """Each node's depth (a root child: 0) from parent indices local to one tree."""
    depth: list[int] = []
    for j, par in enumerate(parents):
        if not -1 <= par < j:
            raise SpecError(f"tree node {j} has parent {par}: a parent must be -1 (the root) or an earlier node")
        depth.append(0 if par < 0 else depth[par] + 1)
    return depth


def _children(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """children[0] = the root's, children[j + 1] = node j's, each in the drafter's order."""
    node_depths(parents)
    kids: list[list[int]] = [[] for _ in range(len(tokens) + 1)]
    for j, par in enumerate(parents):
        sibling_tokens = [tokens[c] for c in kids[par + 1]]
        if tokens[j] in sibling_tokens:
            raise SpecError(f"tree node {j} repeats its sibling's token {tokens[j]}: siblings must differ")
        kids[par + 1].append(j)
    return kids


def _check(target_rows: int, draft_tokens: torch.Tensor, parents: torch.Tensor, cu_num_draft: torch.Tensor) -> list[int]:
    if cu_num_draft.dim() != 1 or cu_num_draft.numel() < 1 or cu_num_draft.is_floating_point():
        raise SpecError(f"cu_num_draft must be an int tensor [B+1], got {tuple(cu_num_draft.shape)}")
    cu = cu_num_draft.tolist()
    n = draft_tokens.numel()
    if draft_tokens.dim() != 1 or parents.shape != draft_tokens.shape:
        raise SpecError(f"draft_tokens and parents must be [sum n_i], got {tuple(draft_tokens.shape)} and "
                        f"{tuple(parents.shape)}")
    if cu[0] != 0 or cu[-1] != n or any(b < a for a, b in zip(cu, cu[1:])):
        raise SpecError(f"cu_num_draft must rise from 0 to len(draft_tokens)={n}, got {cu}")
    if target_rows != n + len(cu) - 1:
        raise SpecError(f"target rows {target_rows}, expected sum(n_i + 1) = {n + len(cu) - 1}")
    return cu


def verify_tree_greedy(target_tokens: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor,
                       cu_num_draft: torch.Tensor) -> TreeVerifyResult:
    """Greedy / coupled verification: target_tokens [sum(n_i + 1)] is each row's own token (its
    argmax, or its draw at its position's uniform); walk from the root to the child whose token
    is the row's token, emit the row's token where no child has it. A chain gives exactly
    spec.verify.verify_greedy."""
    cu = _check(target_tokens.numel(), draft_tokens, parents, cu_num_draft)
    toks, pars, best = draft_tokens.tolist(), parents.tolist(), target_tokens.tolist()
    paths, outs = [], []
    for i in range(len(cu) - 1):
        a, b, row0 = cu[i], cu[i + 1], cu[i] + i
        tree_toks = toks[a:b]
        kids = _children(tree_toks, pars[a:b])
        node, path, out = -1, [], []
        while True:
            t = best[row0 + node + 1]
            out.append(t)
            nxt = next((c for c in kids[node + 1] if tree_toks[c] == t), None)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        paths.append(tuple(path))
        outs.append(out)
    return _result(paths, outs)


def _result(paths: list[tuple[int, ...]], outs: list[list[int]]) -> TreeVerifyResult:
    width = max((len(o) for o in outs), default=1)
    num = torch.tensor([len(p) for p in paths], dtype=torch.int64)
    out = torch.tensor([o + [-1] * (width - len(o)) for o in outs], dtype=torch.int64).view(len(outs), width)
    return TreeVerifyResult(num_accepted=num, output_tokens=out, num_emitted=num + 1, accepted_nodes=tuple(paths))


def verify_tree(target_probs: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor,
                cu_num_draft: torch.Tensor, uniform_accept: torch.Tensor, uniform_sample: torch.Tensor
                ) -> TreeVerifyResult:
    """Multi-round rejection over a ragged batch of point-mass trees (module docstring),
    vectorised over the batch: one pass per depth and candidate rank, not per node.

    target_probs [sum(n_i + 1), V] processed p; draft_tokens, parents [sum n_i]; cu_num_draft
    [B + 1]; uniform_accept [sum n_i] (node j's acceptance test) and uniform_sample [B], U[0, 1)
    draws made by the caller. Inputs are not modified."""
    cu = _check(target_probs.shape[0], draft_tokens, parents, cu_num_draft)
    if uniform_accept.shape != draft_tokens.shape or uniform_sample.shape != (len(cu) - 1,):
        raise SpecError(f"uniform_accept must be [{draft_tokens.numel()}] and uniform_sample [{len(cu) - 1}]")
    vocab = target_probs.shape[1]
    toks, pars = draft_tokens.tolist(), parents.tolist()
    if toks and not (0 <= min(toks) and max(toks) < vocab):
        raise SpecError(f"draft_tokens must lie in [0, {vocab})")
    B = len(cu) - 1
    probs = target_probs.float()
    u_acc = uniform_accept.float().tolist()
    # children[b][local] = (flat node index, token) in the drafter's order; local 0 = the root
    kids = [[[(cu[b] + c, toks[cu[b] + c]) for c in ks] for ks in _children(toks[cu[b]:cu[b + 1]], pars[cu[b]:cu[b + 1]])]
            for b in range(B)]
    width = max((len(ks) for tree in kids for ks in tree), default=0)
    cur = [0] * B  # each sequence's current node, local (0 = root)
    live = list(range(B))
    paths: list[list[int]] = [[] for _ in range(B)]
    outs: list[list[int]] = [[] for _ in range(B)]
    while live:
        rows = torch.tensor([cu[b] + b + cur[b] for b in live], dtype=torch.long)
        dist = probs.index_select(0, rows)  # [L, V], a copy: candidates are zeroed in it
        mass = torch.ones(len(live))  # the residual's mass, 1.0 exactly for the first candidate
        accepted: list[int | None] = [None] * len(live)
        for rank in range(width):
            cand = [(i, kids[b][cur[b]][rank]) for i, b in enumerate(live)
                    if accepted[i] is None and rank < len(kids[b][cur[b]])]
            if not cand:
                break
            idx = torch.tensor([i for i, _ in cand], dtype=torch.long)
            tok = torch.tensor([c[1] for _, c in cand], dtype=torch.long)
            p_c = dist[idx, tok]  # [C]
            u = torch.tensor([u_acc[c[0]] for _, c in cand], dtype=torch.float32)
            ok = (u * mass[idx] < p_c).tolist()
            for (i, c), keep in zip(cand, ok):
                if keep:
                    accepted[i] = c[0]
            rejected = idx[~torch.tensor(ok, dtype=torch.bool)]
            if rejected.numel():
                rej_tok = tok[~torch.tensor(ok, dtype=torch.bool)]
                mass[rejected] = (mass[rejected] - dist[rejected, rej_tok]).clamp_min(0.0)
                dist[rejected, rej_tok] = 0.0
        stop = [i for i, a in enumerate(accepted) if a is None]
        if stop:
            sel = torch.tensor(stop, dtype=torch.long)
            cdf = dist.index_select(0, sel).cumsum(dim=-1)
            no_mass = ~(cdf[:, -1] > 0)  # the residual of p == the candidates: draw from p itself
            if bool(no_mass.any()):
                cdf[no_mass] = probs.index_select(0, rows[sel][no_mass]).cumsum(dim=-1)
            drawn = sample_from_cdf(cdf, uniform_sample.float()[torch.tensor([live[i] for i in stop])]).tolist()
            for i, t in zip(stop, drawn):
                outs[live[i]].append(t)
        nxt = []
        for i, b in enumerate(live):
            if accepted[i] is not None:
                node = accepted[i] - cu[b]
                paths[b].append(node)
                outs[b].append(toks[accepted[i]])
                cur[b] = node + 1
                nxt.append(b)
        live = nxt
    return _result([tuple(p) for p in paths], outs)


def verify_tree_reference(target_probs: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor,
                          cu_num_draft: torch.Tensor, uniform_accept: torch.Tensor, uniform_sample: torch.Tensor
                          ) -> TreeVerifyResult:
    """Slow per-node reference for `verify_tree`, written as the rule reads (for tests): the
    same fp32 comparisons and inverse-CDF sampler, so the results are identical."""
    cu = _check(target_probs.shape[0], draft_tokens, parents, cu_num_draft)
    probs = target_probs.float()
    toks, pars = draft_tokens.tolist(), parents.tolist()
    paths, outs = [], []
    for b in range(len(cu) - 1):
        tree_toks = toks[cu[b]:cu[b + 1]]
        kids = _children(tree_toks, pars[cu[b]:cu[b + 1]])
        node, path, out = -1, [], []
        while True:
            p = probs[cu[b] + b + node + 1].clone()
            mass = torch.tensor(1.0)
            chosen = None
            for c in kids[node + 1]:
                x = tree_toks[c]
                if uniform_accept[cu[b] + c].float() * mass < p[x]:
                    chosen = c
                    break
                mass = (mass - p[x]).clamp_min(0.0)
                p[x] = 0.0
            if chosen is None:
                if not p.cumsum(-1)[-1] > 0:
                    p = probs[cu[b] + b + node + 1]
                out.append(int(sample_from_cdf(p.cumsum(-1).unsqueeze(0), uniform_sample[b : b + 1])[0]))
                break
            path.append(chosen)
            out.append(tree_toks[chosen])
            node = chosen
        paths.append(tuple(path))
        outs.append(out)
    return _result(paths, outs)
