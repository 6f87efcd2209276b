"""Pydantic models of the OpenAI-compatible API (requests, responses, stream chunks).

Requests ignore unknown fields so newer clients keep working; fields we cannot honour (non-text
content parts) fail validation with a message that says so.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
)

# As OpenAI: at most this many tokens in `logit_bias`.
MAX_LOGIT_BIAS_ENTRIES = 300
# Top alternatives per token: OpenAI's chat limit (vLLM's default --max-logprobs is 20 too).
MAX_TOP_LOGPROBS = 20


class _Request(BaseModel):
    """Base of request bodies: unknown extra fields are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    """`stream_options`: only include_usage is meaningful."""

    include_usage: bool = False


class TextPart(_Request):
    """A `{"type": "text", "text": ...}` content part (the only kind a text model accepts)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """One chat turn; content is a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class _SamplingFields(_Request):
    """Fields shared by chat and text completions."""

    model: str | None = None  # None = the served model
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # torch's seed range
    stop: str | list[str] | None = None
    n: int | None = Field(default=1, ge=1)  # at most --max-n (api/limits.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension: keep generating past EOS
    return_token_ids: bool = False  # vLLM extension: prompt and output token ids in the reply
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    # JSON object keys are strings; pydantic reads "1234" as the token id 1234.
    logit_bias: dict[int, float] | None = None
    # vLLM extension. NOTE: below 0.01 dividing a logit by it can overflow float32 to inf.
    repetition_penalty: float | None = Field(default=1.0, ge=0.01, le=2.0)
    min_tokens: int = Field(default=0, ge=0)  # vLLM extension: no EOS nor stop string before

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        # NOTE: whether the ids exist depends on the tokenizer, checked after parsing.
        if not value:
            return value
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                             f"got {len(value)}")
        for token, bias in value.items():
            if token < 0:
                raise ValueError(f"logit_bias: token id {token} is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: the bias of token {token} is {bias}; "
                                 "it must be between -100 and 100")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        # NOTE: how many and how long is a server limit (api/limits.py), checked after parsing.
        stops = [value] if isinstance(value, str) else (value or [])
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty strings")
        return value

    def stop_list(self) -> list[str]:
        """The stop sequences as a list (possibly empty)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    def logprobs_top(self) -> int | None:
        """Top alternatives per output token, None when no log-probabilities are asked."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens; None = not given."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingFields):
    """Body of POST /v1/completions (one prompt: a string or token ids)."""

    prompt: str | list[int]
    # NOTE: the legacy completions API (and vLLM) default to 16 new tokens, unlike chat.
    # 0 only with echo: the prompt scored, nothing generated (how harnesses score choices).
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    def logprobs_top(self) -> int | None:
        """Top alternatives per token, None when no log-probabilities are asked."""
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        # A batch of one (["text"] or [[ids]], what lm-eval sends) is that prompt; more than one
        # prompt per request is not served.
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError(f"one prompt per request is supported, got {len(value)}")
            return value[0]
        return value

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: str | list[int]) -> str | list[int]:
        if len(value) == 0:
            raise ValueError("prompt must not be empty")
        return value

    def requested_max_tokens(self) -> int | None:
        """The max_tokens given (None = fill the context)."""
        return self.max_tokens


# ---------------------------------------------------------------------------------------------
# Responses


class PromptTokensDetails(BaseModel):
    """Breakdown of the prompt tokens; cached = KV reused instead of recomputed."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token accounting of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        """Usage with total computed."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


def _now() -> int:
    return int(time.time())


class _Reply(BaseModel):
    """Response base: fields named in `omit_if_none` leave the JSON when they are None."""

    omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in self.omit_if_none:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class CompletionLogprobs(BaseModel):
    """`choices[].logprobs` of /v1/completions (the legacy shape), one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: the first prompt token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)  # where each token starts in `text`


class TopLogprob(BaseModel):
    """An alternative token of a chat log-probability entry."""

    token: str
    logprob: float
    bytes: list[int] | None = None  # UTF-8 bytes of `token`


class ChatTokenLogprob(TopLogprob):
    """One output token of a chat completion, its log-probability and the top alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """`choices[].logprobs` of /v1/chat/completions."""

    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    """The generated message of a chat completion."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(_Reply):
    """One choice of a chat completion."""

    omit_if_none = ("token_ids",)
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids (EOS included)


class ChatCompletionResponse(_Reply):
    """Non-streamed chat completion."""

    omit_if_none = ("prompt_token_ids",)
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class DeltaMessage(_Reply):
    """Incremental message in a chunk; absent fields are left out of the JSON."""

    omit_if_none = ("role", "content")
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Reply):
    """One choice of a chat stream chunk."""

    omit_if_none = ("token_ids",)
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids: ids since the last chunk


class _Chunk(_Reply):
    """Stream chunk base: `usage` appears only on the final usage chunk."""

    omit_if_none = ("usage", "prompt_token_ids")
    id: str
    created: int = Field(default_factory=_now)
    model: str
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids, on the first chunk


class ChatCompletionChunk(_Chunk):
    """One SSE event of a streamed chat completion."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChoice(_Reply):
    """One choice of a text completion (also used in its stream chunks)."""

    omit_if_none = ("token_ids",)
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(_Reply):
    """Non-streamed text completion."""

    omit_if_none = ("prompt_token_ids",)
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class CompletionChunk(_Chunk):
    """One SSE event of a streamed text completion."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    """An entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "mooncake-server"
    max_model_len: int | None = None


class ModelList(BaseModel):
    """Body of GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
