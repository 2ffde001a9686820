"""The engine's side of speculative decoding: ask the drafter for drafts, size them with the k
controller, account α per request and drafter.

The spec package holds the pieces (drafters, verification, controller, cost model); this class
wires them to the engine's step rows. It holds no engine: each step's draft plan
(engine.step.draft_plan) hands it the rows with the drafts each may feed and takes back its
proposals; after the step it hears what was verified.
`build_drafter` makes a drafter for an engine from its name.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

from agentrt.engine.outputs import StepRecord
from agentrt.engine.step.sequence import Sequence
from agentrt.engine.step.step_rows import RowDraft, StepRow
from agentrt.errors import SpecConfigError
from agentrt.spec.acceptance import AcceptanceCalibration
from agentrt.spec.alpha import AlphaPrior, AlphaRegistry, OnlineAlpha
from agentrt.spec.arithmetic import expected_accepted
from agentrt.spec.controller import KController, SeqDraftState, StepPrefill
from agentrt.spec.cost_model import PredictionTracker, StepCostModel
from agentrt.spec.drafters.base import Draft, Drafter, DraftRequest
from agentrt.spec.report import NO_SPEC, SpecReport
from agentrt.spec.stats import RequestSpecStats, SpecStepEvent
from agentrt.spec.step_residual import StepResidual
from agentrt.spec.tree_order import accepted_path, by_reach

log = logging.getLogger(__name__)

# Starting points for α before a drafter has been observed (the registry then learns).
PRIORS = {"suffix": AlphaPrior(0.5), "template": AlphaPrior(0.5), "layerskip": AlphaPrior(0.4), "draft": AlphaPrior(0.6)}


@dataclass(frozen=True)
class SpecConfig:
    drafter: str = "none"  # none | suffix | template | layerskip:N | draft:PATH
    k: int | None = None  # fixed k; None = adaptive (cost model + online α)
    # deepest draft the controller may ask for: 15 drafts + the next token fill one 16-row block
    # of the AMX kernels exactly; a 17th row starts a second block (+3-4 ms a step here)
    kmax: int = 15
    # tokens of earlier outputs the suffix and template drafters keep to draft from (the newest
    # half of them at least): ~0.1-1.1 KB each (repeated text costs little, new text the most),
    # so up to ~70 MB at this default
    history_tokens: int = 1 << 16
    # widest token tree a model-free drafter may propose (candidates at one place: enum members,
    # strings from the prompt, the suffix drafter's continuations), verified in the same forward
    # (engine/step/step_tree.py); 1: chains only. Models on the bf16 C or Triton kernels draft chains.
    # Chains by default: on the tool-call bench trees gave 0.97x the tokens per pass of chains
    # (their nodes spend the depth budget; docs/benchmarks.md, toolcall).
    tree_width: int = 1
    # price steps by the cost model plus what this engine's steps measured beyond it
    # (spec.step_residual); False: by the cost model alone, so k choices do not depend on the
    # machine's speed (a synthetic cost model's tests, controlled comparisons)
    learn_step_costs: bool = True

    def __post_init__(self) -> None:
        kind, colon, _ = self.drafter.partition(":") if isinstance(self.drafter, str) else (None, "", "")
        if kind not in ("none", "suffix", "template", "layerskip", "draft") or (colon and kind not in ("layerskip", "draft")):
            raise SpecConfigError(f"unknown drafter {self.drafter!r}; choose none, suffix, template, layerskip:N or draft:PATH")
        if self.k is not None and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0):
            raise SpecConfigError(f"k (the draft length) must be an integer >= 0 (0: no speculation), got {self.k!r}")
        if isinstance(self.kmax, bool) or not isinstance(self.kmax, int) or self.kmax < 1:
            raise SpecConfigError(f"kmax (the deepest draft) must be an integer >= 1, got {self.kmax!r}")
        if isinstance(self.tree_width, bool) or not isinstance(self.tree_width, int) or self.tree_width < 1:
            raise SpecConfigError(f"tree_width (the widest draft tree; 1: chains) must be an integer >= 1, "
                                  f"got {self.tree_width!r}")
        if isinstance(self.history_tokens, bool) or not isinstance(self.history_tokens, int) or self.history_tokens < 2:
            raise SpecConfigError(f"history_tokens (the drafters' memory of earlier outputs) must be an integer >= 2, "
                                  f"got {self.history_tokens!r}")

    @property
    def enabled(self) -> bool:
        return self.drafter != "none" and self.k != 0

    @property
    def policy(self) -> str:
        return "off" if not self.enabled else ("adaptive" if self.k is None else "fixed")


@dataclass(frozen=True)
class DraftStep:
    """What drafting cost this step and what the controller predicted the step would cost."""

    predicted_s: float | None = None
    draft_s: float = 0.0


class SpecRunner:
    """Handed per step the rows that sample (each with the drafts it may feed); gives them drafts
    sized by the k controller, and after verification accounts α per request and drafter."""

    def __init__(self, config: SpecConfig, drafter: Drafter | None, cost_model: Callable[[], StepCostModel],
                 tree_attention: Callable[[], bool] = lambda: False):
        """cost_model() builds the step-cost model on first use (a fitted one or the analytic
        estimate: engine.calibration.load_or_estimate_cost_model); tree_attention(): whether the
        model's forward reads token trees now (else tree drafts are cut to their first branch)."""
        self.config = config
        self._tree_attention = tree_attention
        self.drafter = drafter if config.enabled else None
        self.kind = config.drafter.split(":", 1)[0]
        self.alpha = AlphaRegistry(priors=PRIORS)
        self._seq_alpha: dict[int, OnlineAlpha] = {}
        self._stats: dict[int, RequestSpecStats] = {}
        # score -> P(accept), learned from this engine's verifications (spec.acceptance)
        self.calibration = AcceptanceCalibration()
        self._scores: dict[int, list[float | None]] = {}  # this step's free-position scores, per sequence
        self._build_cost_model = cost_model
        self._cost_model: StepCostModel | None = None
        self.tracker = PredictionTracker(window=256)
        # what steps cost beyond the fit, learned from this engine's decode steps (spec.step_residual)
        self.step_residual = StepResidual()
        self._fitted: tuple[int, float] | None = None  # this step's rows and the fit's prediction for them
        self._draft_cost_per_token: float | None = None  # measured online (EMA), s per drafted token

    # ---- lifecycle ------------------------------------------------------------------------
    @property
    def cost_model(self) -> StepCostModel:
        if self._cost_model is None:
            self._cost_model = self._build_cost_model()
        return self._cost_model

    @cost_model.setter
    def cost_model(self, model: StepCostModel) -> None:
        self._cost_model = model

    @property
    def has_cost_model(self) -> bool:
        """Whether a cost model is in use already (built on first need, or set)."""
        return self._cost_model is not None

    @property
    def controller(self) -> KController:
        return KController(self.cost_model, kmax_cap=self.config.kmax, policy=self.config.policy,
                           fixed_k=self.config.k or 0,
                           residual=self.step_residual if self.config.learn_step_costs else None)

    def start(self, seq: Sequence) -> None:
        self._stats[seq.seq_id] = RequestSpecStats(seq.seq_id)
        if self.drafter is not None:
            self.drafter.start(seq.seq_id, seq.prompt_ids)
            if seq.grammar is not None:
                self.drafter.attach(seq.seq_id, seq.grammar)
            self._seq_alpha[seq.seq_id] = self.alpha.new_sequence(self.kind)

    def finish(self, seq: Sequence) -> SpecReport:
        if self.drafter is not None:
            if seq.finish_reason in ("stop", "length"):
                self.drafter.finish(seq.seq_id, seq.output_ids)
            self.drafter.release(seq.seq_id)
        self._seq_alpha.pop(seq.seq_id, None)
        self._scores.pop(seq.seq_id, None)
        stats = self._stats.pop(seq.seq_id, None)
        return stats.report() if stats else NO_SPEC

    # ---- per step -------------------------------------------------------------------------
    def propose(self, rows: list[StepRow], max_draft: dict[StepRow, int]) -> tuple[DraftStep, dict[StepRow, RowDraft]]:
        """Drafts for the step's sampling rows, each at most min(kmax, max_draft[row]) tokens
        (0: the row does not draft), with their q, forced marks and expected accepted count;
        rows given none are left out. Every row of the step enters the k controller's step time."""
        if self.drafter is None:
            return DraftStep(), {}
        t0 = time.monotonic()
        live = [r for r in rows if r.samples and min(self.config.kmax, max_draft.get(r, 0)) > 0]
        reqs = {r: self._request(r.seq, min(self.config.kmax, max_draft[r])) for r in live}
        if self.drafter.deterministic:
            # Model-free drafts are nearly free: draft as deep as allowed, then let the controller
            # decide how much of each to verify, using the drafter's per-token confidence.
            drafts = zip(live, self._drafts([reqs[r] for r in live])) if live else ()
            offered = {r: d for r, d in drafts if d is not None}
            scores = {r: self._scores_of(r.seq, d) for r, d in offered.items()}
            accept = {r: [1.0 if x is None else self.calibration(x) for x in scores[r]] for r in offered}
            for r, d in offered.items():  # a tree the step verifies: its nodes by how often they are reached
                if d.parents is not None and self._tree_ok(r.seq):
                    d, chain = by_reach(d, accept[r])
                    offered[r], accept[r] = d.truncated(reqs[r].max_k), chain[: reqs[r].max_k]
                    scores[r] = None  # the calibration learns from chains (a tree's rejections are not censored)
        else:
            offered = {}
            accept = {r: self._seq_alpha[r.seq.seq_id].accept_probs(reqs[r].max_k) for r in live}
        # Every scheduled row enters the step-time model (none live: it still predicts the step's
        # time); rows not drafting offer nothing.
        draft_cost = self._initial_draft_cost() if self._draft_cost_per_token is None else self._draft_cost_per_token
        alloc = self.controller.choose([
            SeqDraftState(r.seq.seq_id, accept.get(r, []), draft_cost, r.seq.num_tokens) for r in rows
        ], _prefill_of(rows))
        ks = dict(zip(rows, alloc.k))
        if not self.drafter.deterministic:
            want = [r for r in live if ks[r] > 0]
            offered = dict(zip(want, self._drafts([_with_k(reqs[r], ks[r]) for r in want]) if want else []))
        proposed: dict[StepRow, RowDraft] = {}
        for r in live:
            d = offered.get(r)
            if d is None or ks[r] == 0:
                continue
            d = d.truncated(ks[r])
            if d.parents is not None and not self._tree_ok(r.seq):
                d = d.first_branch()
            n = len(d.tokens)
            proposed[r] = RowDraft(tuple(d.tokens), None if d.parents is None else tuple(d.parents), d.probs,
                                   tuple(d.forced or [False] * n), expected_accepted(accept[r][:n]))
            if self.drafter.deterministic and scores[r] is not None:  # what verification will tell the calibration about
                self._scores[r.seq.seq_id] = scores[r][:n]
        step = DraftStep(alloc.predicted_step_s, time.monotonic() - t0)
        if sum(ks.values()) == sum(len(d.tokens) for d in proposed.values()):  # the step priced is the step run
            self._fitted = (sum(r.num_new for r in rows) + sum(ks.values()),
                            alloc.predicted_step_s - alloc.predicted_residual_s)
        drafted = sum(len(d.tokens) for d in proposed.values())
        if drafted and not self.drafter.deterministic:
            per_token = step.draft_s / drafted
            old = self._draft_cost_per_token
            self._draft_cost_per_token = per_token if old is None else 0.8 * old + 0.2 * per_token
        return step, proposed

    def _tree_ok(self, seq: Sequence) -> bool:
        """Trees are verified by the coupled rule on rows without penalties or logprobs (which
        read the rows as a chain), on a forward that reads trees."""
        return (self.config.tree_width > 1 and seq.penalties is None and seq.params.logprobs is None
                and self._tree_attention())

    def _drafts(self, reqs: list[DraftRequest]) -> list[Draft | None]:
        """The drafter's drafts; if it raises, each request alone, and None for those that raise:
        drafts only save passes, so a request the drafter fails on decodes on without any."""
        try:
            return list(self.drafter.propose(reqs))
        except Exception:  # noqa: BLE001
            if len(reqs) == 1:
                log.exception("drafter %s failed on request %d: it decodes without drafts this step",
                              self.config.drafter, reqs[0].seq_id)
                return [None]
            return [self._drafts([req])[0] for req in reqs]

    def _initial_draft_cost(self) -> float:
        """Before any draft was timed: one forward of the drafter's share of the target."""
        return self.drafter.relative_cost * self.cost_model.predict(1, 256) if self.drafter.relative_cost else 0.0

    def _request(self, seq: Sequence, max_k: int) -> DraftRequest:
        p = seq.params
        width = self.config.tree_width if self._tree_ok(seq) else 1
        return DraftRequest(seq.seq_id, seq.all_ids, max_k, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                            max_width=width, max_nodes=max_k * width)

    def _scores_of(self, seq: Sequence, draft: Draft) -> list[float | None]:
        # Grammar-forced tokens are certain (None: α = 1). Elsewhere the drafter's confidence says
        # which positions look safe and the sequence's online α how well that confidence has held
        # up lately; their geometric mean ranks positions, and the calibration says what it means.
        a = self._seq_alpha[seq.seq_id].estimate()
        forced = draft.forced or [False] * len(draft.tokens)
        return [None if f else math.sqrt(max(c, 0.0) * a) for c, f in zip(draft.confidence, forced)]

    def on_verified(self, row: StepRow, verified: int, budget_cut: bool, kept: list[int], step: int) -> None:
        """The row's sequence kept these tokens (emitted, maybe cut by a stop) at engine step
        `step`, of which verification accepted `verified` drafts; budget_cut: the budget's
        completion cut the emitted run back (engine.step.budget)."""
        seq = row.seq
        stats = self._stats.get(seq.seq_id)
        if stats is None:
            return
        k = row.k
        # a stop cuts the accepted run short; a cut by the budget does not unaccept
        accepted = verified if budget_cut else min(verified, len(kept))
        forced, tried = sum(row.forced[:accepted]), k  # α's trials: a chain's drafts
        if row.parents is not None and k:  # a tree's: the levels of its accepted path, and the one missed
            path, missed = accepted_path(row.parents, row.draft, kept, accepted)
            forced, tried = sum(row.forced[i] for i in path), max(accepted, len(path) + missed)
        if (scores := self._scores.pop(seq.seq_id, None)) is not None and k:
            # the verified draft's free positions (observe() censors them at the first rejection)
            self.calibration.observe([x for x in scores[:k] if x is not None],
                                     sum(x is not None for x in scores[:accepted]))
        if self.drafter is not None:
            self.drafter.on_verified(seq.seq_id, min(accepted, len(kept)), kept)
            alpha = self._seq_alpha[seq.seq_id]
            alpha.update(tried, accepted, forced) if k else alpha.tick()
        stats.record(SpecStepEvent(
            step=step, time=time.monotonic(), seq_id=seq.seq_id,
            drafter=self.kind if k else "none", k=k, accepted=accepted, emitted=len(kept), forced=forced,
        ))

    def observe(self, record: StepRecord) -> None:
        if record.predicted_s is not None:
            self.tracker.record(record.predicted_s, record.duration_s)
        fitted, self._fitted = self._fitted, None
        if fitted is not None and fitted[0] == record.num_tokens and record.num_prefill_tokens == 0:
            self.step_residual.observe(record.num_tokens, record.duration_s, fitted[1])


