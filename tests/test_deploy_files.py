"""The shipped deployment files are valid: docker-compose demo and the YAML role configs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from mooncake_server.cli import parse_config

ROOT = Path(__file__).resolve().parents[1]


def compose_config(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`docker-compose config` (validates without a Docker daemon)."""
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is missing: scripts/setup.sh --test installs it"
    return subprocess.run([exe, "-f", str(ROOT / "docker-compose.yml"), "config"], env=env,
                          capture_output=True, text=True, timeout=60)


def test_compose_demo_validates_with_all_roles() -> None:
    res = compose_config({**os.environ, "MOONCAKE_CLUSTER_SECRET": "test-secret"})
    assert res.returncode == 0, res.stderr
    services = yaml.safe_load(res.stdout)["services"]
    roles = [s["command"][1] for s in role_services(services).values()]
    assert sorted(roles) == ["conductor", "conductor", "decode", "decode", "prefill", "prefill",
                             "store"]
    # Every role finds the others through etcd, which the roles wait for.
    assert all("--etcd" in s["command"] for s in role_services(services).values())
    assert "--conductor-url" not in str(services)
    assert "etcd" in services and "healthcheck" in services["etcd"]


def role_services(services: dict[str, dict]) -> dict[str, dict]:
    """The compose services that run a mooncake-server role (not model-init, not Prometheus)."""
    return {name: s for name, s in services.items() if "--role" in s.get("command", [])}


def test_prometheus_scrapes_every_role_with_the_secret_where_needed() -> None:
    res = compose_config({**os.environ, "MOONCAKE_CLUSTER_SECRET": "test-secret"})
    assert res.returncode == 0, res.stderr
    services = yaml.safe_load(res.stdout)["services"]
    expected = {f"{name}:{s['command'][s['command'].index('--port') + 1]}"
                for name, s in role_services(services).items()}
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    scraped: set[str] = set()
    for job in prom["scrape_configs"]:
        targets = {t for sc in job["static_configs"] for t in sc["targets"]}
        scraped |= targets
        # Instances' /metrics need the cluster secret; the conductor's is public.
        assert ("authorization" in job) == (job["job_name"] != "conductor"), job["job_name"]
    assert scraped == expected
    # Compose v1 prints "src:dst:ro", v2 a mapping.
    mounts = {m["target"] if isinstance(m, dict) else m.split(":")[1]
              for m in services["prometheus"]["volumes"]}
    assert "/etc/prometheus/mooncake.yml" in mounts


def test_compose_refuses_to_start_without_a_cluster_secret() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MOONCAKE_CLUSTER_SECRET"}
    res = compose_config(env)
    assert res.returncode != 0
    assert "MOONCAKE_CLUSTER_SECRET" in res.stderr


@pytest.mark.parametrize("name", ["all-in-one", "conductor", "store", "prefill", "decode"])
def test_role_configs_parse(name: str) -> None:
    cfg = parse_config(["--config", str(ROOT / "configs" / f"{name}.yaml")], environ={})
    assert cfg.role == ("all" if name == "all-in-one" else name)


def test_flags_override_yaml_and_bad_values_name_the_flag() -> None:
    cfg = parse_config(["--config", str(ROOT / "configs" / "prefill.yaml"), "--port", "9100"],
                       environ={})
    assert cfg.port == 9100 and cfg.kv_memory_bytes == 1 << 30
    with pytest.raises(ValueError, match="--block-tokens"):
        parse_config(["--role", "colocated", "--block-tokens", "0"], environ={})
    with pytest.raises(ValueError, match="--memory"):
        parse_config(["--role", "store", "--conductor-url", "http://x", "--memory", "lots"],
                     environ={})
