"""The cluster secret: every internal endpoint of every role refuses callers without it.

Audits the real role apps as the CLI builds them (`app_for_role`): each path the app serves is
called with no secret, a wrong one and a wrong Bearer token; only /health (and, on API roles, the
public API, which the API key guards) may answer. Then: the secret's sources (flag, env, file) and
`--role all` handing secrets to its children through the environment only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from mooncake_server.cli import check_can_start, main, parse_config
from mooncake_server.config import ServerConfig
from mooncake_server.roles import app_for_role
from mooncake_server.roles.all.supervisor import child_argv, child_env
from mooncake_server.wire.auth import SECRET_HEADER

SECRET = "the-cluster-secret"
INTERNAL_ROLES = ("prefill", "decode", "store")
# Public paths of the conductor: the API key guards these instead of the secret.
CONDUCTOR_PUBLIC = {"/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                    "/redoc"}
BAD_HEADERS = [{}, {SECRET_HEADER: "wrong"}, {SECRET_HEADER: ""},
               {"Authorization": "Bearer wrong"}, {SECRET_HEADER: SECRET[:-1]}]


def role_app(role: str, **extra: object) -> FastAPI:
    """A role's app as `mooncake-server --role ROLE` builds it (lifespan not started)."""
    config = ServerConfig(role=role, conductor_url="http://127.0.0.1:9", cluster_secret=SECRET,
                          **extra)  # type: ignore[arg-type]
    return app_for_role(config)


