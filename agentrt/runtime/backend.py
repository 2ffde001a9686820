"""The runtime's view of an LLM engine: one async call per LLM node, plus a lane of engine steps.

The runtime never imports the engine; `EngineBackend` (engine_backend.py) adapts
`agentrt.engine.AsyncEngine` to this interface, `ScriptedBackend` (scripted.py) simulates one for
tests and dry runs. Times are `time.monotonic()` seconds, the clock the engine stamps steps with.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from agentrt.spec.report import NO_SPEC, SpecReport


@dataclass(frozen=True)
class NodeIdentity:
    """Which node of which program run a request belongs to (engine meta, trace attributes)."""

    run_id: str
    program: str
    node: str


@dataclass(frozen=True)
class LLMRequest:
    """One LLM node's call. response_format is the DSL's OpenAI-style dict: {"type": "text"},
    {"type": "json_schema", "json_schema": {...}} or {"type": "tool_call", "tools": [...],
    "allow_text": bool} (with "tool_choice": "none" the tools are described but the answer is
    text: an agent loop's last step; with "required" or a named tool, the answer is a call:
    agentrt.structured.output_format). priority: smaller runs sooner. hints: what a scheduler may use, e.g.
    {"next_is_tool": True} when a tool call follows this call (its KV could be held)."""

    messages: tuple[Mapping[str, Any], ...]
    response_format: Mapping[str, Any]
    max_tokens: int
    temperature: float
    node: NodeIdentity
    priority: float = 0.0
    hints: Mapping[str, Any] = field(default_factory=dict)
    # further SamplingParams fields (top_p, seed, stop, penalties, logit_bias, min_tokens): what a
    # served chat completion or a node's `sampling` asks for
    sampling: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LLMStepEvent:
    """One engine step this request took part in: num_new prompt/context tokens fed (>1 while
    prefilling), k drafts verified and `accepted` of them kept. preempted: the request was
    evicted at this step (it runs again later, re-prefilling)."""

    step: int
    start: float
    duration_s: float
    batch_size: int
    num_new: int
    k: int = 0
    accepted: int = 0
    preempted: bool = False


@dataclass(frozen=True)
class Usage:
    """cached_input_tokens: prompt tokens whose KV the engine reused (prefix cache)."""

    input_tokens: int
    output_tokens: int
    cached_input_tokens: int = 0


@dataclass(frozen=True)
class PromptRecord:
    """What the model was sent: the messages as encoded (the backend's format instructions
    added), the tools handed to the chat template (None: none), the exact text that was
    tokenized (None when the backend does not render one), and its parts as
    [{"part", "tokens", "added"}] (engine.chat.prompt_parts)."""

    messages: tuple[Mapping[str, Any], ...]
    text: str | None = None
    parts: tuple[Mapping[str, Any], ...] = ()
    tools: tuple[Mapping[str, Any], ...] | None = None


@dataclass(frozen=True)
class LLMResponse:
    """text: what the model wrote; parsed: the structured value the engine decoded (JSON for
    json_schema, {"name", "arguments"} for tool_call, None otherwise or when the model answered
    in text). spec: the engine's speculation figures (total and by drafter; α and tokens per pass
    are its properties). error is set when finish_reason is "error".
    sent_messages: the messages as the model got them when the backend added to them (format
    instructions, say); a call that continues this one replays these, so its prompt starts with
    exactly the tokens already cached. None: sent as given."""

    text: str
    parsed: Any
    finish_reason: str
    usage: Usage
    spec: SpecReport = NO_SPEC
    request_id: Any = None
    error: str | None = None
    sent_messages: tuple[Mapping[str, Any], ...] | None = None
    # when sampling asked for logprobs: per generated token, OpenAI's shape ({"token", "logprob",
    # "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]})
    logprobs: tuple[Mapping[str, Any], ...] | None = None
    prompt: PromptRecord | None = None


@dataclass(frozen=True)
class EngineStep:
    """One step of the whole engine (all programs), for the engine lane of a trace."""

    step: int
    start: float
    duration_s: float
    batch_size: int
    num_tokens: int
    num_prefill_tokens: int = 0
    kv_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    max_k: int = 0
    preempted: int = 0
    predicted_s: float | None = None
    draft_s: float = 0.0
    ks: tuple[int, ...] = ()  # drafts per sequence of the batch (0 for prefill rows)
    accepted_ks: tuple[int, ...] = ()  # accepted per sequence

    def to_record(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


@dataclass
class KVPin:
    """One KV hold: the tokens whose cached blocks were pinned, for how long, and how many
    blocks the engine pinned (None until it has done so)."""

    request_id: Any
    tokens: tuple[int, ...]
    ttl_s: float
    blocks: int | None = None


@dataclass(frozen=True)
class AheadResult:
    """How a prefill-ahead request ended: the known prompt tokens, those it computed (the rest
    were cached already), and "prefilled" (cached and pinned), "dropped" (no KV room) or "abort"."""

    tokens: int
    computed: int
    finish_reason: str


StepCallback = Callable[[LLMStepEvent], None]


@runtime_checkable
class LLMBackend(Protocol):
    """What the runtime needs from an engine. Callbacks run on the caller's event loop."""

    model_name: str

    async def complete(self, request: LLMRequest, *, on_step: StepCallback | None = None,
                       on_start: Callable[[Any], None] | None = None,
                       on_text: Callable[[str], None] | None = None) -> LLMResponse:
        """Run one request to its end. on_start(handle) is called once the request is queued
        (the handle is what set_priority takes); on_step for each engine step it joins; on_text
        with each piece of output text as it is generated (the pieces add up to the response's
        text). Cancelling the awaiting task aborts the request. Invalid requests raise AgentRTError."""
        ...

    def set_priority(self, handle: Any, priority: float) -> None:
        """Change a queued or running request's priority (smaller = sooner)."""
        ...

    def subscribe_steps(self, fn: Callable[[EngineStep], None]) -> Callable[[], None]:
        """Call fn(EngineStep) on this event loop after each engine step; returns unsubscribe."""
        ...

    def pin(self, response: LLMResponse, ttl_s: float,
            on_pinned: Callable[[KVPin], None] | None = None) -> KVPin | None:
        """Hold the KV of this call's prompt and output for ttl_s seconds (its program waits on a
        tool and will send them again); on_pinned(pin) follows on this loop once pin.blocks is
        known. None: the backend keeps no reusable KV for this response."""
        ...

    def reuse(self, pin: KVPin, response: LLMResponse) -> tuple[int, int]:
        """(reusable, reused) prompt tokens of a later call against a hold: what its prompt
        shares with the held tokens in whole blocks, and what the engine took from its cache."""
        ...

    async def kv_blocks(self) -> Mapping[str, int] | None:
        """KV cache blocks by state (total, free, used, cached, pinned); None without a KV cache."""
        ...
