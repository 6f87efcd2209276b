"""Fixtures for the OpenAI API tests: the real tokenizer, a fake Backend, a live server."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from api_helpers import MAX_MODEL_LEN, MODEL, FakeBackend, wait_for
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from mooncake_server.api.openai_app import install_api
from mooncake_testkit.in_process import serve_app


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The default model's real tokenizer."""
    from transformers import AutoTokenizer

    from mooncake_server.model_assets import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None))


@pytest.fixture
def backend() -> FakeBackend:
    """A fresh fake backend per test."""
    return FakeBackend()


@pytest.fixture
def metrics_registry() -> CollectorRegistry:
    """A private metrics registry per test."""
    return CollectorRegistry()


@pytest.fixture
def app(backend: FakeBackend, tokenizer: Any, metrics_registry: CollectorRegistry) -> FastAPI:
    """The API over the fake backend."""
    app = FastAPI()
    install_api(app, backend, tokenizer, MODEL, MAX_MODEL_LEN, metrics_registry)
    return app


@pytest.fixture(name="serve")
def serve_fixture() -> Callable[[Any], contextlib.AbstractAsyncContextManager[str]]:
    """`async with serve(app) as url:` runs an app live for a test."""
    return serve_app


@pytest.fixture(name="wait_for")
def wait_for_fixture() -> Callable[..., Any]:
    """`await wait_for(predicate)` polls with a deadline."""
    return wait_for


@pytest.fixture
async def base_url(app: FastAPI) -> AsyncIterator[str]:
    """The API served live on 127.0.0.1."""
    async with serve_app(app) as url:
        yield url