def served_paths(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every operation the app documents, plus its documentation pages."""
    ops = [(method.upper(), path) for path, item in app.openapi()["paths"].items()
           for method in item]
    return ops + [("GET", p) for p in ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")]


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


@pytest.mark.parametrize("role", ["conductor", *INTERNAL_ROLES])
async def test_every_internal_path_needs_the_secret(role: str) -> None:
    app = role_app(role)
    ops = served_paths(app)
    open_paths = CONDUCTOR_PUBLIC if role == "conductor" else {"/health"}
    guarded = [(m, p) for m, p in ops if p not in open_paths]
    assert len(guarded) >= 3, ops  # the audit really covers the role's endpoints
    async with client(app) as http:
        for method, path in guarded:
            for headers in BAD_HEADERS:
                r = await http.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (role, method, path, headers, r.text)
            # With the secret the guard lets the call through (whatever the route then says).
            r = await http.request(method, path, headers={SECRET_HEADER: SECRET}, json={})
            assert r.status_code != 401, (role, method, path)


@pytest.mark.parametrize("role", ["conductor", *INTERNAL_ROLES])
async def test_routes_guard_themselves_too(role: str) -> None:
    """Without app_for_role's default-deny layer, each internal route still checks the secret."""
    from importlib import import_module

    config = ServerConfig(role=role, conductor_url="http://127.0.0.1:9", cluster_secret=SECRET)
    app = import_module(f"mooncake_server.roles.{role}.app").build_app(config)
    internal = [(m, p) for m, p in served_paths(app)
                if p.startswith(("/internal/", "/store/"))]
    assert internal
    async with client(app) as http:
        for method, path in internal:
            r = await http.request(method, path, json={})
            assert r.status_code == 401, (role, method, path, r.text)


@pytest.mark.parametrize("role", INTERNAL_ROLES)
async def test_internal_metrics_need_the_secret(role: str) -> None:
    async with client(role_app(role)) as http:
        assert (await http.get("/metrics")).status_code == 401
        assert (await http.get("/metrics", headers={SECRET_HEADER: "x"})).status_code == 401
        for headers in ({SECRET_HEADER: SECRET}, {"Authorization": f"Bearer {SECRET}"}):
            r = await http.get("/metrics", headers=headers)
            assert r.status_code == 200, r.text


async def test_registration_without_the_secret_is_refused() -> None:
    """A process without the secret cannot join the conductor's registry."""
    app = role_app("conductor")
    info = {"instance_id": "intruder", "role": "decode", "url": "http://127.0.0.1:1"}
    async with client(app) as http:
        for headers in BAD_HEADERS:
            assert (await http.post("/internal/register", json=info,
                                    headers=headers)).status_code == 401
        assert app.state.registry.snapshot() == []
        ok = await http.post("/internal/register", json=info, headers={SECRET_HEADER: SECRET})
        assert ok.status_code == 200
        assert [s.info.instance_id for s in app.state.registry.snapshot()] == ["intruder"]


def test_secret_from_flag_env_or_file(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_text("from-file\n")
    assert parse_config(["--cluster-secret", "flag"], environ={}).cluster_secret == "flag"
    env = {"MOONCAKE_CLUSTER_SECRET": "env"}
    assert parse_config([], environ=env).cluster_secret == "env"
    assert parse_config(["--cluster-secret-file", str(f)], environ={}).cluster_secret == "from-file"
    # A flag beats the environment, whichever form each takes.
    assert parse_config(["--cluster-secret-file", str(f)], environ=env).cluster_secret == \
        "from-file"
    file_env = {"MOONCAKE_CLUSTER_SECRET_FILE": str(f)}
    assert parse_config([], environ=file_env).cluster_secret == "from-file"
    assert parse_config(["--cluster-secret", "flag"], environ=file_env).cluster_secret == "flag"
    yaml = tmp_path / "c.yaml"
    yaml.write_text(f"role: conductor\ncluster-secret-file: {f}\n")
    assert parse_config(["--config", str(yaml)], environ={}).cluster_secret == "from-file"


@pytest.mark.parametrize("argv,match", [
    (["--cluster-secret-file", "/nonexistent/secret"], "cannot read"),
    (["--cluster-secret", "a", "--cluster-secret-file", "/dev/null"], "not both"),
    (["--cluster-secret-file", "/dev/null"], "is empty"),
])
def test_bad_secret_sources_fail_clearly(argv: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=f"--cluster-secret-file: .*{match}"):
        parse_config(argv, environ={})


@pytest.mark.parametrize("role", ["conductor", *INTERNAL_ROLES])
def test_cluster_roles_refuse_to_start_without_a_secret(
        role: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for var in ("MOONCAKE_CLUSTER_SECRET", "MOONCAKE_CLUSTER_SECRET_FILE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as info:
        main(["--role", role, "--conductor-url", "http://127.0.0.1:9"])
    assert info.value.code == 2
    assert "--cluster-secret: required" in capsys.readouterr().err
    # colocated has no internal endpoints; all makes a random secret for its children
    check_can_start(ServerConfig(role="colocated"))
    check_can_start(ServerConfig(role="all"))


def test_all_hands_secrets_to_children_through_the_environment_only() -> None:
    config = ServerConfig(role="all", api_key="sk-parent-key", cluster_secret=SECRET,
                          max_tokens_limit=64, log_prompts=True)
    parent = {"PATH": "/bin", "MOONCAKE_CLUSTER_SECRET_FILE": "/x", "MOONCAKE_API_KEY": "other"}
    for role in ("conductor", "store", "prefill", "decode"):
        argv = child_argv(config, role, "/models/m")
        assert not any(SECRET in a or "sk-parent-key" in a for a in argv), argv
        env = child_env(config, role, SECRET, parent)
        assert env["MOONCAKE_CLUSTER_SECRET"] == SECRET
        assert "MOONCAKE_CLUSTER_SECRET_FILE" not in env and env["PATH"] == "/bin"
        # Only the conductor serves the public API, so only it learns the key.
        assert env.get("MOONCAKE_API_KEY") == ("sk-parent-key" if role == "conductor" else None)
    child = parse_config(child_argv(config, "conductor", "/models/m")[3:],
                         environ=child_env(config, "conductor", SECRET, parent))
    assert (child.api_key, child.cluster_secret) == ("sk-parent-key", SECRET)
    assert (child.max_tokens_limit, child.log_prompts) == (64, True)
    assert child_argv(config, "conductor", "m")[:3] == [sys.executable, "-m", "mooncake_server"]
