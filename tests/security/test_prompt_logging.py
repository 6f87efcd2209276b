"""Prompts reach the logs only with --log-prompts (the cluster-wide check is in tests/fuzz)."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from security_helpers import MAX_MODEL_LEN, MODEL, EchoBackend

from mooncake_server.api.openai_app import install_api
from mooncake_server.cli import parse_config

MARKER = "ocelot-paperclip-9931"


async def logged_messages(tokenizer: Any, log_prompts: bool,
                          caplog: pytest.LogCaptureFixture) -> list[str]:
    app = FastAPI()
    install_api(app, EchoBackend(), tokenizer, MODEL, MAX_MODEL_LEN, CollectorRegistry(),
                log_prompts=log_prompts)
    transport = httpx.ASGITransport(app=app)
    with caplog.at_level(logging.DEBUG):
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            for path, body in (("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": MARKER}]}),
                               ("/v1/completions", {"prompt": MARKER, "max_tokens": 2})):
                assert (await http.post(path, json=body)).status_code == 200
    return [rec.getMessage() for rec in caplog.records]


async def test_prompts_are_not_logged_by_default(tokenizer: Any,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    assert not [m for m in await logged_messages(tokenizer, False, caplog) if MARKER in m]
    assert parse_config([], environ={}).log_prompts is False


async def test_log_prompts_logs_each_prompt(tokenizer: Any,
                                            caplog: pytest.LogCaptureFixture) -> None:
    hits = [m for m in await logged_messages(tokenizer, True, caplog) if MARKER in m]
    assert len(hits) == 2 and all("prompt" in m for m in hits)
    assert parse_config(["--log-prompts"], environ={}).log_prompts is True