def _prefill_of(rows: list[StepRow]) -> StepPrefill:
    """The step's prompt rows beyond one per sequence, and their attention pairs beyond each
    sequence's context (a chunk of n rows after c computed tokens attends to ~n*c + n(n+1)/2)."""
    return StepPrefill(
        tokens=sum(r.num_new - 1 for r in rows),
        pairs=sum(max(0, r.num_new * r.seq.num_computed + r.num_new * (r.num_new + 1) // 2 - r.seq.num_tokens)
                  for r in rows),
    )


def _with_k(req: DraftRequest, k: int) -> DraftRequest:
    return DraftRequest(req.seq_id, req.token_ids, k, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                        max_width=req.max_width)


def build_drafter(spec: str, engine) -> Drafter:
    kind, _, arg = spec.partition(":")
    if kind in ("suffix", "template"):
        from agentrt.spec.drafters.progression import digit_tokens
        from agentrt.spec.drafters.suffix import SuffixDrafter
        from agentrt.spec.drafters.template import TemplateDrafter

        suffix = SuffixDrafter(digits=digit_tokens(engine.tokenizer.encode), history_tokens=engine.config.spec.history_tokens)
        return suffix if kind == "suffix" else TemplateDrafter(suffix, engine.tokenizer.encode, engine.tokenizer.decode)
    if kind == "layerskip":
        from agentrt.engine.step.draft_runner import LayerSkipRunner
        from agentrt.spec.drafters.model import ModelDrafter

        try:
            n = int(arg)
        except ValueError:
            raise SpecConfigError(f"drafter {spec!r}: layerskip needs a layer count, e.g. layerskip:8") from None
        if not 0 < n < engine.model.num_layers:
            raise SpecConfigError(f"drafter {spec!r}: N must be in 1..{engine.model.num_layers - 1}")
        return ModelDrafter(LayerSkipRunner(engine, n), name=spec, seed=engine.config.seed)
    if kind == "draft":
        from agentrt.engine.step.draft_runner import SeparateModelRunner
        from agentrt.engine.loading.model_loader import load_model
        from agentrt.spec.drafters.model import ModelDrafter

        if not arg:
            raise SpecConfigError(f"drafter {spec!r}: give the draft model's directory, e.g. draft:/path/to/model")
        draft = load_model(arg, engine.model.dtype, engine.config.device, progress=False)
        if draft.model.cfg.vocab_size != engine.model.cfg.vocab_size or draft.tokenizer.encode("Hello, world!") != engine.tokenizer.encode("Hello, world!"):
            raise SpecConfigError(f"drafter {spec!r}: the draft model's tokenizer differs from the target's")
        share = draft.model.cfg.num_params() / engine.model.cfg.num_params()
        return ModelDrafter(SeparateModelRunner(draft.model, engine.config.kv_cache_tokens, engine.config.block_size, share),
                            name="draft", seed=engine.config.seed)
    raise SpecConfigError(f"unknown drafter {spec!r}; choose none, suffix, template, layerskip:N or draft:PATH")
