"""Building OpenAI response bodies and SSE chunks from a finished or running Generation."""

from __future__ import annotations

from mooncake_server.api.generation import Generation
from mooncake_server.api.protocol import (
    AssistantMessage,
    ChatChunkChoice,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
)


def usage(gen: Generation) -> UsageInfo:
    """Token accounting of the request so far."""
    return UsageInfo.of(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)


def full_response(
    gen: Generation, model: str, chat: bool
) -> ChatCompletionResponse | CompletionResponse:
    """The non-streamed body of a finished generation."""
    ids = gen.token_ids if gen.return_token_ids else None
    prompt_ids = gen.prompt_token_ids if gen.return_token_ids else None
    if chat:
        return ChatCompletionResponse(
            id=gen.request_id, created=gen.created, model=model,
            choices=[ChatCompletionChoice(
                message=AssistantMessage(content=gen.detok.text),
                finish_reason=gen.finish_reason, token_ids=ids,
            )],
            usage=usage(gen), prompt_token_ids=prompt_ids,
        )
    return CompletionResponse(
        id=gen.request_id, created=gen.created, model=model,
        choices=[CompletionChoice(text=gen.detok.text, finish_reason=gen.finish_reason,
                                  token_ids=ids)],
        usage=usage(gen), prompt_token_ids=prompt_ids,
    )


def sse_chunk(
    gen: Generation, model: str, chat: bool, text: str | None, finish: str | None = None,
    first: bool = False,
) -> str:
    """One `data:` event carrying a text delta (and the finish reason on the last one).

    `first` marks the first chunk: chat's carries the assistant role; with return_token_ids
    it also carries the prompt ids.
    """
    chunk: ChatCompletionChunk | CompletionChunk
    prompt_ids = gen.prompt_token_ids if first and gen.return_token_ids else None
    ids = gen.take_new_ids()
    if chat:
        delta = DeltaMessage(role="assistant" if first else None, content=text)
        chunk = ChatCompletionChunk(
            id=gen.request_id, created=gen.created, model=model, prompt_token_ids=prompt_ids,
            choices=[ChatChunkChoice(delta=delta, finish_reason=finish, token_ids=ids)],
        )
    else:
        chunk = CompletionChunk(
            id=gen.request_id, created=gen.created, model=model, prompt_token_ids=prompt_ids,
            choices=[CompletionChoice(text=text or "", finish_reason=finish, token_ids=ids)],
        )
    return f"data: {chunk.model_dump_json()}\n\n"


def sse_usage_chunk(gen: Generation, model: str, chat: bool) -> str:
    """The final `data:` event of stream_options.include_usage: no choices, only usage."""
    cls = ChatCompletionChunk if chat else CompletionChunk
    chunk = cls(id=gen.request_id, created=gen.created, model=model, choices=[],
                usage=usage(gen))
    return f"data: {chunk.model_dump_json()}\n\n"
