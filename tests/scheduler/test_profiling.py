"""`mooncake-server profile`: the fit, and a tiny real run whose file the conductor can load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake_server.cli import main
from mooncake_server.config import ServerConfig
from mooncake_server.cost_model.perf_model import PerfModel
from mooncake_server.profiling import Sample, fit_nonnegative
from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.roles.conductor.scheduler import build_scheduler


def test_fit_recovers_known_coefficients() -> None:
    truth = {"a": 3e-7, "b": 1e-3, "c": 0.05, "e": 2e-7}
    samples = [Sample((n * n, n, 1.0, n * p), truth["a"] * n * n + truth["b"] * n + truth["c"]
                      + truth["e"] * n * p)
               for p in (0, 1000) for n in (16, 64, 256, 1024)]
    fit = fit_nonnegative(samples, ("a", "b", "c", "e"))
    for name, value in truth.items():
        assert fit[name] == pytest.approx(value, rel=1e-6)


def test_fit_never_predicts_less_time_for_more_work() -> None:
    # Noise that would make the quadratic term negative: it is dropped, not kept negative.
    samples = [Sample((n * n, n, 1.0), 0.01 + 1e-3 * n - (2e-8 * n * n if n > 100 else 0))
               for n in (10, 50, 100, 400, 800)]
    fit = fit_nonnegative(samples, ("a", "b", "c"))
    assert fit["a"] == 0.0 and fit["b"] > 0 and fit["c"] >= 0


def test_profile_command_writes_a_file_the_conductor_loads(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str],
                                                          ) -> None:
    out = tmp_path / "profile.json"
    main(["profile", "--out", str(out), "--prefill-tokens", "8,32,96,160",
          "--prefill-cached", "0,64", "--decode-batch", "1,2,4", "--decode-context", "16,64",
          "--repeats", "1", "--transfer-bandwidth", "5e8", "--log-level", "warning"])
    assert "decode_step_s(B, ctx)" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert len(data["measured"]["prefill"]) == 8 and len(data["measured"]["decode"]) == 6
    model = PerfModel.load(out)
    assert model.model == "SmolLM2-135M-Instruct" and model.transfer_bytes_per_s == 5e8
    assert model.kv_bytes_per_token > 0
    # Fitted on the real engine: more tokens, bigger batches take longer.
    assert model.prefill_s(160) > model.prefill_s(8) > 0
    assert model.decode_step_s(4, 256) > 0
    config = ServerConfig(role="conductor", profile_path=str(out))
    sched = build_scheduler(config, InstanceRegistry(5.0))
    assert sched.model == model


def test_profile_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["profile", "--repeats", "0"])
    assert exit_.value.code == 2
    assert "--repeats" in capsys.readouterr().err
