"""OpenAI-compatible chat completions on the runtime: a request becomes LLM calls (one per
choice) through `Runtime.complete`, so the scheduling policy sees them beside program runs.

What maps to what:
    tools + tool_choice auto        a tool call or text (the grammar allows either)
    tool_choice required / named    a call (of that one tool), never text
    tool_choice none                the tools are described, the answer is text
    parallel_tool_calls (default)   the grammar allows a list of calls: the response may have several
    response_format json_object / json_schema   grammar-constrained JSON
Streaming sends chunks as OpenAI does: the role first, then content deltas or tool_call deltas
(index, id and name, then argument fragments), the finish_reason, usage when asked, [DONE].
Calls are read in the model family's own format (structured.tool_formats: the engine's tool_format);
with one that lets text come before the calls (Qwen's <tool_call> blocks), that text is the
message's content beside its tool_calls.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from agentrt.errors import AgentRTError
from agentrt.jsonutil import JsonDepthError, parse_json
from agentrt.runtime.backend import LLMRequest, LLMResponse, NodeIdentity
from agentrt.runtime.runtime import Runtime
from agentrt.runtime.trace import new_id
from agentrt.server.config import Limits
from agentrt.server.errors import ApiError
from agentrt.server.schemas import (AssistantMessage, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
                                    Choice, ChoiceLogprobs, ChunkChoice, TokenLogprobOut, Delta, FunctionCallDelta, FunctionCallOut,
                                    PromptTokensDetails, SpecStats, ToolCallDelta, ToolCallOut, UsageOut)
from agentrt.server.tool_stream import Delta as CallDelta, FamilyToolCallStream, ToolCallStream
from agentrt.spec.report import SpecFigures
from agentrt.structured.output_format import dumps
from agentrt.structured.tool_formats import HOUSE, ToolCallFormat
from agentrt.structured.tool_parse import parse_tool_calls

TRUNCATED = "structured output truncated"


@dataclass(frozen=True)
class PreparedChat:
    """A validated request as the runtime takes it."""

    messages: tuple[dict[str, Any], ...]
    response_format: dict[str, Any]
    max_tokens: int
    temperature: float
    sampling: dict[str, Any]  # further SamplingParams fields (top_p, stop, penalties, ...)
    seed: int | None
    n: int
    tools: bool  # the output may be tool calls
    parallel: bool


def _logprobs(req: ChatCompletionRequest) -> int | None:
    """SamplingParams.logprobs from OpenAI's logprobs / top_logprobs."""
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if not req.logprobs:
        return None
    return req.top_logprobs or 0


def _messages(req: ChatCompletionRequest, limits: Limits) -> tuple[dict[str, Any], ...]:
    if len(req.messages) > limits.max_messages:
        raise ApiError(400, f"{len(req.messages)} messages: over the limit max_messages={limits.max_messages}",
                       param="messages", code="too_many_messages")
    out = []
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.role == "assistant" and m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in m.tool_calls]
            for c in m.tool_calls:
                try:
                    parse_json(c.function.arguments)
                except JsonDepthError as e:
                    raise ApiError(400, f"messages.{i}.tool_calls: arguments of '{c.function.name}' are {e}",
                                   param=f"messages.{i}.tool_calls") from None
                except ValueError:
                    raise ApiError(400, f"messages.{i}.tool_calls: arguments of '{c.function.name}' are not JSON",
                                   param=f"messages.{i}.tool_calls") from None
        elif m.content is None:
            raise ApiError(400, f"messages.{i}: a {m.role} message needs content", param=f"messages.{i}.content")
        if m.role == "tool" and m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return tuple(out)


