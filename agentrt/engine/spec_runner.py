"""The engine's side of speculative decoding: ask the drafter for drafts, size them with the k
controller, account α per request and drafter.

The spec package holds the pieces (drafters, verification, controller, cost model); this class
wires them to the engine's sequences, so the engine step reads schedule -> propose -> forward ->
verify -> advance.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from agentrt.engine.outputs import StepRecord
from agentrt.engine.sequence import Sequence
from agentrt.errors import SpecConfigError
from agentrt.kernels.argmax import argmax_rows
from agentrt.spec.acceptance import AcceptanceCalibration
from agentrt.spec.alpha import AlphaPrior, AlphaRegistry, OnlineAlpha
from agentrt.spec.controller import KController, SeqDraftState, StepPrefill
from agentrt.spec.cost_model import PredictionTracker, StepCostModel
from agentrt.spec.grammar import apply_masks, masked_argmax
from agentrt.spec.drafters.base import Draft, Drafter, DraftRequest
from agentrt.spec.stats import RequestSpecStats, SpecStepEvent

# Starting points for α before a drafter has been observed (the registry then learns).
PRIORS = {"suffix": AlphaPrior(0.5), "template": AlphaPrior(0.5), "layerskip": AlphaPrior(0.4), "draft": AlphaPrior(0.6)}


@dataclass(frozen=True)
class SpecConfig:
    drafter: str = "none"  # none | suffix | template | layerskip:N | draft:PATH
    k: int | None = None  # fixed k; None = adaptive (cost model + online α)
    # deepest draft the controller may ask for: 15 drafts + the next token fill one 16-row block
    # of the AMX kernels exactly; a 17th row starts a second block (+3-4 ms a step here)
    kmax: int = 15

    @property
    def enabled(self) -> bool:
        return self.drafter != "none" and self.k != 0

    @property
    def policy(self) -> str:
        return "off" if not self.enabled else ("adaptive" if self.k is None else "fixed")


@dataclass
class Proposal:
    tokens: list[list[int]]  # per scheduled sequence, the drafts it feeds (maybe empty)
    probs: list[torch.Tensor | None] = field(default_factory=list)  # per sequence [k, V] q, or None
    expected_accepted: list[float] = field(default_factory=list)
    forced: list[list[bool]] = field(default_factory=list)  # per sequence, grammar-forced drafts
    predicted_s: float | None = None
    draft_s: float = 0.0
    bitmask: torch.Tensor | None = None  # [logit rows, words] grammar masks, when any is constrained
    masked_rows: list[int] = field(default_factory=list)

    @property
    def any(self) -> bool:
        return any(self.tokens)

    def cut(self, i: int, k: int) -> None:
        """Keep only the first k drafts of sequence i."""
        self.tokens[i] = self.tokens[i][:k]
        self.forced[i] = self.forced[i][:k]
        if self.probs[i] is not None:
            self.probs[i] = self.probs[i][:k]


class SpecRunner:
    def __init__(self, config: SpecConfig, engine):
        self.config = config
        self.engine = engine
        self.drafter: Drafter | None = build_drafter(config.drafter, engine) if config.enabled else None
        self.kind = config.drafter.split(":", 1)[0]
        self.alpha = AlphaRegistry(priors=PRIORS)
        self._seq_alpha: dict[int, OnlineAlpha] = {}
        self._stats: dict[int, RequestSpecStats] = {}
        self._forced: dict[int, list[bool]] = {}  # this step's forced flags, per sequence
        # score -> P(accept), learned from this engine's verifications (spec.acceptance)
        self.calibration = AcceptanceCalibration()
        self._scores: dict[int, list[float | None]] = {}  # this step's free-position scores, per sequence
        self._cost_model: StepCostModel | None = None
        self.tracker = PredictionTracker(window=256)
        self._draft_cost_per_token: float | None = None  # measured online (EMA), s per drafted token

    # ---- lifecycle ------------------------------------------------------------------------
    @property
    def cost_model(self) -> StepCostModel:
        if self._cost_model is None:
            from agentrt.engine.calibration import load_or_estimate_cost_model

            self._cost_model = load_or_estimate_cost_model(self.engine)
        return self._cost_model

    @property
    def controller(self) -> KController:
        return KController(self.cost_model, kmax_cap=self.config.kmax, policy=self.config.policy,
                           fixed_k=self.config.k or 0)

    def start(self, seq: Sequence) -> None:
        self._stats[seq.seq_id] = RequestSpecStats(seq.seq_id)
        if self.drafter is not None:
            self.drafter.start(seq.seq_id, seq.prompt_ids)
            if seq.grammar is not None and hasattr(self.drafter, "attach"):
                self.drafter.attach(seq.seq_id, seq.grammar)
            self._seq_alpha[seq.seq_id] = self.alpha.new_sequence(self.kind)

    def finish(self, seq: Sequence) -> dict:
        if self.drafter is not None:
            if seq.finish_reason in ("stop", "length"):
                self.drafter.finish(seq.seq_id, seq.output_ids)
            self.drafter.release(seq.seq_id)
        self._seq_alpha.pop(seq.seq_id, None)
        self._scores.pop(seq.seq_id, None)
        stats = self._stats.pop(seq.seq_id, None)
        return stats.to_dict() if stats else {}

    # ---- per step -------------------------------------------------------------------------
    def _kmax(self, seq: Sequence, free_slots: int) -> int:
        # Drafts past max_tokens or the context can never be emitted; drafts beyond the free KV
        # slots would need blocks that others hold.
        left = min(seq.params.max_tokens - len(seq.output_ids), self.engine.max_model_len - seq.num_tokens)
        reserved = len(self.engine.blocks.tables.get(seq.seq_id, ())) * self.engine.blocks.block_size - seq.num_tokens
        return max(0, min(self.config.kmax, left - 1, reserved + free_slots))

    def propose(self, seqs: list[Sequence], num_new: list[int], samples: list[bool]) -> Proposal:
        n = len(seqs)
        proposal = Proposal(tokens=[[] for _ in seqs], probs=[None] * n, expected_accepted=[0.0] * n,
                            forced=[[] for _ in seqs])
        if self.drafter is not None:
            self._draft(seqs, num_new, samples, proposal)
            self._fit_kv(seqs, num_new, proposal)
        self._grammar_masks(seqs, samples, proposal)
        return proposal

    def _fit_kv(self, seqs: list[Sequence], num_new: list[int], proposal: Proposal) -> None:
        """Drafts only get KV slots that are free (in turn): cut them rather than preempt anyone."""
        blocks, free = self.engine.blocks, self.engine.blocks.num_free
        for i, seq in enumerate(seqs):
            k = len(proposal.tokens[i])
            base = seq.num_computed + num_new[i]
            while k and blocks.blocks_needed(seq.seq_id, base + k) > free:
                k -= 1
            if k < len(proposal.tokens[i]):
                proposal.cut(i, k)
            free -= blocks.blocks_needed(seq.seq_id, base + k)

    def _draft(self, seqs: list[Sequence], num_new: list[int], samples: list[bool], proposal: Proposal) -> None:
        n = len(seqs)
        t0 = time.monotonic()
        blocks = self.engine.blocks
        share = blocks.num_free * blocks.block_size // max(1, sum(samples))
        kmax = {i: self._kmax(seqs[i], share) for i in range(n) if samples[i]}
        live = [i for i in kmax if kmax[i] > 0]  # none: the controller still predicts the step's time
        reqs = {i: self._request(seqs[i], kmax[i]) for i in live}
        if self.drafter.deterministic:
            # Model-free drafts are nearly free: draft as deep as allowed, then let the controller
            # decide how much of each to verify, using the drafter's per-token confidence.
            offered = dict(zip(live, self.drafter.propose([reqs[i] for i in live]))) if live else {}
            scores = {i: self._scores_of(seqs[i], offered[i]) for i in live}
            accept = {i: [1.0 if x is None else self.calibration(x) for x in scores[i]] for i in live}
        else:
            offered = {}
            accept = {i: self._seq_alpha[seqs[i].seq_id].accept_probs(reqs[i].max_k) for i in live}
        # Every scheduled sequence enters the step-time model; those not drafting offer nothing.
        draft_cost = self._initial_draft_cost() if self._draft_cost_per_token is None else self._draft_cost_per_token
        alloc = self.controller.choose([
            SeqDraftState(s.seq_id, accept.get(i, []), draft_cost, s.num_tokens) for i, s in enumerate(seqs)
        ], _prefill_of(seqs, num_new))
        ks = dict(enumerate(alloc.k))
        if not self.drafter.deterministic:
            want = [i for i in live if ks[i] > 0]
            got = self.drafter.propose([_with_k(reqs[i], ks[i]) for i in want]) if want else []
            offered = dict(zip(want, got))
        for i in live:
            d = offered.get(i)
            if d is None or ks[i] == 0:
                continue
            d = d.truncated(ks[i])
            proposal.tokens[i] = d.tokens
            proposal.probs[i] = d.probs
            proposal.forced[i] = d.forced or [False] * len(d.tokens)
            proposal.expected_accepted[i] = _expected_accepted(accept[i][: len(d.tokens)])
            self._forced[seqs[i].seq_id] = proposal.forced[i]
            if self.drafter.deterministic:  # what verification will tell the calibration about
                self._scores[seqs[i].seq_id] = scores[i][: len(d.tokens)]
        proposal.predicted_s = alloc.predicted_step_s
        proposal.draft_s = time.monotonic() - t0
        drafted = sum(len(t) for t in proposal.tokens)
        if drafted and not self.drafter.deterministic:
            per_token = proposal.draft_s / drafted
            old = self._draft_cost_per_token
            self._draft_cost_per_token = per_token if old is None else 0.8 * old + 0.2 * per_token

    def _grammar_masks(self, seqs: list[Sequence], samples: list[bool], proposal: Proposal) -> None:
        """Masks for every verified row of constrained sequences; drafts are cut at the first
        token their grammar forbids (its masked p is 0: it could never be accepted)."""
        rows, parts = 0, []
        for i, seq in enumerate(seqs):
            if not samples[i]:
                continue
            if seq.grammar is not None:
                d = proposal.tokens[i]
                bm = self.engine.grammars.new_bitmask(len(d) + 1)
                m = seq.grammar.fill_masks(d, bm, 0)
                if m < len(d):
                    proposal.cut(i, m)
                parts.append((rows, bm[: m + 1]))
            rows += len(proposal.tokens[i]) + 1
        if parts:
            full = self.engine.grammars.new_bitmask(rows)  # all tokens allowed
            for start, bm in parts:
                full[start : start + bm.shape[0]] = bm
                proposal.masked_rows += range(start, start + bm.shape[0])
            proposal.bitmask = full

    def mask_logits(self, proposal: Proposal, logits: torch.Tensor) -> None:
        if proposal.bitmask is not None:
            apply_masks(logits, proposal.bitmask, proposal.masked_rows)

    def greedy_tokens(self, proposal: Proposal, logits: torch.Tensor) -> torch.Tensor:
        """argmax of every row under its grammar mask, [rows] int64 (logits left as they are)."""
        if proposal.bitmask is None:
            return argmax_rows(logits)
        return masked_argmax(logits, proposal.bitmask, proposal.masked_rows)

    def _initial_draft_cost(self) -> float:
        """Before any draft was timed: model-free drafters cost ~nothing; a model drafter costs one
        forward of its share of the target's parameters per token."""
        if self.drafter is None or self.drafter.deterministic:
            return 0.0
        runner = getattr(self.drafter, "runner", None)
        target = self.engine.model
        draft = getattr(runner, "model", target)
        share = getattr(runner, "num_layers", draft.num_layers) / target.num_layers if draft is target else \
            draft.cfg.num_params() / target.cfg.num_params()
        return share * self.cost_model.predict(1, 256)

    def _request(self, seq: Sequence, max_k: int) -> DraftRequest:
        p = seq.params
        return DraftRequest(seq.seq_id, seq.all_ids, max_k, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)

    def _scores_of(self, seq: Sequence, draft: Draft) -> list[float | None]:
        # Grammar-forced tokens are certain (None: α = 1). Elsewhere the drafter's confidence says
        # which positions look safe and the sequence's online α how well that confidence has held
        # up lately; their geometric mean ranks positions, and the calibration says what it means.
        a = self._seq_alpha[seq.seq_id].estimate()
        forced = draft.forced or [False] * len(draft.tokens)
        return [None if f else math.sqrt(max(c, 0.0) * a) for c, f in zip(draft.confidence, forced)]

    def draft_probs(self, proposal: Proposal, sampling: list[int], vocab: int) -> torch.Tensor | None:
        """[sum k, V] q for verification, or None when every draft is deterministic."""
        rows = [(proposal.tokens[i], proposal.probs[i]) for i in sampling if proposal.tokens[i]]
        if all(q is None for _, q in rows):
            return None
        parts = []
        for toks, q in rows:
            if q is None:
                q = torch.nn.functional.one_hot(torch.tensor(toks), vocab).float()
            parts.append(q.float())
        return torch.cat(parts)

    def on_verified(self, seq: Sequence, draft: list[int], accepted: int, kept: list[int]) -> None:
        stats = self._stats.get(seq.seq_id)
        if stats is None:
            return
        k = len(draft)
        accepted = min(accepted, len(kept))
        forced = sum(forced_flags[:accepted]) if (forced_flags := self._forced.pop(seq.seq_id, None)) else 0
        if (scores := self._scores.pop(seq.seq_id, None)) is not None and k:
            # the verified draft's free positions (observe() censors them at the first rejection)
            self.calibration.observe([x for x in scores[:k] if x is not None],
                                     sum(x is not None for x in scores[:accepted]))
        if seq.grammar is not None:
            seq.grammar.commit(kept)
        if self.drafter is not None:
            self.drafter.on_verified(seq.seq_id, accepted, kept)
            alpha = self._seq_alpha[seq.seq_id]
            alpha.update(k, accepted, forced) if k else alpha.tick()
        stats.record(SpecStepEvent(
            step=self.engine._step_no, time=time.monotonic(), seq_id=seq.seq_id,
            drafter=self.kind if k else "none", k=k, accepted=accepted, emitted=len(kept), forced=forced,
        ))

    def observe(self, record: StepRecord) -> None:
        if record.predicted_s is not None:
            self.tracker.record(record.predicted_s, record.duration_s)


