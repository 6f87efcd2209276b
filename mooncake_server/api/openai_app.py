"""The OpenAI-compatible HTTP API over any `Backend`.

A request walks: parse + validate -> tokenize (worker thread) -> length check -> backend.generate
-> wait for the first token (racing a client disconnect; failures here are plain HTTP errors) ->
JSON body, or SSE chunks ending in `data: [DONE]`. With n > 1 the backend computes the prompt
once and streams every choice's tokens (each chunk names its choice by `index`). Whatever ends
it (EOS, length, stop string, client gone, backend failure), the backend iterator is closed so
the request's resources go.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry

from mooncake_server.api.backend import Backend, BackendError, GenerateRequest
from mooncake_server.api.detokenizer import IncrementalDetokenizer
from mooncake_server.api.errors import (
    APIError,
    install_error_handlers,
    is_expected,
    parse_body,
    sse_error_event,
    to_api_error,
)
from mooncake_server.api.generation import Choice, Generation
from mooncake_server.api.limits import RequestLimits
from mooncake_server.api.logprob_format import LogprobFormatter
from mooncake_server.api.metrics import ApiMetrics
from mooncake_server.api.prompts import encode_prompt, render_chat
from mooncake_server.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from mooncake_server.api.responses import ResponseWriter
from mooncake_server.api.schema import completion_openapi
from mooncake_server.api.security import ApiGuard
from mooncake_server.wire.jobs import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")

_DONE = "data: [DONE]\n\n"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(APIError):
    """The client disconnected before the response started (nginx's 499)."""

    def __init__(self) -> None:
        super().__init__("client closed the request", 499)


class _ClosingStreamingResponse(StreamingResponse):
    """A streaming response that closes its Generation even if the body never started."""

    def __init__(self, content: AsyncIterator[str], gen: Generation, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._gen = gen

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Send the stream; afterwards make sure the backend request is released."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._gen.close()
            self._gen.report(499)  # no-op unless the body generator never ran


async def _until_disconnect(request: Request) -> None:
    # NOTE: the body was already read, so the server's next message is http.disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(work: Awaitable[T], request: Request) -> T:
    """Await `work`, cancelling it and raising ClientGone if the client leaves first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


class OpenAIService:
    """Request handling behind the routes; one per served model."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: Any,
        model_name: str,
        max_model_len: int,
        metrics: ApiMetrics,
        eos_token_ids: Sequence[int],
        limits: RequestLimits | None = None,
        log_prompts: bool = False,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.eos_token_ids = list(eos_token_ids)
        self.limits = limits or RequestLimits()
        self.log_prompts = log_prompts
        self.writer = ResponseWriter(model_name, LogprobFormatter(tokenizer))

    def models(self) -> ModelList:
        """GET /v1/models."""
        return ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.max_model_len)])

    async def chat(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        return await self._serve("chat", request, chat=True)

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        return await self._serve("completions", request, chat=False)

    async def _serve(self, endpoint: str, request: Request, chat: bool) -> Response:
        arrival = time.perf_counter()
        try:
            model_cls = ChatCompletionRequest if chat else CompletionRequest
            body = parse_body(await request.body(), model_cls)
            gen = await self._start(endpoint, body, arrival, request)
        except Exception as exc:
            self._log_unexpected(endpoint, exc)
            self.metrics.count(endpoint, to_api_error(exc).status)
            raise to_api_error(exc) from None
        if body.stream:
            sse = self._sse(gen, body.include_usage, chat)
            return _ClosingStreamingResponse(
                sse, gen, media_type="text/event-stream", headers=_SSE_HEADERS
            )
        try:
            await _unless_disconnected(self._drain(gen), request)
        except Exception as exc:
            self._log_unexpected(endpoint, exc)
            gen.report(to_api_error(exc).status)
            raise to_api_error(exc) from None
        finally:
            await gen.close()
        gen.report(200)
        return JSONResponse(self.writer.full_response(gen, chat).model_dump(mode="json"))

    @staticmethod
    def _log_unexpected(endpoint: str, exc: BaseException) -> None:
        if not is_expected(exc):
            log.error("unhandled error in %s request", endpoint, exc_info=exc)

    async def _start(
        self, endpoint: str, body: ChatCompletionRequest | CompletionRequest, arrival: float,
        request: Request,
    ) -> Generation:
        """Validate, tokenize, submit; return once the first token arrived."""
        if body.model is not None and body.model != self.model_name:
            raise APIError(
                f"The model `{body.model}` does not exist; this server serves `{self.model_name}`",
                404, param="model", code="model_not_found", err_type="invalid_request_error",
            )
        self.limits.check_request(body)
        if isinstance(body, ChatCompletionRequest):
            prompt_ids = await asyncio.to_thread(render_chat, self.tokenizer, body.messages)
            what = "messages"
        else:
            prompt_ids = await asyncio.to_thread(encode_prompt, self.tokenizer, body.prompt)
            what = "prompt"
        self.limits.check_prompt(len(prompt_ids), what)
        max_tokens = self._max_tokens(len(prompt_ids), body.requested_max_tokens(), what)
        self._check_logit_rules(body, max_tokens)
        top = body.logprobs_top()
        echo = isinstance(body, CompletionRequest) and body.echo
        sampling = SamplingParams(
            # NOTE: max_tokens 0 (echo) still runs the prompt through the model, which then
            # samples one token; its scores are the point, the token is dropped (generation.py).
            max_tokens=max(1, max_tokens),
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            eos_token_ids=self.eos_token_ids,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            logit_bias=body.logit_bias or {},
            min_tokens=body.min_tokens,
            logprobs=top,
            prompt_logprobs=top if echo else None,
            n=body.n or 1,
        )
        request_id = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        if self.log_prompts:  # NOTE: opt-in only (--log-prompts): prompts are user data
            log.info("request %s prompt (%d tokens): %r", request_id, len(prompt_ids),
                     self.tokenizer.decode(prompt_ids))
        events = self.backend.generate(GenerateRequest(request_id, prompt_ids, sampling))
        echo_text = None
        if echo:
            assert isinstance(body, CompletionRequest)
            echo_text = body.prompt if isinstance(body.prompt, str) else await asyncio.to_thread(
                self.tokenizer.decode, prompt_ids)
        gen = Generation(
            request_id=request_id,
            endpoint=endpoint,
            prompt_tokens=len(prompt_ids),
            max_tokens=max_tokens,
            events=events,
            choices=[Choice(i, IncrementalDetokenizer(self.tokenizer, body.stop_list(),
                                                      body.min_tokens))
                     for i in range(sampling.n)],
            metrics=self.metrics,
            arrival=arrival,
            prompt_token_ids=prompt_ids,
            return_token_ids=body.return_token_ids,
            echo_text=echo_text,
            logprobs_top=top,
        )
        try:
            gen.pending = await _unless_disconnected(anext(events), request)
            gen.prompt_logprobs = gen.pending.prompt_logprobs
        except StopAsyncIteration:
            await gen.close()
            raise BackendError("the backend ended the request without a token", 502) from None
        except BaseException:
            await gen.close()
            raise
        return gen

    def _check_logit_rules(self, body: ChatCompletionRequest | CompletionRequest,
                           max_tokens: int) -> None:
        """The checks that need the tokenizer or the final max_tokens (400 otherwise)."""
        vocab = len(self.tokenizer)
        unknown = sorted(t for t in body.logit_bias or {} if t >= vocab)
        if unknown:
            raise APIError(
                f"logit_bias: token id {unknown[0]} is not in the vocabulary (ids are 0 to "
                f"{vocab - 1})", param="logit_bias", code="invalid_value")
        if body.min_tokens > max_tokens:
            raise APIError(
                f"min_tokens ({body.min_tokens}) must be at most max_tokens ({max_tokens})",
                param="min_tokens", code="invalid_value")

    def _max_tokens(self, prompt_tokens: int, requested: int | None, what: str) -> int:
        limit = self.max_model_len
        if requested is None:
            if prompt_tokens >= limit:
                raise APIError(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"{what} resulted in {prompt_tokens} tokens, which leaves no room for the "
                    f"completion. Please reduce the length of the {what}.",
                    param=what, code="context_length_exceeded",
                )
            # as vLLM: fill the context (up to --max-tokens-limit)
            return self.limits.default_max_tokens(limit - prompt_tokens)
        if prompt_tokens + requested > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_tokens + requested} tokens ({prompt_tokens} in the {what}, "
                f"{requested} in the completion). Please reduce the length of the {what} "
                "or the completion.",
                param=what, code="context_length_exceeded",
            )
        return requested

    @staticmethod
    async def _drain(gen: Generation) -> None:
        while not gen.finished:
            await gen.advance()

    async def _sse(self, gen: Generation, include_usage: bool, chat: bool) -> AsyncIterator[str]:
        """The SSE body; errors after the first byte become an error event, then [DONE]."""
        status: int | str = 200
        first = True
        writer = self.writer
        try:
            for choice in gen.choices:
                if chat:  # each choice's role comes first, before any content
                    yield writer.sse_chunk(gen, choice, chat, "", first=first)
                    first = False
                elif gen.echo_text is not None:  # the prompt, then what follows it
                    yield writer.echo_chunk(gen, choice, first)
                    first = False
            while not gen.finished:
                choice, text = await gen.advance()
                if choice.ended:
                    continue
                if choice.finish_reason is not None:
                    choice.ended = True
                    yield writer.sse_chunk(gen, choice, chat, text or None, choice.finish_reason,
                                           first=first)
                    first = False
                elif text:
                    yield writer.sse_chunk(gen, choice, chat, text, first=first)
                    first = False
            if include_usage:
                yield writer.sse_usage_chunk(gen, chat)
        except Exception as exc:
            status = "stream_error"
            if not is_expected(exc):
                log.error("request %s failed mid-stream", gen.request_id, exc_info=exc)
            else:
                log.warning("request %s failed mid-stream: %s", gen.request_id, exc)
            yield sse_error_event(exc)
        except BaseException:  # cancelled: the client went away
            status = 499
            raise
        finally:
            await gen.close()
            gen.report(status)
        yield _DONE


