"""What engine workers (`agentrt engine-worker`) and RemoteEngineBackend agree on over MQTT 5.

Topics (PREFIX and GROUP from MqttConfig; every message QoS 1, JSON):
  PREFIX/GROUP/llm/call               calls any worker may take: workers subscribe
                                      $share/GROUP/PREFIX/GROUP/llm/call, so the broker hands each to one
  PREFIX/GROUP/llm/worker/W/call      calls routed to worker W (KV affinity, least load)
  PREFIX/GROUP/llm/worker/W/control   {"op": "cancel" | "priority" | "pin", "call_id", ...} for W's calls
  PREFIX/GROUP/llm/status/W           retained: {"status": "online", load, KV blocks, ...} every
                                      interval_s; {"status": "offline"} (its MQTT 5 last will, or a clean stop)
  PREFIX/GROUP/llm/steps/W            one engine-lane record per engine step of W
  PREFIX/GROUP/llm/reply/CLIENT       a caller's replies (response topic; correlation data = call id):
                                      ack, text deltas, per-request steps, then result | error;
                                      "pinned" answers a pin

Times: engines stamp steps with their own time.monotonic(), which means nothing on another
machine, so steps travel as wall-clock times (`wall`) and the caller maps them onto its own
monotonic clock (machines' clocks are assumed NTP-synchronised).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields
from typing import Any, Mapping

from agentrt.runtime.backend import EngineStep, LLMRequest, LLMStepEvent, NodeIdentity, PromptRecord, Usage
from agentrt.runtime.engine_backend import EngineResponse
from agentrt.spec.report import SpecReport
from agentrt.tools.mqtt_protocol import MqttConfig


@dataclass(frozen=True)
class RemoteResponse(EngineResponse):
    """An EngineResponse from an engine worker: which worker ran it (the last, when retried) and
    how many times it was sent to another worker after one was lost."""

    worker: str = ""
    retries: int = 0


@dataclass(frozen=True)
class RemoteEngineStep(EngineStep):
    """An engine-lane step of one engine worker (step numbers are per worker)."""

    worker: str = ""


@dataclass(frozen=True)
class RemoteStepEvent(LLMStepEvent):
    """A request's engine step on an engine worker (which one: a retried call has steps on two)."""

    worker: str = ""


class LLMTopics:
    """The engine-worker topics of one broker, prefix and group."""

    def __init__(self, config: MqttConfig) -> None:
        self.config = config
        self.base = f"{config.prefix}/{config.group}/llm"

    @property
    def call(self) -> str:
        return f"{self.base}/call"

    @property
    def shared_call(self) -> str:
        return f"$share/{self.config.group}/{self.call}"

    def worker_call(self, worker: str) -> str:
        return f"{self.base}/worker/{worker}/call"

    def control(self, worker: str) -> str:
        return f"{self.base}/worker/{worker}/control"

    def status(self, worker: str) -> str:
        return f"{self.base}/status/{worker}"

    @property
    def status_filter(self) -> str:
        return f"{self.base}/status/+"

    def steps(self, worker: str) -> str:
        return f"{self.base}/steps/{worker}"

    @property
    def steps_filter(self) -> str:
        return f"{self.base}/steps/+"

    def reply(self, client: str) -> str:
        return f"{self.base}/reply/{client}"


# -- clocks --------------------------------------------------------------------------------------
def to_wall(monotonic_t: float) -> float:
    return time.time() - (time.monotonic() - monotonic_t)


def from_wall(wall_t: float) -> float:
    return time.monotonic() - (time.time() - wall_t)


# -- requests ------------------------------------------------------------------------------------
def request_to_dict(request: LLMRequest) -> dict[str, Any]:
    return {"messages": [dict(m) for m in request.messages], "response_format": dict(request.response_format),
            "max_tokens": request.max_tokens, "temperature": request.temperature,
            "node": {"run_id": request.node.run_id, "program": request.node.program, "node": request.node.node},
            # a prefill-ahead's priority is +inf, which JSON has no number for
            "priority": request.priority if math.isfinite(request.priority) else None, "hints": dict(request.hints), "sampling": dict(request.sampling)}


