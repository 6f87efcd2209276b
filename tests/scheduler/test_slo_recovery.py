"""SLO admission recovers after an overload: real role apps in one process, a tiny random model.

The overload is the decode instance's forward passes slowed by a wrapper (standing in for the CPU
contention that made users' steps slow); the conductor measures the slow token gaps, and its TBT
estimates refuse further requests with 429. Refused requests measure nothing, so only the
measurements' age can end that. The conductor's ledger and the decode instance's admission run on a clock the test can move
forward (real time plus idle periods declared at once) instead of the test sleeping through the horizon;
everything else — placement, reservations, prefill, KV over TCP, decode — is the real path.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_cluster import BLOCK, Cluster, start

from mooncake_server.config import ServerConfig
from mooncake_server.cost_model.perf_model import PerfModel
from mooncake_server.instance import engine_role
from mooncake_server.roles.conductor.scheduler.load import LoadTracker
from mooncake_server.roles.decode import app as decode_app

TBT_SLO_S = 0.3
TTFT_SLO_S = 5.0
SLOW_STEP_S = 0.6  # the overload: each forward pass 30x the modelled 20 ms
MAX_TOKENS = 4


class IdleClock:
    """Monotonic time plus idle periods the test declares instead of waiting them out."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.skipped

    def idle(self, seconds: float) -> None:
        """Let `seconds` pass with nothing sent to the cluster."""
        self.skipped += seconds


def prompt(seed: int, n: int = 10) -> list[int]:
    return [1000 + (seed * 7919 + i * 104729) % 30000 for i in range(n)]


def stream(c: Cluster, ids: list[int]) -> tuple[int, str, list[float]]:
    """Status, error message (if refused) and the arrival times of the streamed chunks."""
    start_s = time.monotonic()
    body = {"model": "tiny", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", c.conductor + "/v1/completions", json=body, timeout=60) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json()["error"]["message"], []
        times = [start_s]
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                times.append(time.monotonic())
    return 200, "", times


def slowed_runners(slow: threading.Event) -> Callable[..., Any]:
    """The engine roles' build_runner, decode's forward passes slowed by SLOW_STEP_S while
    `slow` is set."""
    build = engine_role.build_runner

    def build_slowed(config: ServerConfig, *args: Any, **kwargs: Any) -> Any:
        runner, info = build(config, *args, **kwargs)
        if config.role != "decode":
            return runner, info
        step = runner.step

        def slowed_step(*a: Any, **kw: Any) -> Any:
            if slow.is_set():
                time.sleep(SLOW_STEP_S)  # NOTE: the engine's executor thread, not the test
            return step(*a, **kw)

        runner.step = slowed_step
        return runner, info

    return build_slowed


def beat_after(c: Cluster, since: float, timeout_s: float = 5.0) -> None:
    """Wait until the conductor has had a heartbeat from every decode instance sent after
    `since` (they beat every 0.2 s here)."""
    registry = c.conductor_app.state.backend.scheduler.registry  # on time.monotonic
    while (now := time.monotonic()) < since + timeout_s:
        decodes = registry.alive("decode")
        if decodes and all(registry.heard_within(d.instance_id, now - since) for d in decodes):
            return
        time.sleep(0.02)
    raise AssertionError("no heartbeat from the decode instance")


def prefill_jobs(c: Cluster) -> float:
    return sum(c.metric(url, "mooncake_prefill_jobs_total") for url in c.prefill)


def test_an_idle_cluster_admits_again_once_the_overload_ages_out(
        tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Round numbers: a decode step is 20 ms whatever the batch; the hand-off two steps.
    profile = tmp_path / "profile.json"
    PerfModel(prefill_a=0.0, prefill_b=1e-4, prefill_c=0.01, prefill_e=0.0, decode_d0=0.02,
              decode_d1=0.0, decode_d2=0.0, block_tokens=BLOCK).save(profile)
    slow = threading.Event()
    monkeypatch.setattr(engine_role, "build_runner", slowed_runners(slow))
    clock = IdleClock()
    # The decode instance's admission (whose step timings its heartbeats report) ages on the
    # same clock as the conductor's ledger.
    monkeypatch.setattr(decode_app, "DecodeAdmission",
                        functools.partial(decode_app.DecodeAdmission, clock=clock))
    c = start(tiny_model_dir, "cache-global", tbt_slo_s=TBT_SLO_S, ttft_slo_s=TTFT_SLO_S,
              profile_path=str(profile))
    try:
        scheduler = c.conductor_app.state.backend.scheduler
        scheduler.tracker = LoadTracker(clock)  # the default horizon, on a movable clock
        horizon = scheduler.tracker.horizon_s

        # The overload: a burst, admitted on the model's 40 ms estimate, decodes at 600 ms a step.
        slow.set()
        with ThreadPoolExecutor(3) as pool:
            burst = list(pool.map(lambda i: stream(c, prompt(i)), range(3)))
        assert all(status == 200 for status, _, _ in burst), burst
        # Measured: every gap far above the 300 ms SLO. What comes next is refused at once.
        jobs = prefill_jobs(c)
        status, message, _ = stream(c, prompt(10))
        assert status == 429 and "estimated TBT" in message, message

        # The overload ends. Refused retries measure nothing: the estimate stays where it was...
        slow.clear()
        status, message, _ = stream(c, prompt(11))
        assert status == 429 and "estimated TBT" in message, message
        clock.idle(horizon / 2)
        status, message, _ = stream(c, prompt(12))
        assert status == 429 and "estimated TBT" in message, message
        assert prefill_jobs(c) == jobs  # every refusal came before any prefill work

        # ...until the cluster has been idle for the horizon: the model decides again, and the
        # request it admits meets its SLOs.
        clock.idle(horizon / 2)
        beat_after(c, time.monotonic())  # the decode instance's report of its aged timings
        status, message, times = stream(c, prompt(13))
        assert status == 200, message
        gaps = [b - a for a, b in zip(times[1:], times[2:])]
        assert times[1] - times[0] <= TTFT_SLO_S
        assert gaps and max(gaps) <= TBT_SLO_S, gaps  # few tokens: TBT is the longest gap
    finally:
        c.stop()