def create_api_router(
    backend: Backend,
    tokenizer: Any,
    model_name: str,
    max_model_len: int,
    registry: CollectorRegistry,
    *,
    eos_token_ids: Sequence[int] | None = None,
    metrics: ApiMetrics | None = None,
    limits: RequestLimits | None = None,
    log_prompts: bool = False,
) -> APIRouter:
    """Routes of the OpenAI API; pair with `install_error_handlers(app)` (or use install_api).

    `eos_token_ids` default to the tokenizer's EOS; pass `load_eos_token_ids(...)` to include
    the generation config's. `metrics` (made from `registry` when None) lets routers built
    again for the same registry share one set of metrics. `limits` default to RequestLimits();
    the body-size limit and the API key live in `install_api_guard`.
    """
    if eos_token_ids is None:
        eos = tokenizer.eos_token_id
        eos_token_ids = [] if eos is None else [int(eos)]
    service = OpenAIService(
        backend, tokenizer, model_name, max_model_len, metrics or ApiMetrics(registry),
        eos_token_ids, limits, log_prompts,
    )
    router = APIRouter()
    router.add_api_route("/v1/models", service.models, methods=["GET"], response_model=ModelList)
    router.add_api_route("/v1/chat/completions", service.chat, methods=["POST"],
                         openapi_extra=completion_openapi(ChatCompletionRequest))
    router.add_api_route("/v1/completions", service.completions, methods=["POST"],
                         openapi_extra=completion_openapi(CompletionRequest))
    return router


def install_api_guard(app: FastAPI, *, api_key: str = "", secret: str = "",
                      max_body_bytes: int = RequestLimits.max_body_bytes) -> None:
    """Put the API key check and the body-size limit in front of `app` (before it starts)."""
    app.add_middleware(ApiGuard, api_key=api_key, secret=secret, max_body_bytes=max_body_bytes)


def install_api(
    app: FastAPI,
    backend: Backend,
    tokenizer: Any,
    model_name: str,
    max_model_len: int,
    registry: CollectorRegistry,
    *,
    eos_token_ids: Sequence[int] | None = None,
    limits: RequestLimits | None = None,
    api_key: str = "",
    secret: str = "",
    log_prompts: bool = False,
) -> None:
    """Add the OpenAI routes, error handlers and API guard to `app` (before it starts)."""
    limits = limits or RequestLimits()
    install_error_handlers(app)
    install_api_guard(app, api_key=api_key, secret=secret, max_body_bytes=limits.max_body_bytes)
    app.include_router(
        create_api_router(
            backend, tokenizer, model_name, max_model_len, registry, eos_token_ids=eos_token_ids,
            limits=limits, log_prompts=log_prompts,
        )
    )
