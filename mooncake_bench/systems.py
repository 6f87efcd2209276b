"""Starting and stopping the systems a benchmark compares: mooncake-server configurations
(`colocated`, `all`, or `PpDd[:policy]` = P prefill + D decode instances + a store + a
conductor with that placement policy) and `transformers serve`, each on free ports, each
stopped with its whole process tree (mooncake_testkit.role_procs) before the next one starts.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mooncake_bench.client import Api
from mooncake_testkit.role_procs import descendants, reap


@dataclass
class Launched:
    """A running configuration: its public URL and its prefill instances' URLs."""

    name: str
    url: str
    prefill_urls: list[str]
    secret: str
    pids: list[int] = field(default_factory=list)  # the processes started, to reap their trees


_SPEC = re.compile(r"^(\d+)p(\d+)d(?::([a-z-]+))?$")


def _wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], want: dict[str, int],
                  timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a server process exited during start-up")
        try:
            r = httpx.get(f"{url}/health", timeout=2)
            counts = r.json().get("instances", {}) if r.status_code == 200 else None
            if r.status_code == 200 and all((counts or {}).get(k, 0) >= v
                                            for k, v in want.items()):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy in {timeout_s:.0f} s")


@contextmanager
def launch(spec: str, server_args: list[str], conductor_args: list[str],
           log_dir: Path, prefill_args: Sequence[str] = (),
           decode_args: Sequence[str] = (), store_memory: str = "1GiB") -> Iterator[Launched]:
    """Start configuration `spec` on free ports; stop it on exit.

    `prefill_args` / `decode_args` go to those roles only (`all`: to every role; `colocated`:
    prefill_args, its engine prefills).
    """
    from mooncake_testkit.ports import free_port_block

    secret = secrets.token_hex(16)
    env = {**os.environ, "MOONCAKE_CLUSTER_SECRET": secret}
    py = [sys.executable, "-m", "mooncake_server"]
    common = ["--kv-memory", "512MiB", *server_args]
    m = _SPEC.match(spec)
    engines = int(m.group(1)) + int(m.group(2)) if m else 2 if spec == "all" else 1
    if spec not in ("colocated", "all") and not any(a.startswith("--torch-threads")
                                                    for a in server_args):
        # Roles started one by one share no core budget board (`all` makes one, colocated is
        # alone): each engine process gets a fixed share of the cores.
        common += ["--torch-threads", str(max(1, (os.cpu_count() or 1) // engines))]
    if spec in ("colocated", "all"):
        port = free_port_block(6)
        extra = [*prefill_args] if spec == "colocated" else [*conductor_args, *decode_args]
        argvs = [[*py, "--role", spec, "--port", str(port), "--memory", store_memory, *common,
                  *extra]]
        prefill_urls = [f"http://127.0.0.1:{port + 2}"] if spec == "all" else []
        want = {"prefill": 1, "decode": 1} if spec == "all" else {}
    elif m:
        n_p, n_d, policy = int(m.group(1)), int(m.group(2)), m.group(3)
        port = free_port_block(3 + n_p + n_d)
        conductor = f"http://127.0.0.1:{port}"
        argvs = [[*py, "--role", "conductor", "--port", str(port), *server_args,
                  *conductor_args, *(["--policy", policy] if policy else [])],
                 [*py, "--role", "store", "--port", str(port + 1), "--memory", store_memory,
                  "--conductor-url", conductor, *server_args]]
        prefill_urls = []
        for i in range(n_p + n_d):
            role = "prefill" if i < n_p else "decode"
            argvs.append([*py, "--role", role, "--port", str(port + 2 + i), "--conductor-url",
                          conductor, "--instance-id", f"{role}-{i}", *common,
                          *(prefill_args if role == "prefill" else decode_args)])
            if role == "prefill":
                prefill_urls.append(f"http://127.0.0.1:{port + 2 + i}")
        want = {"prefill": n_p, "decode": n_d, "store": 1}
    else:
        raise ValueError(f"--launch: unknown configuration {spec!r} "
                         "(colocated, all, or PpDd[:policy] such as 2p1d:load)")
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    with ExitStack() as logs:
        try:
            for i, argv in enumerate(argvs):
                log = logs.enter_context(open(log_dir / f"{spec.replace(':', '_')}-{i}.log", "wb"))
                procs.append(subprocess.Popen(argv, env=env, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, procs, want)
            yield Launched(spec, url, prefill_urls, secret, [p.pid for p in procs])
        finally:
            for p in reversed(procs):
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)  # graceful
            for p in procs:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def model_of(url: str, given: str | None) -> str:
    """The model name to send: `given`, else the first the server lists."""
    return given or str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


def log_tail(path: Path, lines: int = 15) -> str:
    """The last lines of a server log, for start-up errors."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    """Until /health answers 200 and /v1/models lists a model; a clear error otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during start-up; "
                               f"log {log}:\n{log_tail(log)}")
        try:
            if (httpx.get(f"{url}/health", timeout=2).status_code == 200
                    and httpx.get(f"{url}/v1/models", timeout=5).json().get("data")):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready (/health, /v1/models) within {timeout_s:.0f} s; "
                       f"log {log}:\n{log_tail(log)}")


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM the process's group, then SIGKILL whatever of its tree is left."""
    tree = descendants([proc.pid])
    # NOTE: SIGTERM, not Ctrl-C: after SIGINT transformers serve logs "Finished server
    # process" and then hangs on its continuous-batching thread; SIGTERM exits in seconds.
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    reap(tree)
    proc.wait()


def tfserve_binary() -> str:
    """The `transformers` CLI of this interpreter's environment."""
    here = Path(sys.executable).with_name("transformers")
    return str(here) if here.exists() else (shutil.which("transformers") or "transformers")


@contextmanager
def start_tfserve(model: str, extra: Sequence[str], log_dir: Path,
                  timeout_s: float) -> Iterator[Api]:
    """`transformers serve --continuous-batching` on a free port, offline; stopped on exit."""
    from mooncake_testkit.ports import free_port_block

    port = free_port_block(1)
    argv = [tfserve_binary(), "serve", "--continuous-batching", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", *extra, model]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / "tfserve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc, timeout_s, log)
        yield Api("tfserve", url, model_of(url, None))
    finally:
        stop_process(proc)


@contextmanager
def start_mooncake(spec: str, server_args: list[str], conductor_args: list[str],
                   log_dir: Path) -> Iterator[Api]:
    """replay_trace's launch of `--role spec`, then nothing left of its process tree."""
    tree: list[int] = []
    try:
        with ExitStack() as stack:
            try:
                cluster = stack.enter_context(launch(spec, server_args, conductor_args,
                                                        log_dir))
            except RuntimeError as exc:
                logs = sorted(log_dir.glob(f"{spec}-*.log"))
                raise RuntimeError(f"--role {spec}: {exc}; log {logs[0] if logs else log_dir}:"
                                   f"\n{log_tail(logs[0]) if logs else ''}") from None
            try:
                yield Api("mooncake", cluster.url, model_of(cluster.url, None))
            finally:
                # The supervisor's roles run in sessions of their own: its group is not theirs,
                # so they are found by parentage while it still lives.
                tree = descendants(cluster.pids)
    finally:
        reap(tree)


def load_avg() -> float:
    """The 1-minute load average (nan where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def launch_system(name: str, args: argparse.Namespace, log_dir: Path,
                  slo: bool) -> AbstractContextManager[Api]:
    """The context manager that starts system `name` (and stops it fully on exit)."""
    if name == "tfserve":
        return start_tfserve(args.model, shlex.split(args.tf_args), log_dir,
                             args.startup_timeout)
    own = args.all_args if name == "all" else args.colocated_args
    server_args = ["--model", args.model, *shlex.split(args.mooncake_args), *shlex.split(own)]
    conductor_args = ["--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo)] \
        if slo else []
    return start_mooncake(name, server_args, conductor_args, log_dir / (name + "-slo" * slo))