def request_from_dict(d: Mapping[str, Any]) -> LLMRequest:
    """ValueError naming the field at fault for a malformed request."""
    try:
        node = d["node"]
        return LLMRequest(tuple(d["messages"]), dict(d["response_format"]), int(d["max_tokens"]),
                          float(d["temperature"]), NodeIdentity(str(node["run_id"]), str(node["program"]), str(node["node"])),
                          float("inf") if d.get("priority", 0.0) is None else float(d.get("priority", 0.0)), dict(d.get("hints") or {}), dict(d.get("sampling") or {}))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed LLM request ({type(e).__name__}: {e})") from None


# -- steps ---------------------------------------------------------------------------------------
def step_event_to_dict(ev: LLMStepEvent) -> dict[str, Any]:
    d = {f.name: getattr(ev, f.name) for f in fields(ev)}
    d["wall"] = to_wall(d.pop("start"))
    return d


def step_event_from_dict(d: Mapping[str, Any], worker: str) -> RemoteStepEvent:
    names = {f.name for f in fields(LLMStepEvent)} - {"start"}
    return RemoteStepEvent(start=from_wall(float(d["wall"])), worker=worker, **{k: v for k, v in d.items() if k in names})


def engine_step_to_dict(step: EngineStep) -> dict[str, Any]:
    d = step.to_record()
    d["wall"] = to_wall(d.pop("start"))
    return d


def engine_step_from_dict(d: Mapping[str, Any], worker: str) -> RemoteEngineStep:
    names = {f.name for f in fields(EngineStep)} - {"start"}
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names}
    return RemoteEngineStep(start=from_wall(float(d["wall"])), worker=worker, **kw)


# -- responses -----------------------------------------------------------------------------------
def response_to_dict(r: EngineResponse) -> dict[str, Any]:
    prompt = None if r.prompt is None else {
        "messages": [dict(m) for m in r.prompt.messages], "text": r.prompt.text, "parts": [dict(p) for p in r.prompt.parts],
        "tools": None if r.prompt.tools is None else [dict(t) for t in r.prompt.tools]}
    return {"text": r.text, "parsed": r.parsed, "finish_reason": r.finish_reason,
            "usage": {"input_tokens": r.usage.input_tokens, "output_tokens": r.usage.output_tokens,
                      "cached_input_tokens": r.usage.cached_input_tokens},
            "spec": r.spec.to_dict(), "request_id": r.request_id, "error": r.error,
            "sent_messages": None if r.sent_messages is None else [dict(m) for m in r.sent_messages],
            "logprobs": None if r.logprobs is None else [dict(lp) for lp in r.logprobs], "prompt": prompt,
            "prompt_token_ids": list(getattr(r, "prompt_token_ids", ())), "token_ids": list(getattr(r, "token_ids", ()))}


def response_from_dict(d: Mapping[str, Any], worker: str, retries: int) -> RemoteResponse:
    p = d.get("prompt")
    prompt = None if p is None else PromptRecord(tuple(p["messages"]), p.get("text"), tuple(p.get("parts") or ()),
                                                 None if p.get("tools") is None else tuple(p["tools"]))
    return RemoteResponse(
        text=d["text"], parsed=d.get("parsed"), finish_reason=d["finish_reason"], usage=Usage(**d["usage"]),
        spec=SpecReport.from_dict(d.get("spec")), request_id=d.get("request_id"), error=d.get("error"),
        sent_messages=None if d.get("sent_messages") is None else tuple(d["sent_messages"]),
        logprobs=None if d.get("logprobs") is None else tuple(d["logprobs"]), prompt=prompt,
        prompt_token_ids=tuple(d.get("prompt_token_ids") or ()), token_ids=tuple(d.get("token_ids") or ()),
        worker=worker, retries=retries)


# -- KV affinity ---------------------------------------------------------------------------------
def conversation_hash(messages: Any) -> str:
    """A short hash of a conversation's messages (role and content). Workers report those of the
    conversations they recently cached (prompt plus the answer as an assistant turn), and a call
    whose messages begin with one of them goes to that worker: its prompt's KV is cached there."""
    import hashlib
    import json

    canon = [{"role": m.get("role"), "content": m.get("content"), "tool_calls": m.get("tool_calls")} for m in messages]
    return hashlib.blake2b(json.dumps(canon, sort_keys=True, default=str).encode(), digest_size=8).hexdigest()


def prefix_hashes(messages: Any) -> list[str]:
    """conversation_hash of each leading run of the messages, longest first (the whole included)."""
    messages = list(messages)
    return [conversation_hash(messages[:i]) for i in range(len(messages), 0, -1)]