def _prefill_of(seqs: list[Sequence], num_new: list[int]) -> StepPrefill:
    """The step's prompt rows beyond one per sequence, and their attention pairs beyond each
    sequence's context (a chunk of n rows after c computed tokens attends to ~n*c + n(n+1)/2)."""
    return StepPrefill(
        tokens=sum(n - 1 for n in num_new),
        pairs=sum(max(0, n * s.num_computed + n * (n + 1) // 2 - s.num_tokens) for s, n in zip(seqs, num_new)),
    )


def _with_k(req: DraftRequest, k: int) -> DraftRequest:
    return DraftRequest(req.seq_id, req.token_ids, k, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p)


def _expected_accepted(accept_probs: list[float]) -> float:
    total, run = 0.0, 1.0
    for a in accept_probs:
        run *= a
        total += run
    return total


def build_drafter(spec: str, engine) -> Drafter:
    kind, _, arg = spec.partition(":")
    if kind in ("suffix", "template"):
        from agentrt.spec.drafters.progression import digit_tokens
        from agentrt.spec.drafters.suffix import SuffixDrafter
        from agentrt.spec.drafters.template import TemplateDrafter

        suffix = SuffixDrafter(digits=digit_tokens(engine.tokenizer.encode))
        return suffix if kind == "suffix" else TemplateDrafter(suffix, engine.tokenizer.encode, engine.tokenizer.decode)
    if kind == "layerskip":
        from agentrt.engine.draft_runner import LayerSkipRunner
        from agentrt.spec.drafters.model import ModelDrafter

        try:
            n = int(arg)
        except ValueError:
            raise SpecConfigError(f"drafter {spec!r}: layerskip needs a layer count, e.g. layerskip:8") from None
        if not 0 < n < engine.model.num_layers:
            raise SpecConfigError(f"drafter {spec!r}: N must be in 1..{engine.model.num_layers - 1}")
        return ModelDrafter(LayerSkipRunner(engine, n), name=spec, seed=engine.config.seed)
    if kind == "draft":
        from agentrt.engine.draft_runner import SeparateModelRunner
        from agentrt.engine.model_loader import load_model
        from agentrt.spec.drafters.model import ModelDrafter

        if not arg:
            raise SpecConfigError(f"drafter {spec!r}: give the draft model's directory, e.g. draft:/path/to/model")
        draft = load_model(arg, engine.model.dtype, engine.config.device, progress=False)
        if draft.model.cfg.vocab_size != engine.model.cfg.vocab_size or draft.tokenizer.encode("Hello, world!") != engine.tokenizer.encode("Hello, world!"):
            raise SpecConfigError(f"drafter {spec!r}: the draft model's tokenizer differs from the target's")
        return ModelDrafter(SeparateModelRunner(draft.model, engine.config.kv_cache_tokens, engine.config.block_size),
                            name="draft", seed=engine.config.seed)
    raise SpecConfigError(f"unknown drafter {spec!r}; choose none, suffix, template, layerskip:N or draft:PATH")
