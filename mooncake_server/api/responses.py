"""Building OpenAI response bodies and SSE chunks from a finished or running Generation."""

from __future__ import annotations

from mooncake_server.api.generation import Choice, Generation
from mooncake_server.api.logprob_format import LogprobFormatter
from mooncake_server.api.protocol import (
    AssistantMessage,
    ChatChunkChoice,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
)
from mooncake_server.wire.jobs import TokenLogprob


def usage(gen: Generation) -> UsageInfo:
    """Token accounting of the request so far: the prompt once, every choice's output summed."""
    return UsageInfo.of(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)


class ResponseWriter:
    """Turns a Generation into bodies and chunks for one served model."""

    def __init__(self, model: str, formatter: LogprobFormatter) -> None:
        self.model = model
        self.fmt = formatter

    # ---- log-probabilities -------------------------------------------------------------------

    def _echoed(self, gen: Generation) -> list[TokenLogprob | None]:
        return list(gen.prompt_logprobs or []) if gen.echo_text is not None else []

    def _completion_logprobs(self, gen: Generation, choice: Choice,
                             entries: list[TokenLogprob | None]) -> CompletionLogprobs | None:
        if gen.logprobs_top is None:
            return None
        out = self.fmt.completion(entries, gen.prompt_token_ids[:1], choice.next_offset,
                                  gen.logprobs_top)
        if out.tokens:
            choice.next_offset = out.text_offset[-1] + len(out.tokens[-1])
        return out

    def _chat_logprobs(self, gen: Generation, entries: list[TokenLogprob]) -> ChatLogprobs | None:
        if gen.logprobs_top is None:
            return None
        return self.fmt.chat(entries, gen.logprobs_top)

    # ---- whole bodies ------------------------------------------------------------------------

    def full_response(self, gen: Generation,
                      chat: bool) -> ChatCompletionResponse | CompletionResponse:
        """The non-streamed body of a finished generation."""
        prompt_ids = gen.prompt_token_ids if gen.return_token_ids else None
        if chat:
            return ChatCompletionResponse(
                id=gen.request_id, created=gen.created, model=self.model,
                choices=[ChatCompletionChoice(
                    index=c.index, message=AssistantMessage(content=c.detok.text),
                    finish_reason=c.finish_reason, logprobs=self._chat_logprobs(gen, c.logprobs),
                    token_ids=c.token_ids if gen.return_token_ids else None,
                ) for c in gen.choices],
                usage=usage(gen), prompt_token_ids=prompt_ids,
            )
        return CompletionResponse(
            id=gen.request_id, created=gen.created, model=self.model,
            choices=[CompletionChoice(
                index=c.index, text=(gen.echo_text or "") + c.detok.text,
                finish_reason=c.finish_reason,
                logprobs=self._completion_logprobs(gen, c, [*self._echoed(gen), *c.logprobs]),
                token_ids=c.token_ids if gen.return_token_ids else None,
            ) for c in gen.choices],
            usage=usage(gen), prompt_token_ids=prompt_ids,
        )

    # ---- stream chunks -----------------------------------------------------------------------

    def echo_chunk(self, gen: Generation, choice: Choice, first: bool) -> str:
        """A streamed completion's echo: the prompt's text (and scores) before its output."""
        chunk = CompletionChunk(
            id=gen.request_id, created=gen.created, model=self.model,
            prompt_token_ids=gen.prompt_token_ids if first and gen.return_token_ids else None,
            choices=[CompletionChoice(
                index=choice.index, text=gen.echo_text or "",
                logprobs=self._completion_logprobs(gen, choice, self._echoed(gen)))])
        return f"data: {chunk.model_dump_json()}\n\n"

    def sse_chunk(self, gen: Generation, choice: Choice, chat: bool, text: str | None,
                  finish: str | None = None, first: bool = False) -> str:
        """One `data:` event carrying a choice's text delta (and its finish reason at the end).

        `first` marks the request's first chunk: with return_token_ids it carries the prompt
        ids; `role` marks a chat choice's first (its role). Tokens consumed since the choice's
        last chunk come with it (ids, log-probabilities).
        """
        chunk: ChatCompletionChunk | CompletionChunk
        prompt_ids = gen.prompt_token_ids if first and gen.return_token_ids else None
        ids = gen.take_new_ids(choice)
        entries = choice.take_new_logprobs()
        if chat:
            delta = DeltaMessage(role="assistant" if not choice.announced else None, content=text)
            choice.announced = True
            chunk = ChatCompletionChunk(
                id=gen.request_id, created=gen.created, model=self.model,
                prompt_token_ids=prompt_ids,
                choices=[ChatChunkChoice(index=choice.index, delta=delta, finish_reason=finish,
                                         token_ids=ids, logprobs=self._chat_logprobs(gen, entries)
                                         if entries else None)],
            )
        else:
            chunk = CompletionChunk(
                id=gen.request_id, created=gen.created, model=self.model,
                prompt_token_ids=prompt_ids,
                choices=[CompletionChoice(
                    index=choice.index, text=text or "", finish_reason=finish, token_ids=ids,
                    logprobs=self._completion_logprobs(gen, choice, list(entries))
                    if entries else None)],
            )
        return f"data: {chunk.model_dump_json()}\n\n"

    def sse_usage_chunk(self, gen: Generation, chat: bool) -> str:
        """The final `data:` event of stream_options.include_usage: no choices, only usage."""
        cls = ChatCompletionChunk if chat else CompletionChunk
        chunk = cls(id=gen.request_id, created=gen.created, model=self.model, choices=[],
                    usage=usage(gen))
        return f"data: {chunk.model_dump_json()}\n\n"
