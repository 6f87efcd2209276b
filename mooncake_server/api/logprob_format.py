"""Log-probability entries (token ids) rendered in OpenAI's two response shapes.

Tokens are shown as the tokenizer decodes each one alone (special tokens included), as vLLM
does; a byte-level token that is part of a multi-byte character decodes to U+FFFD.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from mooncake_server.api.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)
from mooncake_server.wire.jobs import TokenLogprob


class LogprobFormatter:
    """Renders TokenLogprob entries for one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.token_text = lru_cache(maxsize=65536)(self._decode_one)

    def _decode_one(self, token_id: int) -> str:
        return str(self._tokenizer.decode([token_id]))

    def completion(self, entries: Sequence[TokenLogprob | None], first_ids: Sequence[int] = (),
                   offset: int = 0, top: int = 0) -> CompletionLogprobs:
        """The legacy shape; `first_ids` name the tokens of the leading None entries (the
        unscored first prompt token); `offset` = where the first token starts in the text.

        As vLLM, each `top_logprobs` dict holds the `top` likeliest tokens and the chosen one.
        """
        out = CompletionLogprobs()
        unscored = iter(first_ids)
        for entry in entries:
            token_id = next(unscored) if entry is None else entry.token_id
            text = self.token_text(token_id)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(entry.logprob)
            alternatives = {self.token_text(t): lp for t, lp in entry.top[:top]}
            alternatives.setdefault(text, entry.logprob)
            out.top_logprobs.append(alternatives)
        return out

    def chat(self, entries: Sequence[TokenLogprob], top: int = 0) -> ChatLogprobs:
        """The chat shape: one content entry per output token, `top` alternatives each."""
        return ChatLogprobs(content=[
            ChatTokenLogprob(**self._top(e.token_id, e.logprob).model_dump(),
                             top_logprobs=[self._top(t, lp) for t, lp in e.top[:top]])
            for e in entries])

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))
