"""Incremental detokenization with stop strings.

Tokens arrive one by one; text may only leave when it is final:
- a token can end in the middle of a UTF-8 character (byte-level BPE), which decodes to U+FFFD
  until the next token completes it, so such text is held back;
- the text's tail may be the beginning of a stop string, so it is held back until the stop
  string is ruled out (or matched, then the text is cut before it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a token stream into safe-to-emit text deltas, honouring stop strings."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        # As vLLM: a stop string counts only if it ends in the text of token min_tokens or later,
        # i.e. after _stop_floor characters (the text there was before).
        self._min_tokens = min_tokens
        self._stop_floor = 0
        self._ids: list[int] = []
        # Decoding restarts at _prefix (a few tokens of context so word-initial spaces decode
        # as in the full text); _read marks the tokens whose text is already in self._text.
        self._prefix = 0
        self._read = 0
        self._text = ""  # all decoded text, stop-truncated once stopped
        self._emitted = 0  # how much of self._text has left
        self.stopped = False  # a stop string matched

    @property
    def text(self) -> str:
        """All text so far (cut before the stop string once one matched)."""
        return self._text

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def add(self, token_id: int) -> str:
        """Feed one token; return the text that can be emitted now (maybe empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(_REPLACEMENT):
            return ""  # an incomplete character or a token that renders as nothing yet
        searched_from = max(0, len(self._text) - self._longest_stop() + 1)
        self._text += after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._check_stop(searched_from)
        return self._take(final=self.stopped)

    def finish(self) -> str:
        """The generation ended: release the held-back text (never a dangling U+FFFD)."""
        if not self.stopped:
            pending = self._decode(self._ids[self._prefix :])
            done = self._decode(self._ids[self._prefix : self._read])
            tail = pending[len(done) :].rstrip(_REPLACEMENT) if len(pending) > len(done) else ""
            if tail:
                searched_from = max(0, len(self._text) - self._longest_stop() + 1)
                self._text += tail
                self._read = len(self._ids)
                self._check_stop(searched_from)
        return self._take(final=True)

    def _longest_stop(self) -> int:
        return max((len(s) for s in self._stop), default=1)

    def _check_stop(self, start: int) -> None:
        if len(self._ids) < self._min_tokens:
            self._stop_floor = len(self._text)
            return
        floor = self._stop_floor
        hits = [i for i in (self._text.find(s, max(start, floor - len(s) + 1)) for s in self._stop)
                if i >= 0]
        if hits:
            self._text = self._text[: min(hits)]
            self.stopped = True

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self._text)), best, -1):
                if self._text.endswith(stop[:n]):
                    best = n
                    break
        return best

    def _take(self, final: bool) -> str:
        end = len(self._text) if final else len(self._text) - self._held_back()
        if end <= self._emitted:
            return ""
        out = self._text[self._emitted : end]
        self._emitted = end
        return out