def _response_format(req: ChatCompletionRequest, limits: Limits) -> tuple[dict[str, Any], bool, bool]:
    """(the engine's response_format, whether tool calls may come back, parallel)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    size = len(json.dumps(tools)) + len(json.dumps(req.response_format.model_dump(by_alias=True) if req.response_format else {}))
    if size > limits.max_tool_schema_bytes:
        raise ApiError(400, f"tools and response_format take {size} bytes of JSON: over the limit "
                            f"max_tool_schema_bytes={limits.max_tool_schema_bytes}", param="tools",
                       code="schema_too_large")
    choice = req.tool_choice
    parallel = req.parallel_tool_calls is not False
    if tools and choice != "none":
        if req.response_format is not None and req.response_format.type != "text":
            raise ApiError(400, "response_format cannot be combined with tools unless tool_choice is 'none': "
                                "the output is either a tool call or the formatted answer", param="response_format")
        if choice is not None and not isinstance(choice, str):
            named = [t for t in tools if t["function"]["name"] == choice.function.name]
            if not named:
                raise ApiError(400, f"tool_choice names '{choice.function.name}', which is not among the tools",
                               param="tool_choice")
            tools, allow_text = named, False
        else:
            allow_text = choice != "required"
        return {"type": "tool_call", "tools": tools, "allow_text": allow_text, "parallel": parallel}, True, parallel
    if choice is not None and choice != "none":
        raise ApiError(400, f"tool_choice {choice if isinstance(choice, str) else 'function'!r} needs tools",
                       param="tool_choice")
    if tools:  # tool_choice none: described, text answer
        return {"type": "tool_call", "tools": tools, "tool_choice": "none"}, False, False
    rf = req.response_format
    if rf is None or rf.type == "text":
        return {"type": "text"}, False, False
    if rf.type == "json_object":
        return {"type": "json_object"}, False, False
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise ApiError(400, "response_format json_schema needs json_schema.schema", param="response_format.json_schema")
    return {"type": "json_schema", "json_schema": {"name": rf.json_schema.name, "schema": rf.json_schema.schema_}}, False, False


def with_registry_schemas(req: ChatCompletionRequest, registry: Any = None) -> ChatCompletionRequest:
    """A tool the request names without parameters that the server's tool registry has (an MCP
    server's `files.read_file`, a --tools module's tool) takes the registry's schema, and its
    description when the request gives none."""
    if registry is None or not req.tools:
        return req
    tools, changed = [], False
    for t in req.tools:
        f = t.function
        if f.parameters is None and f.name in registry:
            known = registry.get(f.name)
            t = t.model_copy(update={"function": f.model_copy(update={
                "description": f.description or known.description, "parameters": dict(known.parameters)})})
            changed = True
        tools.append(t)
    return req.model_copy(update={"tools": tools}) if changed else req


def prepare_chat(req: ChatCompletionRequest, model: str, limits: Limits, registry: Any = None) -> PreparedChat:
    """registry: the runtime's tools, whose schemas fill in tools the request names alone."""
    req = with_registry_schemas(req, registry)
    if req.model != model:
        raise ApiError(404, f"the model '{req.model}' does not exist here (this server serves '{model}')",
                       param="model", code="model_not_found")
    n = req.n or 1
    if n > limits.max_n:
        raise ApiError(400, f"n={n}: over the limit max_n={limits.max_n}", param="n")
    asked = req.max_completion_tokens or req.max_tokens
    if asked is not None and asked > limits.max_tokens:
        raise ApiError(400, f"max_tokens={asked}: over the limit max_tokens={limits.max_tokens}", param="max_tokens")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > 4 or any(not s for s in stop):
        raise ApiError(400, "stop: at most 4 non-empty strings", param="stop")
    rf, tools, parallel = _response_format(req, limits)
    temperature = 1.0 if req.temperature is None else req.temperature
    sampling: dict[str, Any] = {"stop": stop}
    for name in ("top_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens"):
        if getattr(req, name) is not None:
            sampling[name] = getattr(req, name)
    logprobs = _logprobs(req)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    if req.logit_bias:
        try:
            sampling["logit_bias"] = {int(t): b for t, b in req.logit_bias.items()}
        except ValueError:
            raise ApiError(400, "logit_bias: keys must be token ids (integers as strings)", param="logit_bias") from None
    return PreparedChat(_messages(req, limits), rf, asked or limits.default_max_tokens, temperature, sampling,
                        req.seed, n, tools, parallel)


def _sum_spec(responses: list[LLMResponse]) -> SpecStats:
    """The body's speculation figures, over the call's choices (rates rounded for the API)."""
    t = SpecFigures.sum(r.spec.total for r in responses)
    return SpecStats(drafted=t.drafted, accepted=t.accepted, forced=t.forced, target_passes=t.target_passes,
                     alpha=None if t.alpha is None else round(t.alpha, 4),
                     tokens_per_pass=None if t.tokens_per_pass is None else round(t.tokens_per_pass, 4))


