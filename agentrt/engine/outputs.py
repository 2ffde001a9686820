"""What the engine hands back: per-step token events, final results, and per-step records."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentrt.spec.report import NO_SPEC, SpecReport


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model and the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class TokenEvent:
    """New tokens of one request from one engine step (several when drafts were accepted)."""

    request_id: int
    token_ids: list[int]
    text: str  # newly completed text (stop strings already cut)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    result: "GenerationResult | None" = None  # on the final event
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them


@dataclass
class GenerationResult:
    request_id: int
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    parsed: Any = None  # structured output: the JSON value, or {"name", "arguments"} for a tool call
    spec: SpecReport = NO_SPEC  # speculation figures (drafted, accepted, α, tokens per pass, ...)
    timings: dict[str, float] = field(default_factory=dict)  # queued, first_token, finished (monotonic s)
    num_preemptions: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    prompt_text: str | None = None  # the exact text the prompt was tokenized from (chat template applied)
    # the last tokens that were forced to complete a structured output within max_tokens
    # (engine.step.budget); the tokens before them are the model's own
    completion_tokens: int = 0


@dataclass
class StepRecord:
    """One engine step, for timelines: who ran, how many drafts, what it cost."""

    step: int
    start: float  # monotonic seconds
    duration_s: float
    batch_size: int
    num_tokens: int  # new tokens fed to the target (prefill + decode + drafts)
    num_prefill_tokens: int
    kv_tokens: int  # total context read by attention
    request_ids: list[int] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # tokens of each request fed (excl. drafts)
    k: list[int] = field(default_factory=list)  # drafts per sequence (0 for prefill rows)
    forced: list[int] = field(default_factory=list)  # of those, grammar-forced ones (accepted by construction)
    accepted: list[int] = field(default_factory=list)
    expected_accepted: list[float] = field(default_factory=list)
    predicted_s: float | None = None
    draft_s: float = 0.0
    preempted: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
