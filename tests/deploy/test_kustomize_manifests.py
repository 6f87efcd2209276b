"""deploy/kubernetes builds with `kubectl kustomize` into the workloads a cluster needs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE_DIR = ROOT / "deploy" / "kubernetes"
KUBECTL = shutil.which("kubectl")

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is missing "
                                "(Debian's kubernetes-client)")


def kustomize(tmp_path: Path, secret: str | None) -> subprocess.CompletedProcess[str]:
    """`kubectl kustomize` over a copy of deploy/kubernetes, with `secret` as the secret file."""
    work = tmp_path / "kubernetes"
    shutil.copytree(KUSTOMIZE_DIR, work, ignore=shutil.ignore_patterns("cluster-secret.txt"))
    if secret is not None:
        (work / "cluster-secret.txt").write_text(secret)
    assert KUBECTL
    return subprocess.run([KUBECTL, "kustomize", str(work)], capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.fixture(scope="module")
def objects(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict]:
    """The built manifests by (kind, name)."""
    res = kustomize(tmp_path_factory.mktemp("k"), "s3cret-for-test")
    assert res.returncode == 0, res.stderr
    docs = [d for d in yaml.safe_load_all(res.stdout) if d]
    return {(d["kind"], d["metadata"]["name"].rsplit("-", 1)[0] if d["kind"] == "Secret"
             else d["metadata"]["name"]): d for d in docs}


def containers(workload: dict) -> list[dict]:
    """The main containers of a Deployment / StatefulSet."""
    return workload["spec"]["template"]["spec"]["containers"]


def test_every_role_is_its_own_workload_in_one_namespace(objects) -> None:
    roles = {"conductor": "Deployment", "store": "StatefulSet", "prefill": "Deployment",
             "decode": "Deployment"}
    for name, kind in roles.items():
        workload = objects[(kind, name)]
        assert workload["metadata"]["namespace"] == "mooncake"
        args = containers(workload)[0]["args"]
        assert args[args.index("--role") + 1] == name
    assert objects[("Deployment", "prefill")]["spec"]["replicas"] == 2
    assert objects[("Deployment", "decode")]["spec"]["replicas"] == 2


def test_secret_reaches_every_role_and_only_through_the_generated_secret(objects) -> None:
    secret = objects[("Secret", "mooncake-cluster-secret")]
    name = secret["metadata"]["name"]  # kustomize appends a content hash
    for kind, role in (("Deployment", "conductor"), ("StatefulSet", "store"),
                       ("Deployment", "prefill"), ("Deployment", "decode")):
        env = {e["name"]: e for e in containers(objects[(kind, role)])[0]["env"]}
        ref = env["MOONCAKE_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": name, "key": "cluster-secret"}, role
        assert all("value" not in e for e in env.values()), "no secret inline"


def test_build_refuses_without_a_secret_file(tmp_path: Path) -> None:
    res = kustomize(tmp_path, None)
    assert res.returncode != 0
    assert "cluster-secret.txt" in res.stderr


def test_readiness_from_health_and_resource_requests(objects) -> None:
    for kind, role in (("Deployment", "conductor"), ("StatefulSet", "store"),
                       ("Deployment", "prefill"), ("Deployment", "decode")):
        c = containers(objects[(kind, role)])[0]
        probe = c["readinessProbe"]["httpGet"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert probe["path"] == "/health" and probe["port"] in ports, role
        args = c["args"]
        assert ports[probe["port"]] == int(args[args.index("--port") + 1]), role
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), role


def test_two_conductors_and_every_instance_find_each_other_through_etcd(objects) -> None:
    # Instances reach every conductor through etcd (they do not need its Service, which lists
    # a conductor only once its /health is green); clients use that Service.
    assert objects[("Deployment", "conductor")]["spec"]["replicas"] == 2
    assert "publishNotReadyAddresses" not in objects[("Service", "conductor")]["spec"]
    for kind, role in (("Deployment", "conductor"), ("StatefulSet", "store"),
                       ("Deployment", "prefill"), ("Deployment", "decode")):
        args = containers(objects[(kind, role)])[0]["args"]
        assert args[args.index("--etcd") + 1] == "http://etcd:2379", role
        assert "--conductor-url" not in args, role
    etcd, etcd_svc = objects[("StatefulSet", "etcd")], objects[("Service", "etcd")]["spec"]
    assert etcd_svc["clusterIP"] == "None" and etcd["spec"]["serviceName"] == "etcd"
    assert containers(etcd)[0]["image"].startswith("quay.io/coreos/etcd:")
    store_svc = objects[("Service", "store")]["spec"]
    store = objects[("StatefulSet", "store")]
    assert store_svc["clusterIP"] == "None" and store["spec"]["serviceName"] == "store"
