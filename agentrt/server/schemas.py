"""Request and response bodies of the HTTP API (pydantic v2): the OpenAI-compatible chat
completions and the programs API. Requests forbid unknown fields, so a misspelt parameter is a
400 naming it rather than a silently ignored setting."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    # parts of OpenAI objects where clients send fields we do not use (a message's `name`, say)
    model_config = ConfigDict(extra="allow")


# ---- OpenAI chat completions: requests ---------------------------------------------------------
class TextPart(_Open):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Open):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Open):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content


class FunctionDef(_Strict):
    # OpenAI's rule, plus '.' between parts: the registry's MCP tools are `server.tool`
    name: str = Field(pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$", max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatCompletionRequest(_Strict):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM's extensions of the OpenAI request
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    min_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


# ---- OpenAI chat completions: responses --------------------------------------------------------
class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    refusal: None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class SpecStats(BaseModel):
    """The call's speculative decoding: drafts proposed and accepted (grammar-forced ones
    counted among both), α = accepted / drafted, tokens emitted per target forward pass."""

    drafted: int
    accepted: int
    forced: int
    alpha: float | None
    target_passes: int
    tokens_per_pass: float | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: UsageOut
    system_fingerprint: str | None = None
    agentrt: SpecStats | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: UsageOut | None = None
    system_fingerprint: str | None = None
    agentrt: SpecStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "agentrt"
    precision: str | None = None  # what runs (LoadedModel.precision); null while the model loads


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- programs API --------------------------------------------------------------------------------
# one definition for the server and agentrt.client (agentrt/client/schemas.py)
from agentrt.client.schemas import (InputWanted, ProgramInfo, ProgramList, RunCreate, RunCreated,  # noqa: E402,F401
                                    RunError, RunInfo, RunInput, RunList)


class SignedInput(RunInput):
    """POST /v1/runs/ID/input/NODE: the value, and who gives it (a person's or a system's name,
    optional; kept in the run's trace with when and how the value came)."""

    by: str | None = Field(None, min_length=1, max_length=200)
