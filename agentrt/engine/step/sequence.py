"""One request's life in the engine: its tokens, how many of them are in the KV cache, its
sampler state and why it finished. A step's emitted tokens end here: its StopChecker keeps them
one at a time, exactly as plain decoding would (the first stop token, stop string or max_tokens
ends the output, and later tokens of the same accepted draft run are dropped), and
`Sequence.commit` is where the kept tokens join the output."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from agentrt.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from agentrt.engine.chat.tokenizer import IncrementalDetokenizer


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    priority: float = 0.0  # smaller runs first; the runtime sets it (least attained service)
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens of all_ids whose K/V is in the cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    generator: torch.Generator | None = None  # draws for drafts with a distribution (spec.drafters.model)
    seed: int = 0  # keys the per-position uniforms of sampling (decoding.sampling.position_uniforms)
    num_preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (prefill saved)
    first_token_time: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # owner's annotations (program, node)
    output_format: Any = None  # agentrt.structured.output_format.OutputFormat when constrained
    grammar: Any = None  # agentrt.structured.grammar.GrammarState when constrained
    closing: Any = None  # agentrt.engine.step.budget.Closing when constrained: its completion within max_tokens
    penalties: Any = None  # agentrt.decoding.penalties.Penalties when the request asks for any
    logprobs: list = field(default_factory=list)  # TokenLogprob per output token, when asked for
    prompt_text: str | None = None  # the text prompt_ids were encoded from (None: given as token ids)
    # a prefill-ahead request (LLMEngine.prepare_ahead): its prompt's KV is computed while the engine
    # has nothing else to run, then cached and pinned this many seconds; nothing is sampled
    ahead_ttl_s: float | None = None

    @property
    def prefill_only(self) -> bool:
        return self.ahead_ttl_s is not None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def commit(self, tokens: list[int], logprobs: list | None = None) -> None:
        """The one place a step's kept tokens (stop checks applied) become the output: the output
        ids, their logprobs, the grammar's matcher and the budget's forced completion advance."""
        self.output_ids += tokens
        if logprobs is not None:
            self.logprobs += logprobs
        if self.grammar is not None:
            self.grammar.commit(tokens)
        if self.closing is not None:
            self.closing.commit(tokens)


class StopChecker:
    def __init__(self, seq: Sequence, eos_ids: tuple[int, ...], detok: IncrementalDetokenizer):
        self.seq = seq
        p = seq.params
        self.stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
        self.detok = detok
        self.text = ""  # visible output text (stop strings cut)
        self._held = ""  # text that could still be the start of a stop string
        self._max_stop = max((len(s) for s in p.stop), default=0)

    def apply(self, tokens: list[int]) -> tuple[list[int], str, str | None]:
        """Take tokens in order, after the output so far, until one finishes the request (the
        caller commits the kept ones: Sequence.commit). Returns (tokens kept, new visible text,
        finish reason or None)."""
        seq, p = self.seq, self.seq.params
        kept: list[int] = []
        new_text = ""
        for t in tokens:
            kept.append(t)
            if t in self.stop_ids:
                return kept, new_text + self.flush(), "stop"
            piece = self.detok.push(t)
            if p.stop:
                buf = self._held + piece
                hit = min(((buf.find(s), s) for s in p.stop if s in buf), default=None)
                if hit is not None:
                    new_text += buf[: hit[0]]
                    self.text += buf[: hit[0]]
                    self._held = ""
                    return kept, new_text, "stop"
                # Hold back a tail that may be the beginning of a stop string.
                keep = self._max_stop - 1
                emit, self._held = (buf[:-keep], buf[-keep:]) if keep and len(buf) > keep else ((buf, "") if not keep else ("", buf))
                new_text += emit
                self.text += emit
            else:
                new_text += piece
                self.text += piece
            if len(seq.output_ids) + len(kept) >= p.max_tokens:
                return kept, new_text + self.flush(), "length"
        return kept, new_text, None

    def flush(self) -> str:
        """Text held back for stop strings, now given out (the request ends without one)."""
        out, self._held = self._held, ""
        self.text += out
        return out
