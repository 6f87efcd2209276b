"""`--role all`: one conductor, store, prefill and decode as supervised OS processes.

Each child is `python -m mooncake_server --role X` on its own port (conductor on --port, the
others on --port+1..3), so KV really crosses process boundaries through the transfer engine. The
cluster secret travels in the environment, never on a command line. A child that dies is restarted
(with back-off); Ctrl-C / SIGTERM stops every child gracefully, then forcibly after a grace period.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from mooncake_server.config import ServerConfig, flags
from mooncake_server.model_assets import resolve_model

log = logging.getLogger(__name__)

_GRACE_S = 10.0
_MAX_RESTARTS = 5
_RESTART_WINDOW_S = 60.0
# The children this supervisor runs, each on --port plus its offset.
CHILD_PORT_OFFSETS = {"conductor": 0, "store": 1, "prefill": 2, "decode": 3}
# Fields a child reads that never go on its command line, and why. Every other field reaches
# every child that reads it (config.flags() says which), as given or as `_own_values` sets it.
THROUGH_ENV = {
    "cluster_secret": "a secret never goes on a command line (child_env)",
    "api_key": "a secret never goes on a command line (child_env)",
}
NOT_FORWARDED = {
    "instance_id": "one id for several children would collide; each is named role@host:port",
    "advertise_host": "the children are reached on loopback; it is the supervisor's address",
    "transfer_port": "one port for several children would collide; each picks a free one",
}


def _own_values(config: ServerConfig, role: str, model: str) -> dict[str, Any]:
    """The fields the supervisor sets per child instead of forwarding them as given."""
    return {
        "role": role,
        # The conductor listens on --host; the others on loopback, reached only through it.
        "host": config.host if role == "conductor" else "127.0.0.1",
        "port": config.port + CHILD_PORT_OFFSETS[role],
        "conductor_url": f"http://127.0.0.1:{config.port}",
        # Resolved once by the supervisor, so the children do not race to convert it.
        "model": model,
        # Absolute, so it names the same file whatever directory a child resolves it from.
        "profile_path": config.profile_path and os.path.abspath(config.profile_path),
    }


def child_argv(config: ServerConfig, role: str, model: str) -> list[str]:
    """Command line of one child role: every field it reads except the secrets and the ids."""
    own = _own_values(config, role, model)
    argv = [sys.executable, "-m", "mooncake_server"]
    for name, flag in flags():
        if role in flag.roles and name not in THROUGH_ENV and name not in NOT_FORWARDED:
            argv += flag.argv(own[name] if name in own else getattr(config, name))
    return argv


def child_env(config: ServerConfig, role: str, secret: str,
              base: dict[str, str]) -> dict[str, str]:
    """Environment of one child: the secrets travel here, never on a command line.

    Only the conductor gets the API key; a secret file of the parent is replaced by its content.
    """
    env = {k: v for k, v in base.items()
           if k not in ("MOONCAKE_CLUSTER_SECRET_FILE", "MOONCAKE_API_KEY")}
    env["MOONCAKE_CLUSTER_SECRET"] = secret
    if role == "conductor" and config.api_key:
        env["MOONCAKE_API_KEY"] = config.api_key
    return env


def _die_with_parent() -> None:
    # NOTE: PR_SET_PDEATHSIG makes the kernel SIGTERM a child whose supervisor vanished (even on
    # SIGKILL), so no orphaned role keeps a port.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Child:
    """One supervised role process."""

    role: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: list[float] = field(default_factory=list)

    def start(self) -> None:
        """Spawn (or respawn) the process."""
        self.proc = subprocess.Popen(self.argv, env=self.env, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        log.info("started %s (pid %d)", self.role, self.proc.pid)


class Supervisor:
    """Starts the children, restarts crashed ones, stops them all on a signal."""

    def __init__(self, children: list[Child], health_url: str) -> None:
        self.children = children
        self.health_url = health_url
        self._stopping = False

    def _on_signal(self, signum: int, _frame: object) -> None:
        log.info("received %s, stopping all roles", signal.Signals(signum).name)
        self._stopping = True

    def run(self) -> int:
        """Supervise until a signal arrives or a child keeps crashing; returns an exit code."""
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        for child in self.children:
            child.start()
        ready = False
        code = 0
        while not self._stopping:
            time.sleep(0.2)
            if not ready and self._healthy():
                ready = True
                log.info("ready: OpenAI API at %s", self.health_url.rsplit("/", 1)[0] + "/v1")
            for child in self.children:
                assert child.proc is not None
                rc = child.proc.poll()
                if rc is None or self._stopping:
                    continue
                now = time.monotonic()
                child.restarts = [t for t in child.restarts if now - t < _RESTART_WINDOW_S]
                if len(child.restarts) >= _MAX_RESTARTS:
                    log.error("%s exited %d and keeps crashing; stopping", child.role, rc)
                    self._stopping, code = True, 1
                    break
                log.warning("%s exited with %d; restarting", child.role, rc)
                child.restarts.append(now)
                time.sleep(min(2 ** len(child.restarts) * 0.1, 5.0))
                child.start()
        self._stop_all()
        return code

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def _stop_all(self) -> None:
        live = [c.proc for c in self.children if c.proc and c.proc.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _GRACE_S
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("pid %d did not stop in %.0fs; killing", p.pid, _GRACE_S)
                p.kill()
                p.wait()
        log.info("all roles stopped")


def run_all(config: ServerConfig) -> None:
    """Entry point of `--role all`."""
    # Convert the bundled model once here, so the children do not race to do it.
    model = resolve_model(config.model)
    secret = config.cluster_secret or ServerConfig.new_secret()
    share = None
    if not config.torch_threads and not config.cpu_share_path:
        # The prefill and decode processes share these cores through this board (see
        # engine/core_budget.py); it lives as long as the supervisor.
        share = tempfile.NamedTemporaryFile(prefix="mooncake-cores-", dir=_shm_dir())
        config = config.replace(cpu_share_path=share.name)
    children = [Child(role, child_argv(config, role, model),
                      child_env(config, role, secret, dict(os.environ)))
                for role in ("conductor", "store", "prefill", "decode")]
    health = f"http://{config.public_host}:{config.port}/health"
    code = Supervisor(children, health).run()
    if share is not None:
        share.close()
    sys.exit(code)


def _shm_dir() -> str | None:
    """/dev/shm where it exists (the board is touched every step), else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None
