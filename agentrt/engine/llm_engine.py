"""The synchronous engine core: requests in, one batched forward per step, tokens out.

engine -> scheduler -> block manager -> sequence, one way. The asyncio wrapper lives in
async_engine.py; speculative decoding plugs in through `SpecRunner` (drafts before the forward,
exact verification after it).
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from agentrt.engine.block_manager import BlockManager
from agentrt.engine.kv_cache import KVCache
from agentrt.engine.model_loader import LoadedModel, load_model
from agentrt.engine.outputs import GenerationResult, StepRecord, TokenEvent, TokenLogprob
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.scheduler import Scheduler, SchedulerConfig
from agentrt.engine.sequence import Sequence
from agentrt.engine.spec_runner import SpecConfig, SpecRunner
from agentrt.engine.step_inputs import StepPlan, build_forward_batch
from agentrt.engine.stop_checker import StopChecker
from agentrt.engine.tokenizer import IncrementalDetokenizer
from agentrt.errors import RequestError
from agentrt.spec.grammar import GrammarCache, GrammarState, shared_grammar_cache
from agentrt.spec.penalties import Penalties, penalize
from agentrt.spec.sampling import process_logits, sample_from_probs
from agentrt.spec.structured import OutputFormat, parse_output, parse_response_format, with_instructions
from agentrt.spec.verify import verify_drafts, verify_greedy


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"  # bf16 where the hardware has bf16 matmuls, else fp32 (model_loader.default_dtype)
    device: str = "cpu"
    block_size: int = 16
    kv_cache_tokens: int = 32768
    prefault_kv: bool = False  # map the whole KV cache at start (a server's first requests then skip page faults)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # default: the model's context, capped by the cache
    prefix_caching: bool = True  # reuse KV of earlier prompts and outputs (radix tree over blocks)
    share_prefill_min_tokens: int = 16  # in-batch prefix sharing (see scheduler.py); 0: off
    prefill_order: str = "arrival"  # waiting requests of equal priority: "arrival" (FCFS) or "shortest"
    group_prefills: bool = False  # split a burst of prompts over steps for least mean time to first token
    spec: SpecConfig = SpecConfig()
    seed: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig = EngineConfig(), loaded: LoadedModel | None = None):
        self.config = config
        self.loaded = loaded or load_model(config.model, config.dtype, config.device)
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        self.device = torch.device(config.device)
        num_blocks = max(1, config.kv_cache_tokens // config.block_size)
        self.blocks = BlockManager(num_blocks, config.block_size, prefix_caching=config.prefix_caching)
        self.kv = KVCache(self.model.cfg, num_blocks, config.block_size, self.model.dtype, self.device,
                          prefault=config.prefault_kv)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.share_prefill_min_tokens,
                            config.prefill_order, config.group_prefills),
            self.blocks, step_cost=self._prefill_step_cost)
        self.max_model_len = min(config.max_model_len or self.model.cfg.max_position_embeddings, num_blocks * config.block_size)
        self.eos_ids = tuple(self.tokenizer.eos_token_ids)
        self.spec = SpecRunner(config.spec, self)
        self._ids = itertools.count()
        self._seed_gen = torch.Generator().manual_seed(config.seed)
        self._seqs: dict[int, Sequence] = {}
        self._stops: dict[int, StopChecker] = {}
        self.step_log: deque[StepRecord] = deque(maxlen=100_000)
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        self._step_no = 0
        self._grammars: GrammarCache | None = None

    def _prefill_step_cost(self, num_tokens: int) -> float | None:
        """A step's predicted seconds for the scheduler's prefill grouping; None unless the cost
        model was fitted on this machine (the analytic estimate has no per-step fixed cost)."""
        model = self.spec.cost_model
        return model.predict(num_tokens, 0) if model.source == "fit" else None

    @property
    def grammars(self) -> GrammarCache:
        if self._grammars is None:  # on first use; shared by the engines of one loaded model
            self._grammars = shared_grammar_cache(self.tokenizer, self.model.cfg.vocab_size, list(self.eos_ids))
        return self._grammars

    # ---- requests -------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[dict], tools: list[dict] | None = None) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tools=tools)
            return self.tokenizer.encode(text)
        raise RequestError("prompt must be a non-empty string or a non-empty list of chat messages")

    def format_messages(self, messages: list[dict], fmt: OutputFormat) -> tuple[list[dict], list[dict] | None]:
        """The chat messages, and the tools for the chat template, that a request with this output
        format is encoded from: the format's instructions added (spec.structured.with_instructions)."""
        if not fmt.described:
            return messages, None
        return with_instructions(messages, fmt, self.tokenizer.has_tools_template)

    def prepare(
        self,
        prompt: str | list[dict] | list[int],
        params: SamplingParams = SamplingParams(),
        priority: float = 0.0,
        meta: dict | None = None,
    ) -> Sequence:
        """Validate and tokenize a request without touching engine state (any thread may call it)."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        fmt = parse_response_format(params.response_format)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif fmt.described and isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.encode_prompt(*self.format_messages(prompt, fmt))
        else:
            ids = self.encode_prompt(prompt)
        if not ids:
            raise RequestError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.model.cfg.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.model.cfg.vocab_size - 1})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"length {self.max_model_len}"
            )
        rid = next(self._ids)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))
        seq = Sequence(rid, ids, params, priority=priority, generator=torch.Generator().manual_seed(seed), meta=meta or {})
        seq.penalties = self._penalties(params, fmt)
        if fmt.constrained:
            seq.output_format = fmt
            seq.grammar = GrammarState(self.grammars.compile(fmt))
        return seq

    def _penalties(self, params: SamplingParams, fmt: OutputFormat) -> Penalties | None:
        if params.min_tokens and fmt.constrained:
            raise RequestError("min_tokens cannot be combined with a constrained response_format: the grammar "
                               "decides where the output ends")
        vocab = self.model.cfg.vocab_size
        out_of_vocab = [t for t, _ in params.logit_bias if t >= vocab]
        if out_of_vocab:
            raise RequestError(f"logit_bias: token id {out_of_vocab[0]} is outside the vocabulary (0..{vocab - 1})")
        pen = Penalties(params.frequency_penalty, params.presence_penalty, params.repetition_penalty,
                        params.logit_bias, params.min_tokens, tuple(dict.fromkeys(self.eos_ids + params.stop_token_ids)))
        return pen if pen.active else None

    def add(self, seq: Sequence) -> int:
        """Admit a prepared sequence (engine thread only)."""
        self._seqs[seq.seq_id] = seq
        self._stops[seq.seq_id] = StopChecker(seq, self.eos_ids, IncrementalDetokenizer(self.tokenizer, seq.prompt_ids))
        self.spec.start(seq)
        self.scheduler.add(seq)
        return seq.seq_id

    def add_request(self, prompt, params: SamplingParams = SamplingParams(), priority: float = 0.0, meta: dict | None = None) -> int:
        return self.add(self.prepare(prompt, params, priority, meta))

    def abort(self, rid: int) -> TokenEvent | None:
        seq = self._seqs.get(rid)
        if seq is None or seq.finished:
            return None
        return self._finish(seq, "abort")

    def pin_prefix(self, token_ids: list[int], ttl_s: float) -> int:
        """Hold the cached KV of this token prefix for ttl_s seconds (a program waiting on a tool
        will send it again); pinned blocks go last under memory pressure. Returns blocks pinned."""
        return self.blocks.prefix.pin(list(token_ids), ttl_s) if self.blocks.prefix else 0

    def kv_blocks(self) -> dict[str, int]:
        """KV cache blocks: total, free, held by the prefix cache (cached), of those pinned, and
        used by running sequences (engine thread only: the cache changes during steps)."""
        total, free = self.blocks.allocator.num_blocks, self.blocks.num_free
        prefix = self.blocks.prefix
        cached = prefix.num_blocks if prefix else 0
        pinned = prefix.num_pinned() if prefix else 0
        return {"total": total, "free": free, "used": total - free, "cached": cached, "pinned": pinned}

    def sequence(self, rid: int) -> Sequence:
        return self._seqs[rid]

    def set_priority(self, rid: int, priority: float) -> None:
        if rid in self._seqs:
            self._seqs[rid].priority = priority

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        t0 = time.monotonic()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        samples = [s.num_computed + n == s.num_tokens for s, n in zip(batch.seqs, batch.num_new)]
        proposal = self.spec.propose(batch.seqs, batch.num_new, samples)
        plan = StepPlan(batch.seqs, batch.num_new, proposal.tokens, samples)
        for seq, n, d in zip(plan.seqs, plan.num_new, plan.drafts):
            if d:  # propose() kept drafts within the free KV slots
                self.blocks.grow(seq.seq_id, seq.num_computed + n + len(d))
        self.kv.copy_blocks(self.blocks.pop_copies())  # copy-on-write of shared, partly filled blocks
        fwd, first_row = build_forward_batch(plan, self.blocks, self.device)
        logits = self.model.forward(fwd, self.kv).logits  # [rows, vocab]
        raw = self._raw_logprobs(plan, logits)  # before penalties and masks touch the logits
        emitted = self._sample(plan, logits, first_row, proposal)
        duration = time.monotonic() - t0
        events = self._advance(plan, emitted, self._token_logprobs(plan, raw, emitted))
        record = StepRecord(
            step=self._step_no,
            start=t0,
            duration_s=duration,
            batch_size=len(plan.seqs),
            num_tokens=plan.num_tokens,
            num_prefill_tokens=sum(n for n in plan.num_new if n > 1),
            kv_tokens=sum(s.num_computed + n + len(d) for s, n, d in zip(plan.seqs, plan.num_new, plan.drafts)),
            request_ids=[s.seq_id for s in plan.seqs],
            num_new=list(plan.num_new),
            k=[len(d) for d in plan.drafts],
            forced=[sum(f) for f in proposal.forced],
            accepted=[max(0, len(e) - 1) if d else 0 for e, d in zip(emitted, plan.drafts)],
            expected_accepted=proposal.expected_accepted,
            predicted_s=proposal.predicted_s,
            draft_s=proposal.draft_s,
            preempted=[s.seq_id for s in batch.preempted],
        )
        self._step_no += 1
        self.step_log.append(record)
        self.spec.observe(record)
        for fn in self.step_listeners:
            fn(record)
        return events

    def _sample(self, plan: StepPlan, logits: torch.Tensor, first_row: list[int], proposal) -> list[list[int]]:
        """Per scheduled sequence, the tokens this step emits ([] while prefilling)."""
        sampling = [i for i, s in enumerate(plan.samples) if s]
        if not sampling:
            return [[] for _ in plan.seqs]
        rows_per = [len(plan.drafts[i]) + 1 for i in sampling]
        ps = [plan.seqs[i].params for i in sampling]
        out: list[list[int]] = [[] for _ in plan.seqs]
        if any(plan.seqs[i].penalties is not None for i in sampling):
            with torch.inference_mode():  # the logits are the forward's inference tensor
                row = 0
                for i, n in zip(sampling, rows_per):  # each row penalized with its own prefix's state
                    seq = plan.seqs[i]
                    if seq.penalties is not None:
                        penalize(logits[row : row + n], seq.penalties, seq.prompt_ids, seq.output_ids, plan.drafts[i])
                    row += n
        if all(p.temperature == 0 for p in ps):
            # Exactly what masking, process_logits (one-hot rows of the first maximal index) and
            # sampling or verify_drafts return, without [rows, vocab] distributions or masking
            # rows whose top token the grammar allows: ~1 ms of a 10-16 ms batch-1 step, more
            # with drafts.
            best = self.spec.greedy_tokens(proposal, logits)  # [rows]
            if proposal.any:
                ks = [len(plan.drafts[i]) for i in sampling]
                draft_tokens = torch.tensor([t for i in sampling for t in plan.drafts[i]], dtype=torch.long)
                res = verify_greedy(best, draft_tokens, torch.tensor([0] + list(itertools.accumulate(ks))))
                toks = res.output_tokens.tolist()
                for j, i in enumerate(sampling):
                    out[i] = toks[j][: int(res.num_emitted[j])]
            else:
                for j, t in enumerate(best.tolist()):
                    out[sampling[j]] = [t]
            return out
        self.spec.mask_logits(proposal, logits)
        rep = lambda vals: torch.tensor(vals).repeat_interleave(torch.tensor(rows_per))  # noqa: E731
        probs = process_logits(
            logits,
            rep([p.temperature for p in ps]).float(),
            rep([p.top_k for p in ps]).long(),
            rep([p.top_p for p in ps]).float(),
        )  # [rows, vocab]
        if not proposal.any:
            u = torch.stack([torch.rand((), generator=plan.seqs[i].generator) for i in sampling])
            toks = sample_from_probs(probs, u).tolist()
            for j, i in enumerate(sampling):
                out[i] = [toks[j]]
            return out
        ks = [len(plan.drafts[i]) for i in sampling]
        draft_tokens = torch.tensor([t for i in sampling for t in plan.drafts[i]], dtype=torch.long)
        cu = torch.tensor([0] + list(itertools.accumulate(ks)), dtype=torch.long)
        u_acc = torch.cat([torch.rand(k, generator=plan.seqs[i].generator) for i, k in zip(sampling, ks)])
        u_smp = torch.stack([torch.rand((), generator=plan.seqs[i].generator) for i in sampling])
        q = self.spec.draft_probs(proposal, sampling, probs.shape[-1])
        res = verify_drafts(probs, draft_tokens, cu, q, u_acc, u_smp)
        toks = res.output_tokens.tolist()
        for j, i in enumerate(sampling):
            out[i] = toks[j][: int(res.num_emitted[j])]
        return out

    def _raw_logprobs(self, plan: StepPlan, logits: torch.Tensor) -> dict[int, torch.Tensor]:
        """Per sampling sequence that asked for logprobs (by plan index), log-softmax of its rows
        [k + 1, vocab]: the model's own distribution at each verified position."""
        out, row = {}, 0
        if all(seq.params.logprobs is None for seq in plan.seqs):
            return out
        for i, s in enumerate(plan.samples):
            if not s:
                continue
            n = len(plan.drafts[i]) + 1
            if plan.seqs[i].params.logprobs is not None:
                out[i] = torch.log_softmax(logits[row : row + n].float(), dim=-1)
            row += n
        return out

    @staticmethod
    def _token_logprobs(plan: StepPlan, raw: dict[int, torch.Tensor],
                        emitted: list[list[int]]) -> list[list[TokenLogprob] | None]:
        out: list[list[TokenLogprob] | None] = [None] * len(plan.seqs)
        for i, lp in raw.items():
            toks, top_n = emitted[i], plan.seqs[i].params.logprobs
            top = lp[: len(toks)].topk(top_n, dim=-1) if top_n else None
            out[i] = [TokenLogprob(t, float(lp[j, t]), tuple(zip(top.indices[j].tolist(), top.values[j].tolist()))
                                   if top is not None else ()) for j, t in enumerate(toks)]
        return out

    def _advance(self, plan: StepPlan, emitted: list[list[int]],
                 logprobs: list[list[TokenLogprob] | None]) -> list[TokenEvent]:
        events = []
        now = time.monotonic()
        for seq, n, draft, toks, lps in zip(plan.seqs, plan.num_new, plan.drafts, emitted, logprobs):
            if seq.finished:  # aborted while the step ran
                continue
            if not toks:  # a prefill chunk that did not reach the prompt's end
                seq.num_computed += n
                self.blocks.truncate(seq.seq_id, seq.num_computed)
                self.blocks.cache_prefix(seq.seq_id, seq.all_ids, seq.num_computed)
                continue
            # The real tokens and the accepted drafts are in the cache; the last emitted is not.
            seq.num_computed += n + len(toks) - 1
            self.blocks.truncate(seq.seq_id, seq.num_computed)
            if seq.first_token_time is None:
                seq.first_token_time = now
                self.blocks.cache_prefix(seq.seq_id, seq.all_ids, seq.num_computed)  # siblings reuse the prompt
            kept, text, reason = self._stops[seq.seq_id].apply(toks)
            self.spec.on_verified(seq, draft, len(toks) - 1, kept)
            kept_lps = None if lps is None else lps[: len(kept)]
            if kept_lps is not None:
                seq.logprobs += kept_lps
            if reason is not None:
                events.append(self._finish(seq, reason, kept, text, logprobs=kept_lps))
            else:
                events.append(TokenEvent(seq.seq_id, kept, text, logprobs=kept_lps))
        return events

    def _finish(self, seq: Sequence, reason: str, kept: list[int] = (), text: str = "", error: str | None = None,
                logprobs: list[TokenLogprob] | None = None) -> TokenEvent:
        self.scheduler.finish(seq)
        seq.finish_reason = reason
        stop = self._stops.pop(seq.seq_id)
        parsed, error = self._structured(seq, reason, stop.text, error)
        result = GenerationResult(
            request_id=seq.seq_id,
            prompt_tokens=len(seq.prompt_ids),
            token_ids=list(seq.output_ids),
            text=stop.text,
            finish_reason=reason,
            error=error,
            parsed=parsed,
            spec=self.spec.finish(seq),
            timings={"arrival": seq.arrival, "first_token": seq.first_token_time or 0.0, "finished": time.monotonic()},
            num_preemptions=seq.num_preemptions,
            prompt_token_ids=list(seq.prompt_ids),
            cached_tokens=seq.cached_tokens,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
        )
        del self._seqs[seq.seq_id]
        return TokenEvent(seq.seq_id, list(kept), text, finished=True, finish_reason=reason, error=error, result=result,
                          logprobs=logprobs)

    @staticmethod
    def _structured(seq: Sequence, reason: str, text: str, error: str | None) -> tuple[object, str | None]:
        fmt = seq.output_format
        if fmt is None or error is not None or reason in ("abort", "error"):
            return None, error
        if reason == "length" and not seq.grammar.terminated and not fmt.is_text_answer(text):
            return None, (f"structured output truncated: max_tokens={seq.params.max_tokens} was reached before the "
                          f"JSON was complete; raw text: {text!r}")
        try:
            return parse_output(fmt, text), None
        except ValueError as e:  # json and jsonschema errors are ValueErrors
            return None, f"structured output is invalid ({type(e).__name__}: {str(e).splitlines()[0]}); raw text: {text!r}"

    # ---- scripts ----------------------------------------------------------------------------
    def generate(self, prompts: list, params: SamplingParams = SamplingParams()) -> list[GenerationResult]:
        """Run prompts to completion (a synchronous helper for scripts and tests)."""
        rids = [self.add_request(p, params) for p in prompts]
        results: dict[int, GenerationResult] = {}
        while len(results) < len(rids):
            results.update({ev.request_id: ev.result for ev in self.step() if ev.finished})
        return [results[r] for r in rids]
