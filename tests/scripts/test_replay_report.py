"""scripts/replay_trace.py's report folder and progress line (mooncake_bench/report.py), and a
real replay of the sample."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "traces" / "mooncake_sample.jsonl"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report() -> ModuleType:
    import mooncake_bench.report

    return mooncake_bench.report


@pytest.fixture(scope="module")
def rt() -> ModuleType:
    return load_script("replay_trace")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_redraws_one_line_at_most_once_a_second(
        report: ModuleType) -> None:
    clock, out = FakeClock(), Tty()
    p = report.Progress("colocated", 3, out, clock)
    p.on_sent()
    p.on_sent()  # same instant: not drawn again
    clock.now = 0.5
    p.on_done("ok")
    assert out.getvalue().count("\r") == 1
    clock.now = 1.2
    p.on_done("rejected")
    p.finish()
    frames = out.getvalue().split("\r\x1b[K")[1:]
    assert len(frames) == 3 and out.getvalue().endswith("\n")
    assert "sent 2/3, done 2 (ok 1, rejected 1, errors 0)" in frames[-1]


def test_progress_off_a_terminal_writes_plain_lines_only_when_counts_move(
        report: ModuleType) -> None:
    clock, out = FakeClock(), io.StringIO()
    p = report.Progress("all", 2, out, clock)
    p.on_sent()
    clock.now = 6.0
    p.tick()  # nothing moved: no new line in a log
    p.on_done("error")
    clock.now = 7.0
    p.on_sent()  # moved, but too soon after the last line
    p.finish()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split(", ", 1)[0] for line in lines] == ["all: sent 1/2", "all: sent 1/2",
                                                          "all: sent 2/2"]
    assert "errors 1" in lines[-1]


def test_cdf_tops_out_at_the_share_that_was_served(report: ModuleType) -> None:
    xs, ys = report.cdf_points([0.3, None, 0.1, float("nan")], 4)
    assert xs == [0.1, 0.3] and ys == [0.25, 0.5]


def test_report_files_for_two_configurations(report: ModuleType, rt: ModuleType,
                                             tmp_path: Path) -> None:
    O = rt.Outcome
    outcomes = {
        "colocated": [O("ok", ttft_s=0.5, token_times=[0.5, 0.6, 0.7], prompt_tokens=10,
                        index=0, max_tokens=3),
                      O("rejected", index=1, prompt_tokens=12, max_tokens=3)],
        "1p1d": [O("ok", ttft_s=0.2, token_times=[0.2, 0.3], index=0, max_tokens=2),
                 O("ok", ttft_s=9.0, token_times=[9.0], index=1, max_tokens=1)],
    }
    records = [rt.request_record(name, o, 1.0, 0.5) for name, os in outcomes.items()
               for o in os]
    summaries = {name: asdict(rt.summarize(os, 1.0, 0.5)) for name, os in outcomes.items()}
    folder = report.write_report(tmp_path / "r", records, summaries, {"trace": "x"}, 1.0, 0.5)
    lines = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
    assert [(r["config"], r["index"], r["status"], r["within_slo"]) for r in lines] == [
        ("colocated", 0, "ok", True), ("colocated", 1, "rejected", False),
        ("1p1d", 0, "ok", True), ("1p1d", 1, "ok", False)]
    assert lines[0]["tbt_s"] == pytest.approx(0.1) and lines[3]["tbt_s"] is None
    assert lines[1]["prompt_tokens"] == 12 and lines[0]["output_tokens"] == 3
    # Strict JSON: NaN figures (no TBT at all, say) are written as null.
    doc = json.loads((folder / "summary.json").read_text(), parse_constant=pytest.fail)
    assert doc["slo"] == {"ttft_s": 1.0, "tbt_s": 0.5}
    assert {k: v["effective_capacity"] for k, v in doc["configurations"].items()} == {
        "colocated": 0.5, "1p1d": 0.5}
    assert (folder / "cdf.png").read_bytes()[:8] == PNG_MAGIC


def test_report_folder_defaults_to_a_timestamped_one(rt: ModuleType) -> None:
    folder = rt.report_folder(None, now=0.0)
    assert folder.parent == Path("replay-report") and folder.name[:2] in ("19", "20")
    assert rt.report_folder("out/x") == Path("out/x")
    assert rt.DEFAULT_TRACE == SAMPLE and SAMPLE.exists()


@pytest.mark.e2e
def test_replay_of_the_shipped_sample_writes_a_readable_report(
        tiny_model_dir: str, tmp_path: Path) -> None:
    """The script as a user runs it: default trace, two launched configurations, report files."""
    n = 12
    folder = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "replay_trace.py"), "--launch", "colocated,all",
         "--max-requests", str(n), "--time-scale", "0.01", "--block-tokens", "1",
         "--max-output-tokens", "4", f"--server-arg=--model={tiny_model_dir}",
         "--logs", str(tmp_path / "logs"), "--report", str(folder)],
        cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"sent {n}/{n}, done {n}" in proc.stderr  # the progress line's last state

    records = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 2 * n
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["run"]["trace"] == str(SAMPLE) and summary["run"]["requests"] == n
    for config in ("colocated", "all"):
        mine = [r for r in records if r["config"] == config]
        assert sorted(r["index"] for r in mine) == list(range(n))
        assert all(r["status"] in ("ok", "rejected", "error") for r in mine)
        assert any(r["status"] == "ok" and r["ttft_s"] > 0 and r["output_tokens"] == 4
                   for r in mine)
        capacity = summary["configurations"][config]["effective_capacity"]
        assert capacity == pytest.approx(sum(r["within_slo"] for r in mine) / n)

    png = (folder / "cdf.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 20_000
    image = pytest.importorskip("PIL.Image").open(folder / "cdf.png")
    assert image.size[0] > image.size[1] > 300