def _usage(responses: list[LLMResponse]) -> UsageOut:
    prompt = responses[0].usage.input_tokens if responses else 0
    completion = sum(r.usage.output_tokens for r in responses)
    cached = responses[0].usage.cached_input_tokens if responses else 0
    return UsageOut(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                    prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _calls(parsed: Any) -> list[dict[str, Any]] | None:
    if isinstance(parsed, dict) and "name" in parsed:
        return [parsed]
    if isinstance(parsed, list):
        return parsed
    return None


def _finish_reason(response: LLMResponse, calls: list | None) -> str:
    if response.finish_reason == "length":
        return "length"
    return "tool_calls" if calls else "stop"


def check_response(response: LLMResponse) -> None:
    """An engine failure is a 500 with the engine's message; a structured output cut by
    max_tokens is not a failure (finish_reason "length", the text as generated)."""
    if response.finish_reason == "length" and (response.error or "").startswith(TRUNCATED):
        return
    if response.error is not None or response.finish_reason in ("error", "abort"):
        raise ApiError(500, f"the engine failed: {response.error or response.finish_reason}", code="engine_error")


@dataclass
class ChatService:
    runtime: Runtime
    model: str
    limits: Limits
    on_response: Callable[[LLMResponse], None] | None = None  # metrics
    tool_format: ToolCallFormat = HOUSE  # the syntax the model writes calls in (LLMEngine.tool_format)
    inflight: int = field(default=0, init=False)

    def _request(self, chat: PreparedChat, call_id: str, index: int) -> LLMRequest:
        seed = None if chat.seed is None else chat.seed + index
        return LLMRequest(chat.messages, chat.response_format, chat.max_tokens, chat.temperature,
                          NodeIdentity(f"{call_id}-{index}", "chat.completions", "completion"),
                          sampling={**chat.sampling, "seed": seed})

    def admit(self, chat: PreparedChat) -> None:
        if self.inflight + chat.n > self.limits.max_inflight_chats:
            raise ApiError(429, f"too many chat completions in flight ({self.inflight}; limit "
                                f"max_inflight_chats={self.limits.max_inflight_chats})", code="too_many_requests",
                           headers={"Retry-After": str(self.limits.retry_after_s)})

    async def _complete(self, request: LLMRequest, on_text: Callable[[str], None] | None = None,
                        on_logprobs: Callable[[list[dict[str, Any]]], None] | None = None) -> LLMResponse:
        self.inflight += 1
        try:
            response = await self.runtime.complete(request, on_text=on_text, on_logprobs=on_logprobs)
        except AgentRTError as e:  # the engine refused it (prompt too long for the context, say)
            raise ApiError(400, str(e), param="messages", code="invalid_request") from None
        finally:
            self.inflight -= 1
        if self.on_response is not None:
            self.on_response(response)
        check_response(response)
        return response

    async def create(self, chat: PreparedChat) -> ChatCompletion:
        call_id = f"chatcmpl-{new_id(12)}"
        self.admit(chat)
        responses = list(await asyncio.gather(*(self._complete(self._request(chat, call_id, i)) for i in range(chat.n))))
        choices = []
        for i, r in enumerate(responses):
            calls = _calls(r.parsed) if chat.tools else None
            if calls:
                # text the model wrote around its calls (a family format lets it) is the content
                family = self.tool_format.name != HOUSE.name
                content = parse_tool_calls(self.tool_format, r.text).content if family else ""
                message = AssistantMessage(content=content or None, tool_calls=[
                    ToolCallOut(id=f"call_{new_id(12)}", function=FunctionCallOut(name=c["name"], arguments=dumps(c["arguments"])))
                    for c in calls])
            else:
                message = AssistantMessage(content=r.text)
            logprobs = None if r.logprobs is None else ChoiceLogprobs(content=[TokenLogprobOut(**e) for e in r.logprobs])
            choices.append(Choice(index=i, message=message, finish_reason=_finish_reason(r, calls), logprobs=logprobs))
        return ChatCompletion(id=call_id, created=int(time.time()), model=self.model, choices=choices,
                              usage=_usage(responses), agentrt=_sum_spec(responses))

    async def stream(self, chat: PreparedChat, include_usage: bool) -> AsyncIterator[ChatCompletionChunk]:
        """The chunks of a streamed completion (the caller writes them as SSE, then [DONE])."""
        call_id, created = f"chatcmpl-{new_id(12)}", int(time.time())
        self.admit(chat)
        # (choice, delta, its tokens' logprobs, the final response, an error)
        queue: asyncio.Queue[tuple[int, Delta | None, list | None, LLMResponse | None, BaseException | None]] = \
            asyncio.Queue()

        def chunk(choices: list[ChunkChoice], **extra: Any) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=call_id, created=created, model=self.model, choices=choices, **extra)

        async def one(index: int) -> None:
            deltas = _DeltaMaker(chat, lambda: f"call_{new_id(12)}", self.tool_format)
            pending: list[dict[str, Any]] = []  # logprobs of tokens whose text has not gone out yet

            def on_logprobs(entries: list[dict[str, Any]]) -> None:
                pending.extend(entries)

            def on_text(text: str) -> None:
                for d in deltas.feed(text):
                    lps = None
                    if d.content and pending:  # OpenAI reports logprobs of content tokens
                        lps = list(pending)
                        pending.clear()
                    queue.put_nowait((index, d, lps, None, None))

            try:
                response = await self._complete(self._request(chat, call_id, index), on_text,
                                                on_logprobs if chat.sampling.get("logprobs") is not None else None)
                for d in deltas.end():
                    queue.put_nowait((index, d, None, None, None))
                queue.put_nowait((index, None, None, response, None))
            except BaseException as e:  # noqa: BLE001 - handed to the streaming side, which raises it
                queue.put_nowait((index, None, None, None, e))

        tasks = [asyncio.get_running_loop().create_task(one(i)) for i in range(chat.n)]
        try:
            # the role chunks wait for the first piece of output: a request the engine refuses (a
            # prompt too long for the context) is then still answered with a plain 4xx
            item = await queue.get()
            if item[4] is not None:
                raise item[4]
            for i in range(chat.n):
                yield chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
            responses: dict[int, LLMResponse] = {}
            tool_calls_seen: set[int] = set()
            while len(responses) < chat.n:
                index, delta, lps, response, error = item if item is not None else await queue.get()
                item = None
                if error is not None:
                    raise error
                if delta is not None:
                    if delta.tool_calls:
                        tool_calls_seen.add(index)
                    logprobs = None if lps is None else ChoiceLogprobs(content=[TokenLogprobOut(**e) for e in lps])
                    yield chunk([ChunkChoice(index=index, delta=delta, logprobs=logprobs)])
                    continue
                assert response is not None
                responses[index] = response
                reason = "length" if response.finish_reason == "length" else (
                    "tool_calls" if index in tool_calls_seen else "stop")
                last = len(responses) == chat.n
                yield chunk([ChunkChoice(index=index, delta=Delta(), finish_reason=reason)],
                            agentrt=_sum_spec(list(responses.values())) if last else None)
            if include_usage:
                yield chunk([], usage=_usage([responses[i] for i in sorted(responses)]))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class _DeltaMaker:
    """Turns one choice's generated text into OpenAI deltas: content, or (when the output may be
    tool calls and it starts like one) tool_call deltas."""

    def __init__(self, chat: PreparedChat, new_call_id: Callable[[], str], syntax: ToolCallFormat = HOUSE) -> None:
        self.tools, self.parallel = chat.tools, chat.parallel
        self.new_call_id = new_call_id
        self.mode: str | None = None if chat.tools else "text"  # decided by the first non-blank char
        self.pending = ""
        self.calls: ToolCallStream | None = None
        self.family = (FamilyToolCallStream(syntax, new_call_id, chat.parallel)
                       if chat.tools and syntax.name != HOUSE.name else None)

    @staticmethod
    def _call_delta(d: CallDelta) -> Delta:
        i, cid, name, frag = d
        return Delta(tool_calls=[ToolCallDelta(index=i, id=cid, type="function" if cid else None,
                                               function=FunctionCallDelta(name=name, arguments=frag))])

    def feed(self, text: str) -> list[Delta]:
        if self.family is not None:
            return [Delta(content=d) if isinstance(d, str) else self._call_delta(d) for d in self.family.feed(text)]
        if self.mode is None:
            self.pending += text
            stripped = self.pending.lstrip()
            if not stripped:
                return []
            start = "[" if self.parallel else "{"
            self.mode = "calls" if stripped[0] == start else "text"
            text, self.pending = self.pending, ""
            if self.mode == "calls":
                self.calls = ToolCallStream(self.parallel, self.new_call_id)
        if self.mode == "text":
            return [Delta(content=text)] if text else []
        assert self.calls is not None
        return [self._call_delta(d) for d in self.calls.feed(text)]

    def end(self) -> list[Delta]:
        if self.family is not None:
            return [Delta(content=c) for c in self.family.end()]
        if self.mode is None and self.pending:  # only blanks were generated
            return [Delta(content=self.pending)]
        return []
