"""One request's life in the engine: its tokens, how many of them are in the KV cache, its
sampler state and why it finished."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrt.engine.sampling_params import SamplingParams


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
    grammar: Any = None  # agentrt.spec.grammar.GrammarState when constrained
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
