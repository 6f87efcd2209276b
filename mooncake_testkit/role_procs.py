"""Roles started as OS processes (`python -m mooncake_server --role ROLE`), each killable,
stoppable and restartable on its own port and instance id (fault tests, store nodes, soak and
overload runs, `--role all` trees). Optionally inside a network namespace (`ip netns exec`),
listening on that namespace's address.

`RoleProc` is one such process; `RoleCluster` declares a conductor (or joins one already
running, such as a test's in-process store index) and any number of instances.
Apps served inside the test's own process: `in_process`.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from mooncake_server.wire.auth import SECRET_HEADER
from mooncake_testkit.ports import free_port_block

if TYPE_CHECKING:
    from typing_extensions import Self

STARTUP_TIMEOUT_S = 240.0
_POLL_S = 0.2
# NOTE: a name of its own: inside RoleProc, `signal` is the method.
_SIGTERM = signal.SIGTERM


@dataclass
class RoleProc:
    """One `python -m mooncake_server --role ROLE` process."""

    role: str
    name: str  # its instance id
    host: str
    port: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path | None = None  # its output; else none kept, unless `inherit_output`
    netns: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    inherit_output: bool = False  # write to this process's stdout/stderr (benchmarks)

    @property
    def url(self) -> str:
        """Its HTTP base URL."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        """Process id of the running role (raises if it is not running)."""
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} is not running")
        return self.proc.pid

    def start(self) -> RoleProc:
        """Spawn the process (again, after a kill or stop: same port, same instance id)."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is already running")
        argv = (["ip", "netns", "exec", self.netns] if self.netns else []) + self.argv
        out: Any = (open(self.log_path, "ab") if self.log_path  # noqa: SIM115
                    else None if self.inherit_output else subprocess.DEVNULL)
        try:
            # NOTE: its own session (process group == pid), so `kill` reaches its children too.
            self.proc = subprocess.Popen(argv, env=self.env, start_new_session=True, stdout=out,
                                         stderr=None if out is None else subprocess.STDOUT)
        finally:
            if self.log_path:
                out.close()
        return self

    def running(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        """True once the process answers /health with 200 (raises if it exited)."""
        if not self.running():
            code = self.proc.returncode if self.proc else None
            raise RuntimeError(f"{self.name} exited (code {code})")
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> RoleProc:
        """Wait until /health answers 200; raises if the process exits or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not become healthy in {timeout_s:.0f} s")
            time.sleep(_POLL_S)
        return self

    def signal(self, sig: int) -> None:
        """Send a signal (SIGKILL, SIGTERM, SIGSTOP, SIGCONT...)."""
        if self.running():
            os.kill(self.pid, sig)

    def wait(self, timeout_s: float = 30.0) -> int:
        """Wait for the process to exit; its exit code."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        """SIGKILL its process group (a supervisor's children too) and reap."""
        if self.running():
            self.signal(signal.SIGCONT)  # a stopped process must be able to die
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.wait()

    def stop(self, timeout_s: float = 30.0, sig: int = _SIGTERM) -> int | None:
        """`sig` (SIGTERM: a graceful drain), then `kill` after `timeout_s`; the exit code."""
        if not self.running():
            return self.proc.returncode if self.proc else None
        self.signal(signal.SIGCONT)
        self.signal(sig)
        try:
            return self.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode if self.proc else None

    def memory(self) -> dict[str, int]:
        """Resident memory now, bytes: `rss` in all, `anon` private (heap: where leaks show),
        `shmem` shared (the KV pool, resident as its pages are first used)."""
        fields = {"VmRSS:": "rss", "RssAnon:": "anon", "RssShmem:": "shmem"}
        out = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key = line.split(maxsplit=1)[0] if line else ""
            if key in fields:
                out[fields[key]] = int(line.split()[1]) * 1024
        return out


@dataclass
class RoleCluster:
    """A conductor and any number of store, prefill and decode instances, one process each."""

    log_dir: Path | None = None
    common: list[str] = field(default_factory=list)  # flags every role gets
    secret: str = field(default_factory=lambda: secrets.token_hex(16))
    procs: dict[str, RoleProc] = field(default_factory=dict)
    conductor_url: str = ""  # set by `add("conductor", ...)`, or given: join that conductor
    # With etcd: every role gets `--etcd`, instances find the conductors there (none is named
    # to them), and any number of conductors may be added.
    etcd_url: str = ""
    conductor_urls: list[str] = field(default_factory=list)  # every conductor added, in order

    @property
    def headers(self) -> dict[str, str]:
        """Headers internal endpoints accept."""
        return {SECRET_HEADER: self.secret}

    def add(self, role: str, name: str, *extra: str, host: str = "127.0.0.1",
            netns: str | None = None, port: int | None = None,
            advertise: str | None = None) -> RoleProc:
        """Declare one role process (the conductor first, unless one was given); start it with
        `start()`, or alone with `RoleProc.start`.

        It listens on `host` (inside `netns` if given); others reach it at `advertise` (else
        `host`).
        """
        if role != "conductor" and not self.conductor_url and not self.etcd_url:
            raise ValueError("add the conductor first")
        port = port or free_port_block(1)
        reach = advertise or host
        argv = [sys.executable, "-m", "mooncake_server", "--role", role, "--host", host,
                "--port", str(port), "--dtype", "float32", *self.common, *extra]
        if advertise:
            argv += ["--advertise-host", advertise]
        if self.etcd_url:
            argv += ["--etcd", self.etcd_url]
        if role == "conductor":
            self.conductor_urls.append(f"http://{reach}:{port}")
            self.conductor_url = self.conductor_url or self.conductor_urls[0]
        else:
            argv += ["--instance-id", name]
            if not self.etcd_url:
                argv += ["--conductor-url", self.conductor_url]
        env = {**os.environ, "MOONCAKE_CLUSTER_SECRET": self.secret}
        log = self.log_dir / f"{name}.log" if self.log_dir else None
        proc = RoleProc(role, name, reach, port, argv, env, log, netns)
        self.procs[name] = proc
        return proc

    def __getitem__(self, name: str) -> RoleProc:
        return self.procs[name]

    @property
    def url(self) -> str:
        """The conductor's base URL (the public API)."""
        return self.conductor_url

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> RoleCluster:
        """Start every declared process and wait until each instance is registered."""
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        for proc in self.procs.values():
            proc.start()
        self.wait_registered([n for n, p in self.procs.items() if p.role != "conductor"],
                             timeout_s)
        return self

    def instances(self, conductor: str | None = None) -> list[dict[str, Any]]:
        """A conductor's view of every instance (GET /internal/instances); the first
        conductor's unless `conductor` (a base URL) is given."""
        r = httpx.get((conductor or self.url) + "/internal/instances", headers=self.headers,
                      timeout=5)
        r.raise_for_status()
        return list(r.json())

    def wait_registered(self, names: list[str], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Wait until each named process serves (its start-up, registration included, is done)
        and the conductor sees it alive and not draining.

        NOTE: the process check matters after a restart: the conductor may still count the
        killed process alive for a heartbeat timeout.
        """
        deadline = time.monotonic() + timeout_s
        pending = [n for n in names if self.procs[n].running()]
        while pending:
            pending = [n for n in pending if not self.procs[n].healthy()]
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"{pending} not serving within {timeout_s:.0f} s")
            if pending:
                time.sleep(_POLL_S)
        while True:
            dead = [p.name for p in self.procs.values()
                    if p.proc is not None and p.proc.poll() is not None and p.name in names]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited during start-up "
                                   f"(logs in {self.log_dir})")
            try:
                live = {s["info"]["instance_id"] for s in self.instances()  # type: ignore[index]
                        if s["alive"] and not s.get("draining")}
                if set(names) <= live:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{names} not registered within {timeout_s:.0f} s")
            time.sleep(_POLL_S)

    def metrics(self, name: str) -> str:
        """A role's /metrics text."""
        proc = self.procs[name]
        return httpx.get(proc.url + "/metrics", headers=self.headers, timeout=10).text

    def free_blocks(self, settle_s: float = 2.0) -> dict[str, int]:
        """Free KV blocks of each decode instance when idle: the most it reports over
        `settle_s` (heartbeats lag, write-backs finish)."""
        out: dict[str, int] = {}
        deadline = time.monotonic() + settle_s
        while True:
            for status in self.instances():
                load = status.get("load") or {}
                info = status["info"]
                if info["role"] == "decode" and load.get("free_blocks") is not None:
                    name = info["instance_id"]
                    out[name] = max(out.get(name, 0), int(load["free_blocks"]))
            if time.monotonic() > deadline:
                return out
            time.sleep(_POLL_S)

    def leftovers(self, idle_free_blocks: dict[str, int]) -> dict[str, float]:
        """What is still held anywhere; all zero once the cluster is idle and leaks nothing.

        Requests in the conductor (its request table, the scheduler's placements, the API's
        open streams), leases (pinned blocks) and write reservations in the store nodes,
        running sequences, write-back pins and KV blocks missing from each decode instance's
        free pool (against `idle_free_blocks`, its count when idle).
        """
        out: dict[str, float] = {}
        for name, proc in self.procs.items():
            if not proc.running():
                continue
            text = self.metrics(name)
            names = {"conductor": ["mooncake_conductor_requests_running",
                                   "mooncake_scheduler_in_flight",
                                   "mooncake_api_requests_running"],
                     "store": ["mooncake_store_active_leases", "mooncake_store_writing_objects"],
                     "decode": ["mooncake_decode_writeback_held_blocks"]}.get(proc.role, [])
            for metric in names:
                found = re.search(rf"^{metric} (\S+)$", text, re.MULTILINE)
                out[f"{name}:{metric}"] = float(found.group(1)) if found else 0.0
        for status in self.instances():
            info, load = status["info"], status.get("load") or {}
            if info["role"] == "decode" and info["instance_id"] in idle_free_blocks:
                out[f"{info['instance_id']}:running"] = load.get("running", 0) + load.get(
                    "waiting", 0)
                out[f"{info['instance_id']}:blocks_in_use"] = (
                    idle_free_blocks[info["instance_id"]] - load.get("free_blocks", 0))
        return out

    def wait_idle(self, idle_free_blocks: dict[str, int], timeout_s: float = 60.0
                  ) -> dict[str, float]:
        """Poll `leftovers` until all zero (returned), or return what is left at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = {k: v for k, v in self.leftovers(idle_free_blocks).items() if v}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(_POLL_S)

    def memory(self) -> dict[str, dict[str, int]]:
        """`RoleProc.memory` of every running role, by name."""
        return {n: p.memory() for n, p in self.procs.items() if p.running()}

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every process: SIGTERM, then SIGKILL for what still runs after `timeout_s` in
        all, or at once if the wait is interrupted (a test timeout): none is left behind."""
        try:
            for proc in reversed(list(self.procs.values())):
                if proc.running():
                    proc.signal(signal.SIGCONT)
                    proc.signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for proc in self.procs.values():
                if proc.running():
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(max(0.1, deadline - time.monotonic()))
        finally:
            for proc in self.procs.values():
                proc.kill()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- process trees: what a supervisor (`--role all`) leaves behind -----------------------------


def _parent_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in (...) may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(pids: Sequence[int]) -> list[int]:
    """`pids` and every process below them (their children may sit in sessions of their own)."""
    children = _parent_map()
    seen: list[int] = []
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.append(pid)
            todo.extend(children.get(pid, []))
    return seen


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def reap(pids: Sequence[int], wait_s: float = 10.0) -> None:
    """SIGKILL what is left of `pids` and their process groups; wait until all are gone."""
    for pid in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + wait_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    if left:
        print(f"  warning: processes {left} survived SIGKILL", file=sys.stderr)
