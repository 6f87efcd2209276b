"""Incremental detokenization: only complete characters leave, stop strings never leak."""

from __future__ import annotations

from typing import Any

from mooncake_server.api.detokenizer import IncrementalDetokenizer


def run(tokenizer: Any, text: str, stop: list[str]) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces = []
    for token in tokenizer(text)["input_ids"]:
        pieces.append(detok.add(token))
        if detok.stopped:
            break
    else:
        pieces.append(detok.finish())
    return pieces, detok


def test_multibyte_characters_are_never_split(tokenizer: Any) -> None:
    text = "naïve café 😀🎉 日本語 done"
    pieces, detok = run(tokenizer, text, [])
    assert "".join(pieces) == text == detok.text
    assert all("\ufffd" not in p for p in pieces)
    assert len([p for p in pieces if p]) > 3  # it really streamed


def test_stop_prefix_is_held_back_until_ruled_out(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, ["<END>"])
    out = ""
    for token in tokenizer("a <EN")["input_ids"]:
        out += detok.add(token)
    assert out == "a "  # "<EN" could still become "<END>"
    for token in tokenizer("D! b")["input_ids"]:
        out += detok.add(token)
    out += detok.finish()
    assert out == "a <END! b" and not detok.stopped


def test_stop_string_across_tokens_truncates(tokenizer: Any) -> None:
    pieces, detok = run(tokenizer, "Answer: 42\n\nQuestion: next", ["\n\nQuestion"])
    assert "".join(pieces) == "Answer: 42" == detok.text
    assert detok.stopped


def test_special_tokens_are_skipped(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    out = "".join(detok.add(t) for t in tokenizer("hi")["input_ids"] + [2]) + detok.finish()
    assert out == "hi"
