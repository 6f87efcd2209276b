"""--api-key: the public API and /metrics need `Authorization: Bearer KEY`; /health stays open."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from security_helpers import MAX_MODEL_LEN, MODEL, EchoBackend

from mooncake_server.api.openai_app import install_api
from mooncake_server.cli import parse_config
from mooncake_server.config import ServerConfig
from mooncake_server.roles import app_for_role
from mooncake_server.wire.auth import SECRET_HEADER
from mooncake_testkit.in_process import serve_app

KEY = "sk-test-key-123"
SECRET = "cluster-secret-xyz"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def api_app(tokenizer: Any, api_key: str = KEY, secret: str = SECRET) -> FastAPI:
    """The OpenAI API over a scripted backend, with /health and /metrics like the roles have."""
    from mooncake_server.wire.auth import metrics_response

    app = FastAPI()
    registry = CollectorRegistry()
    install_api(app, EchoBackend(), tokenizer, MODEL, MAX_MODEL_LEN, registry,
                api_key=api_key, secret=secret)
    app.add_api_route("/health", lambda: {"status": "ok"})
    app.add_api_route("/metrics", lambda: metrics_response(registry))
    return app


def client(app: FastAPI, **headers: str) -> httpx.AsyncClient:
    """An in-process client of `app`."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                             headers=headers)


def assert_invalid_api_key(r: httpx.Response) -> None:
    """401 with the body OpenAI sends for a bad or missing key."""
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key"
    assert err["type"] == "invalid_request_error"
    assert KEY not in err["message"]


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
    {"Authorization": f"Basic {KEY}"}, {"X-Api-Key": KEY}, {"Authorization": "Bearer "},
    {"Authorization": f"Bearer {KEY}x"}, {SECRET_HEADER: SECRET},
], ids=["none", "wrong", "no-scheme", "basic", "other-header", "empty", "longer", "secret"])
async def test_public_api_refuses_requests_without_the_key(tokenizer: Any,
                                                          headers: dict[str, str]) -> None:
    async with client(api_app(tokenizer), **headers) as http:
        assert_invalid_api_key(await http.post("/v1/chat/completions", json=CHAT))
        assert_invalid_api_key(await http.post("/v1/completions", json={"prompt": "x"}))
        assert_invalid_api_key(await http.get("/v1/models"))
        assert_invalid_api_key(await http.get("/v1/unknown"))


async def test_right_key_is_served_and_health_stays_open(tokenizer: Any) -> None:
    async with client(api_app(tokenizer), Authorization=f"bearer {KEY}") as http:
        r = await http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        assert (await http.get("/v1/models")).json()["data"][0]["id"] == MODEL
    async with client(api_app(tokenizer)) as http:
        assert (await http.get("/health")).status_code == 200


async def test_metrics_need_the_key_or_the_cluster_secret(tokenizer: Any) -> None:
    app = api_app(tokenizer)
    async with client(app) as http:
        assert_invalid_api_key(await http.get("/metrics"))
        assert_invalid_api_key(await http.get("/metrics", headers={SECRET_HEADER: "nope"}))
        for headers in ({"Authorization": f"Bearer {KEY}"}, {SECRET_HEADER: SECRET},
                        {"Authorization": f"Bearer {SECRET}"}):
            r = await http.get("/metrics", headers=headers)
            assert r.status_code == 200 and "mooncake_api_requests" in r.text


async def test_unset_cluster_secret_does_not_open_metrics(tokenizer: Any) -> None:
    async with client(api_app(tokenizer, secret="")) as http:
        assert_invalid_api_key(await http.get("/metrics", headers={SECRET_HEADER: ""}))
        assert_invalid_api_key(await http.get("/metrics"))


async def test_without_a_key_the_api_is_open(tokenizer: Any) -> None:
    async with client(api_app(tokenizer, api_key="")) as http:
        assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await http.get("/metrics")).status_code == 200


async def test_official_client_sees_authentication_error(tokenizer: Any) -> None:
    async with serve_app(api_app(tokenizer)) as url:
        bad = openai.AsyncOpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            await bad.chat.completions.create(model=MODEL, messages=CHAT["messages"],
                                              max_tokens=2)
        assert info.value.code == "invalid_api_key"
        good = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        out = await good.chat.completions.create(model=MODEL, messages=CHAT["messages"],
                                                 max_tokens=2)
        assert out.choices[0].finish_reason == "stop"


async def test_conductor_requires_the_key_on_its_api(tokenizer: Any) -> None:
    """The real conductor app (as the CLI builds it): API key on /v1, /health open."""
    app = app_for_role(ServerConfig(role="conductor", api_key=KEY, cluster_secret=SECRET))
    async with app.router.lifespan_context(app):
        async with client(app) as http:
            assert_invalid_api_key(await http.get("/v1/models"))
            assert_invalid_api_key(await http.post("/v1/chat/completions", json=CHAT))
            assert_invalid_api_key(await http.get("/metrics"))
            assert (await http.get("/health")).status_code == 503  # open, no instances yet
            ok = await http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            assert ok.status_code == 200
            assert (await http.get("/metrics", headers={SECRET_HEADER: SECRET})).status_code == 200


def test_key_comes_from_flag_or_environment() -> None:
    assert parse_config(["--api-key", "k1"], environ={}).api_key == "k1"
    assert parse_config([], environ={"MOONCAKE_API_KEY": "k2"}).api_key == "k2"
    assert parse_config(["--api-key", "k1"], environ={"MOONCAKE_API_KEY": "k2"}).api_key == "k1"
    config = parse_config(["--api-key", "k1", "--cluster-secret", "s1"], environ={})
    assert "k1" not in repr(config) and "s1" not in repr(config)
    with pytest.raises(ValueError, match="--api-key"):
        parse_config(["--api-key", "has space"], environ={})
