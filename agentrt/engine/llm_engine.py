"""The synchronous engine core: requests in, one batched forward per step, tokens out.

engine -> scheduler -> block manager -> sequence, one way. A step is a list of StepRows, one per
scheduled sequence (step/step_rows.py); the step's draft plan (step/draft_plan.py) gives them
their drafts and the grammar masks, the sampler returns what they emit (step/step_sampler.py),
and `_advance` commits it (Sequence.commit). The asyncio wrapper lives in async_engine.py.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from agentrt.decoding.penalties import Penalties
from agentrt.engine.step import budget
from agentrt.engine.kv.block_manager import BlockManager
from agentrt.engine.calibration import load_or_estimate_cost_model
from agentrt.engine.step.constraints import Constraints
from agentrt.engine.step.draft_plan import DraftPlanner
from agentrt.engine.kv.kv_cache import KVCache
from agentrt.engine.chat.messages import normalize_messages
from agentrt.engine.loading.model_loader import LoadedModel, load_model
from agentrt.engine.models.step_graphs import StepGraphs
from agentrt.engine.outputs import GenerationResult, StepRecord, TokenEvent, TokenLogprob
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.step.scheduler import Scheduler, SchedulerConfig
from agentrt.engine.step.sequence import Sequence, StopChecker
from agentrt.engine.step.spec_runner import DraftStep, SpecConfig, SpecRunner, build_drafter
from agentrt.engine.step.step_rows import StepRow, build_forward_batch, rows_of
from agentrt.engine.step.step_sampler import Sampled, sample_rows, token_logprobs
from agentrt.engine.step.step_tree import compact_accepted
from agentrt.engine.chat.tokenizer import IncrementalDetokenizer
from agentrt.errors import RequestError
from agentrt.structured.grammar import GRAMMAR_CACHE_BYTES, GrammarCache
from agentrt.structured.output_format import (OutputFormat, parse_output, parse_response_format, with_instructions,
                                             with_syntax)
from agentrt.structured.tool_formats import ToolCallFormat, detect_tool_format, tool_format

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"  # a GGUF's quantized blocks, else bf16 or fp32 by the hardware (model_loader.load_model)
    device: str = "cpu"
    block_size: int = 16
    kv_cache_tokens: int = 32768
    prefault_kv: bool = False  # map the whole KV cache at start (a server's first requests then skip page faults)
    # compiled grammars of constrained outputs kept (least recently used dropped past it); one
    # cache per loaded model, shared by its engines: the last engine made sets the bound
    grammar_cache_bytes: int = GRAMMAR_CACHE_BYTES
    step_log_steps: int = 100_000  # engine steps kept in step_log (~1.3 KB each at batch 8), for benchmarks
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # default: the model's context, capped by the cache
    prefix_caching: bool = True  # reuse KV of earlier prompts and outputs (radix tree over blocks)
    share_prefill_min_tokens: int = 16  # in-batch prefix sharing (see step/scheduler.py); 0: off
    prefill_order: str = "arrival"  # waiting requests of equal priority: "arrival" (FCFS) or "shortest"
    group_prefills: bool = False  # split a burst of prompts over steps for least mean time to first token
    spec: SpecConfig = SpecConfig()
    seed: int = 0
    # the PyTorch path (fp32, or bf16 without AMX) computed so that a token's result does not depend
    # on the rest of the batch: greedy output the same with and without speculation, alone or
    # batched (models/invariant.py; several times slower). The C kernels are invariant anyway.
    batch_invariant: bool = False
    # the syntax tool calls are rendered, constrained and parsed in (structured.tool_formats): "auto"
    # reads it from the chat template and architecture; a format's name forces it
    tool_format: str = "auto"
    # decode and verify steps replayed from captured graphs (models/step_graphs.py): None: where the
    # model runs the Triton kernels on a CUDA device; True: also under Triton's interpreter on CPU
    # tensors (a replay reruns the forward on the same buffers: what the tests prove); False: never
    cuda_graphs: bool | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig = EngineConfig(), loaded: LoadedModel | None = None):
        self.config = config
        self.loaded = loaded or load_model(config.model, config.dtype, config.device)
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        self.device = torch.device(config.device)
        num_blocks = max(1, config.kv_cache_tokens // config.block_size)
        self.blocks = BlockManager(num_blocks, config.block_size, prefix_caching=config.prefix_caching)
        self.kv = KVCache(self.model.cfg, num_blocks, config.block_size, self.model.kv_dtype, self.device,
                          prefault=config.prefault_kv)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.share_prefill_min_tokens,
                            config.prefill_order, config.group_prefills),
            self.blocks, step_cost=self._prefill_step_cost)
        self.max_model_len = min(config.max_model_len or self.model.cfg.max_position_embeddings, num_blocks * config.block_size)
        self.step_graphs = self._step_graphs()
        self.eos_ids = tuple(self.tokenizer.eos_token_ids)
        self.tool_format: ToolCallFormat = (
            detect_tool_format(self.tokenizer.chat_template, getattr(self.model.cfg, "architecture", None))
            if config.tool_format == "auto" else tool_format(config.tool_format))
        self.constraints = Constraints(self.tokenizer, self.model.cfg.vocab_size, self.eos_ids,
                                       grammar_cache_bytes=config.grammar_cache_bytes)
        self.spec = SpecRunner(config.spec, build_drafter(config.spec.drafter, self) if config.spec.enabled else None,
                               cost_model=lambda: load_or_estimate_cost_model(self),
                               tree_attention=lambda: self.model.tree_attention(self.kv))
        self.planner = DraftPlanner(self.blocks, self.max_model_len, self.spec, self.constraints,
                                    self.tokenizer.encode, self.tokenizer.decode)
        self._ids = itertools.count()
        self._seed_gen = torch.Generator().manual_seed(config.seed)
        self._seqs: dict[int, Sequence] = {}
        self._stops: dict[int, StopChecker] = {}
        self.step_log: deque[StepRecord] = deque(maxlen=config.step_log_steps)
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        self.step_no = 0  # steps taken so far (the next step's number)

    def _step_graphs(self) -> StepGraphs | None:
        want = self.config.cuda_graphs
        if want is None:
            want = self.device.type == "cuda" and self.model.triton_enabled and not self.config.batch_invariant
        if not want:
            return None
        if self.config.batch_invariant:
            raise ValueError("cuda_graphs=True with batch_invariant=True: the batch-invariant forward runs on the "
                             "PyTorch path, and replayed steps run the Triton path")
        return StepGraphs(self.model, self.kv, self.max_model_len, self.config.max_num_seqs)

    def reserve_step_buffers(self) -> None:
        """The model's kernel buffers at their size for the largest step, on the calling thread (the
        engine's): with the KV cache mapped at start, a server holds from its first request the
        memory it keeps under load, instead of growing once more at each new largest step."""
        self.model.reserve_step_buffers(self.config.max_num_batched_tokens)

    def _prefill_step_cost(self, num_tokens: int) -> float | None:
        """A step's predicted seconds for the scheduler's prefill grouping; None unless the cost
        model was fitted on this machine (the analytic estimate has no per-step fixed cost)."""
        model = self.spec.cost_model
        return model.predict(num_tokens, 0) if model.source == "fit" else None

    @property
    def grammars(self) -> GrammarCache:
        return self.constraints.grammars

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def prefix_caching(self) -> bool:
        return self.blocks.prefix is not None

    # ---- requests -------------------------------------------------------------------------
    def prompt_text(self, prompt: str | list[dict], tools: list[dict] | None = None) -> str:
        """The text a prompt (a string, or chat messages through the chat template) is tokenized from."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            return prompt
        if isinstance(prompt, list) and prompt and not any(isinstance(m, (int, str)) for m in prompt):
            return self._render_chat(normalize_messages(prompt), tools)
        raise RequestError("prompt must be a non-empty string or a non-empty list of chat messages")

    def _render_chat(self, messages: list[dict], tools: list[dict] | None) -> str:
        """Messages already normalized (engine.chat.messages) through the chat template. Earlier tool
        calls and results are put as the family's template renders them (ToolCallFormat.history;
        a request without tools too: Gemma 3's template refuses a tool turn)."""
        if self.tool_format.name != "house":
            messages = self.tool_format.history(messages, "tool_calls" in (self.tokenizer.chat_template or ""))
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)

    def format_messages(self, messages: list[dict], fmt: OutputFormat) -> tuple[list[dict], list[dict] | None]:
        """The chat messages, and the tools for the chat template, that a request with this output
        format is encoded from: the format's instructions added (structured.output_format.with_instructions)."""
        if not fmt.described:
            return messages, None
        return with_instructions(messages, with_syntax(fmt, self.tool_format), self.tokenizer.has_tools_template,
                                 "tool_calls" in (self.tokenizer.chat_template or ""))

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
        fmt = with_syntax(parse_response_format(params.response_format), self.tool_format)
        text = None
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            if fmt.described and isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
                text = self._render_chat(*self.format_messages(normalize_messages(prompt), fmt))
            else:
                text = self.prompt_text(prompt)
            # a plain text prompt gets the tokens the tokenizer adds to a text (Gemma's <bos>; none for
            # SmolLM2), as llama.cpp and vLLM's completions do; a chat template writes its own
            ids = self.tokenizer.encode(text, add_special_tokens=isinstance(prompt, str))
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
        seq = Sequence(rid, ids, params, priority=priority, generator=torch.Generator().manual_seed(seed), seed=seed,
                       meta=meta or {}, prompt_text=text)
        seq.penalties = self._penalties(params, fmt)
        if fmt.constrained:
            seq.output_format = fmt
            seq.grammar = self.constraints.state(fmt)
            seq.closing = budget.Closing(longest=self.constraints.minimum_tokens(fmt))
        return seq

    def prepare_ahead(self, messages: list[dict], params: SamplingParams, cut_at: str, ttl_s: float,
                      meta: dict | None = None) -> Sequence | None:
        """A prefill-ahead request for the part of a call's prompt that is already known: the chat
        messages as the call will send them, with `cut_at` (a marker string) where the first
        unknown value starts. The prompt text is rendered exactly as prepare() renders the call,
        cut before the marker and tokenized; its full blocks (all but the last token's block) are
        what the request computes, caches and pins for ttl_s seconds. A later call whose tokens
        start the same way adopts them from the prefix cache, so its output is unchanged (the
        tokens at the cut may tokenize differently in the full prompt: only the blocks before the
        first difference are reused). None: prefix caching is off, or the known part fills no
        block beyond what the cache holds."""
        if self.blocks.prefix is None:
            return None
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
            raise RequestError("a prefill-ahead prompt must be a non-empty list of chat messages")
        fmt = parse_response_format(params.response_format)
        text = self._render_chat(*self.format_messages(normalize_messages(messages), fmt))
        cut = text.find(cut_at)
        if cut < 0:
            raise RequestError("the prefill-ahead marker is not in the rendered prompt")
        ids = self.tokenizer.encode(text[:cut])
        keep = (len(ids) - 1) // self.block_size * self.block_size  # the last token's block may change
        if keep == 0 or keep >= self.max_model_len or self.blocks.prefix.cached_tokens(ids[:keep], keep) >= keep:
            return None
        seq = Sequence(next(self._ids), ids[:keep], SamplingParams(max_tokens=1), priority=float("inf"),
                       meta=meta or {}, prompt_text=text[:cut], ahead_ttl_s=float(ttl_s))
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
        """schedule -> draft plan (drafts and masks) -> forward -> sample/verify -> advance, over
        one row per scheduled sequence (docs/architecture.md, "Data flow of one engine step")."""
        t0 = time.monotonic()
        batch = self.scheduler.schedule()
        ended = [self._finish(seq, reason) for seq, reason in batch.ahead_done]
        if not batch.seqs:
            return ended
        plan = self.planner.plan(rows_of(batch.seqs, batch.num_new))
        rows = plan.rows
        self.kv.copy_blocks(self.blocks.pop_copies())  # copy-on-write of shared, partly filled blocks
        forward_batch = build_forward_batch(rows, self.blocks, self.device)
        logits = (self.step_graphs.forward(forward_batch) if self.step_graphs is not None else  # [rows, vocab]
                  self.model.forward(forward_batch, self.kv, batch_invariant=self.config.batch_invariant)).logits
        sampled = sample_rows(rows, logits, plan.masks, self.model.kernel_backend)
        events = [ev for r in rows if (ev := self._advance_or_fail(r, sampled.get(r))) is not None]
        duration = time.monotonic() - t0  # the whole step: what the k controller's prices are checked against
        self._record(rows, sampled, batch.preempted, plan.drafting, t0, duration)
        return ended + events

    def _advance_or_fail(self, row: StepRow, out: Sampled | None) -> TokenEvent | None:
        """_advance, with an error of this request's own (its grammar, its stop checks, its output
        validation) ending this request only: the batch goes on."""
        if row.seq.finished:
            return None
        failed = row.failed
        try:
            if failed is None:
                return self._advance(row, out)
        except Exception as e:  # noqa: BLE001
            log.exception("request %d failed in step %d", row.seq.seq_id, self.step_no)
            if row.seq.finished:  # it failed while finishing: it has ended, with its event lost
                return None
            failed = f"{type(e).__name__}: {e}"
        return self.fail(row.seq, f"request failed in the engine step: {failed}")

    def _advance(self, row: StepRow, out: Sampled | None) -> TokenEvent | None:
        """Keep what the row's sequence emitted (out: the sampler's result, None while it
        prefills): the KV of fed tokens and accepted drafts stays (the last emitted token's is
        written next step), stop checks, the commit (Sequence.commit), the event."""
        seq = row.seq
        if seq.finished:  # aborted while the step ran
            return None
        if out is None:  # a prefill chunk that did not reach the prompt's end (or prefill-ahead)
            seq.num_computed += row.num_new
            self.blocks.truncate(seq.seq_id, seq.num_computed)
            self.blocks.cache_prefix(seq.seq_id, seq.all_ids, seq.num_computed)
            if seq.prefill_only and seq.num_computed >= seq.num_tokens:
                return self._finish(seq, "prefilled")
            return None
        emitted, logprobs, closing, budget_cut = out.emitted, out.logprobs, None, False
        if seq.grammar is not None:  # cut back to what can still be completed within max_tokens
            emitted, closing = budget.fit_emitted(seq, out.emitted, self.tokenizer.encode, self.tokenizer.decode,
                                                  self.eos_ids[0])
            budget_cut = emitted != out.emitted
            if budget_cut and out.raw_logprobs is not None:
                logprobs = token_logprobs(out.raw_logprobs, emitted, seq.params.logprobs)
        if out.accepted_nodes:  # a token tree: its accepted path's K/V to the chain's slots
            compact_accepted(row, out.accepted_nodes, self.blocks, self.kv)
        seq.num_computed += row.num_new + len(emitted) - 1
        self.blocks.truncate(seq.seq_id, seq.num_computed)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
            self.blocks.cache_prefix(seq.seq_id, seq.all_ids, seq.num_computed)  # siblings reuse the prompt
        stops = self._stops[seq.seq_id]
        kept, text, reason = stops.apply(emitted)
        logprobs = None if logprobs is None else logprobs[: len(kept)]
        seq.commit(kept, logprobs)
        if closing is not None:
            budget.start_forcing(seq, closing)
        if reason is None and budget.closed(seq):
            text, reason = text + stops.flush(), "length"  # completed within max_tokens (engine.step.budget)
        self.spec.on_verified(row, out.accepted, budget_cut, kept, self.step_no)
        if reason is not None:
            return self._finish(seq, reason, kept, text, logprobs=logprobs)
        return TokenEvent(seq.seq_id, kept, text, logprobs=logprobs)

    def _record(self, rows: list[StepRow], sampled: dict[StepRow, Sampled], preempted: list[Sequence],
                drafting: DraftStep, t0: float, duration: float) -> None:
        record = StepRecord(
            step=self.step_no,
            start=t0,
            duration_s=duration,
            batch_size=len(rows),
            num_tokens=sum(r.num_new + r.k for r in rows),
            num_prefill_tokens=sum(r.num_new for r in rows if r.num_new > 1),
            kv_tokens=sum(r.end for r in rows),
            request_ids=[r.seq.seq_id for r in rows],
            num_new=[r.num_new for r in rows],
            k=[r.k for r in rows],
            forced=[sum(r.forced) for r in rows],
            accepted=[sampled[r].accepted if r in sampled else 0 for r in rows],
            expected_accepted=[r.expected_accepted for r in rows],
            predicted_s=drafting.predicted_s,
            draft_s=drafting.draft_s,
            preempted=[s.seq_id for s in preempted],
        )
        self.step_no += 1
        self.step_log.append(record)
        self.spec.observe(record)
        for fn in self.step_listeners:
            fn(record)

    def fail(self, seq: Sequence, message: str) -> TokenEvent:
        """End a request with finish_reason "error" (the async engine's answer to a failed step)."""
        return self._finish(seq, "error", error=message)

    def unfinished(self) -> list[Sequence]:
        """Every admitted request that has not finished, running ones first."""
        return list(self.scheduler.running) + list(self.scheduler.waiting) + list(self.scheduler.ahead)

    def _finish(self, seq: Sequence, reason: str, kept: list[int] = (), text: str = "", error: str | None = None,
                logprobs: list[TokenLogprob] | None = None) -> TokenEvent:
        self.scheduler.finish(seq)
        if reason == "prefilled" and self.blocks.prefix is not None:
            self.blocks.prefix.pin(seq.prompt_ids, seq.ahead_ttl_s)
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
            prompt_text=seq.prompt_text,
            completion_tokens=budget.completion_length(seq),
        )
        del self._seqs[seq.seq_id]
        return TokenEvent(seq.seq_id, list(kept), text, finished=True, finish_reason=reason, error=error, result=result,
                          logprobs=logprobs)

    @staticmethod
    def _structured(seq: Sequence, reason: str, text: str, error: str | None) -> tuple[object, str | None]:
        fmt = seq.output_format
        if fmt is None or error is not None or reason in ("abort", "error"):
            return None, error
        if reason == "length" and not seq.grammar.complete and not fmt.is_text_answer(text):
            return None, (f"structured output truncated: max_tokens={seq.params.max_tokens} was reached before the "
                          f"JSON was complete; raw text: {text!r}")
        try:
            return parse_output(fmt, text), None
        except ValueError as e:  # json and jsonschema errors are ValueErrors
            return None, f"structured output is invalid ({type(e).__name__}: {str(e).splitlines()[0]}); raw text: {text!r}"
        except Exception as e:  # noqa: BLE001 - a schema the validator cannot apply fails this request, not the step
            return None, (f"structured output could not be validated ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0]}); raw text: {text!r}")

    # ---- scripts ----------------------------------------------------------------------------
    def generate(self, prompts: list, params: SamplingParams = SamplingParams()) -> list[GenerationResult]:
        """Run prompts to completion (a synchronous helper for scripts and tests)."""
        rids = [self.add_request(p, params) for p in prompts]
        results: dict[int, GenerationResult] = {}
        while len(results) < len(rids):
            results.update({ev.request_id: ev.result for ev in self.step() if ev.finished})
        return [results[r] for r in rids]
