"""What a trace replay shows a person: live progress on stderr, then a report folder.

The folder holds `requests.jsonl` (one line per request and configuration), `summary.json` (each
configuration's figures, effective capacity included) and `cdf.png` (TTFT and TBT CDFs per
configuration with the SLOs drawn, and effective capacity per configuration). It works from plain
dicts (scripts/replay_trace.py writes them, other benchmarks may); matplotlib is imported only to
draw the PNG.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

REQUESTS_FILE = "requests.jsonl"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "cdf.png"

# ---------------------------------------------------------------------------------------------
# Progress


class Progress:
    """Counts requests sent / done / rejected / failed and shows them at most once a second.

    On a terminal one status line is redrawn in place; elsewhere (a log file, CI) plain lines are
    written, fewer of them, and only when a count moved.
    """

    def __init__(self, label: str, total: int, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label = label
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = 1.0 if self.tty else 5.0
        self.clock = clock
        self.sent = self.ok = self.rejected = self.errors = 0
        self._start = clock()
        self._last_shown = -math.inf
        self._last_counts: tuple[int, ...] = ()

    @property
    def done(self) -> int:
        """Requests answered one way or another."""
        return self.ok + self.rejected + self.errors

    def on_sent(self) -> None:
        """A request left."""
        self.sent += 1
        self.tick()

    def on_done(self, status: str) -> None:
        """A request ended with `status` (ok | rejected | error)."""
        if status == "ok":
            self.ok += 1
        elif status == "rejected":
            self.rejected += 1
        else:
            self.errors += 1
        self.tick()

    def line(self) -> str:
        """The status as one line of text."""
        return (f"{self.label}: sent {self.sent}/{self.total}, done {self.done} (ok {self.ok}, "
                f"rejected {self.rejected}, errors {self.errors}), "
                f"{self.clock() - self._start:.0f} s")

    def tick(self) -> None:
        """Show the status if the last one is old enough (and, off a terminal, out of date)."""
        now = self.clock()
        if now - self._last_shown < self.interval_s:
            return
        self._show(now)

    def finish(self) -> None:
        """Show the final status and end the line."""
        self._show(self.clock(), final=True)

    def _show(self, now: float, final: bool = False) -> None:
        counts = (self.sent, self.ok, self.rejected, self.errors)
        if not self.tty and counts == self._last_counts and not final:
            return  # the same counts, only later, are not news in a log
        self._last_shown, self._last_counts = now, counts
        text = self.line()
        if self.tty:
            self.stream.write(f"\r\x1b[K{text}" + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


# ---------------------------------------------------------------------------------------------
# The report folder


def json_safe(value: Any) -> Any:
    """`value` with NaN and infinities as null: strict JSON readers reject them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_report(folder: Path, records: Sequence[Mapping[str, Any]],
                 summaries: Mapping[str, Mapping[str, Any]], run: Mapping[str, Any],
                 ttft_slo: float, tbt_slo: float) -> Path:
    """Write requests.jsonl, summary.json and cdf.png into `folder`; return it.

    Args:
        records: one dict per request with at least `config`, `status`, `ttft_s`, `tbt_s`.
        summaries: each configuration's figures, with `within_slo` (effective capacity).
        run: how the replay was run (trace, slice, scales), stored in the summary as is.
    """
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / REQUESTS_FILE, "w") as f:
        for r in records:
            f.write(json.dumps(json_safe(dict(r))) + "\n")
    doc = {"run": dict(run), "slo": {"ttft_s": ttft_slo, "tbt_s": tbt_slo},
           "configurations": {name: {**s, "effective_capacity": s["within_slo"]}
                              for name, s in summaries.items()}}
    (folder / SUMMARY_FILE).write_text(json.dumps(json_safe(doc), indent=2) + "\n")
    plot_cdfs(folder / PLOT_FILE, records, summaries, ttft_slo, tbt_slo)
    return folder


def cdf_points(values: Sequence[float | None], total: int) -> tuple[list[float], list[float]]:
    """Sorted finite values and the share of all `total` requests at or below each.

    Requests without a value (rejected, failed, one token only) never reach the curve, so it
    tops out at the share that was served.
    """
    xs = sorted(v for v in values if v is not None and math.isfinite(v))
    return xs, [(i + 1) / total for i in range(len(xs))] if total else []


def plot_cdfs(path: Path, records: Sequence[Mapping[str, Any]],
              summaries: Mapping[str, Mapping[str, Any]], ttft_slo: float,
              tbt_slo: float) -> None:
    """TTFT and TBT CDFs per configuration with the SLO lines, and effective capacity bars."""
    plt = pyplot()
    fig, (ax_ttft, ax_tbt, ax_cap) = plt.subplots(1, 3, figsize=(15, 4.5))
    names = list(summaries)
    colors = [f"C{i % 10}" for i in range(len(names))]
    for name, color in zip(names, colors, strict=True):
        mine = [r for r in records if r["config"] == name]
        capacity = summaries[name].get("within_slo")
        label = name if capacity is None or math.isnan(capacity) else \
            f"{name} (capacity {capacity:.0%})"
        for ax, key in ((ax_ttft, "ttft_s"), (ax_tbt, "tbt_s")):
            xs, ys = cdf_points([r.get(key) for r in mine], len(mine))
            ax.step(xs, ys, where="post", color=color, label=label)
    for ax, slo, what in ((ax_ttft, ttft_slo, "TTFT"), (ax_tbt, tbt_slo, "TBT")):
        ax.axvline(slo, color="black", linestyle="--", linewidth=1, label=f"SLO {slo:g} s")
        ax.set_xlabel(f"{what} (s)")
        ax.set_ylabel("share of all requests")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{what} CDF" + (" (TBT: mean of the longest 10% gaps)" if what == "TBT"
                                      else ""), fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    caps = [summaries[n].get("within_slo") for n in names]
    heights = [0.0 if c is None or math.isnan(c) else c for c in caps]
    bars = ax_cap.bar(range(len(names)), heights, color=colors)
    for bar, h in zip(bars, heights, strict=True):
        ax_cap.annotate(f"{h:.0%}", (bar.get_x() + bar.get_width() / 2, h), ha="center",
                        va="bottom", fontsize=9)
    ax_cap.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax_cap.set_ylim(0, 1.1)
    ax_cap.set_ylabel("share of requests within both SLOs")
    ax_cap.set_title("effective capacity", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files only (no display on servers and CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_chart(path: Path, lines: Mapping[str, Sequence[tuple[float, float]]], xlabel: str,
               ylabel: str, *, ylim: tuple[float, float] = (0.0, 1.05), xlog: bool = False,
               hline: float | None = None, dashed: Mapping[str, Sequence[tuple[float, float]]]
               | None = None) -> None:
    """One line per series (points sorted by x), dashed reference lines, a dotted `hline`."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in lines.items():
        if pts:
            ax.plot(*zip(*sorted(pts)), marker="o", label=label)
    for label, pts in (dashed or {}).items():
        if pts:
            ax.plot(*zip(*sorted(pts)), ls="--", color="grey", label=label)
    if hline is not None:
        ax.axhline(hline, color="red", lw=0.8, ls=":")
    if xlog:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(*ylim)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
