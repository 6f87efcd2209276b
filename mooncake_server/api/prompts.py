"""Turning API requests into prompt token ids, and the model's end-of-sequence ids."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from mooncake_server.api.errors import APIError
from mooncake_server.api.protocol import ChatMessage

log = logging.getLogger(__name__)


def load_eos_token_ids(model_path: str, tokenizer: Any) -> list[int]:
    """EOS ids of the tokenizer plus those of generation_config.json, if the model has one."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    try:
        from transformers import GenerationConfig

        gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's EOS is all there is
        gen_eos = None
    if isinstance(gen_eos, int):
        gen_eos = [gen_eos]
    for token_id in gen_eos or ():
        if int(token_id) not in ids:
            ids.append(int(token_id))
    return ids


def render_chat(tokenizer: Any, messages: Sequence[ChatMessage]) -> list[int]:
    """Apply the model's chat template (with the generation prompt) and return token ids.

    CPU-bound: call it through asyncio.to_thread.
    """
    conversation = [
        # NOTE: "developer" is OpenAI's newer name for "system"; templates only know "system".
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in messages
    ]
    try:
        out = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True
        )
    except TemplateError as exc:
        # Templates reject conversations they do not support (e.g. role order) by raising.
        raise APIError(f"chat template rejected the messages: {exc}", param="messages") from None
    except ValueError as exc:  # e.g. the tokenizer has no chat template
        raise APIError(f"cannot build the chat prompt: {exc}", param="messages") from None
    ids = out if isinstance(out, list) else out["input_ids"]
    return [int(i) for i in ids]


def encode_prompt(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """Token ids of a completions prompt; token-id prompts are range-checked.

    CPU-bound for long strings: call it through asyncio.to_thread.
    """
    if isinstance(prompt, str):
        return [int(i) for i in tokenizer(prompt)["input_ids"]]
    vocab = len(tokenizer)
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(
            f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", param="prompt"
        )
    return list(prompt)
