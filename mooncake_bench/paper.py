"""The paper's figures to reproduce, the claims checked on our points, and the report.

Each claim is checked on the points a run measured and printed as HOLDS or DIFFERS, never
dropped: what differs at this scale is a result too. The paper's numbers are set beside ours in
`report.md`, with the scale they were measured at.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# FAST'25, Fig. 5: mean TTFT of four prefill scheduling policies on one trace (seconds).
PAPER_POLICY_TTFT_S = {"random": 19.65, "load": 5.27, "cache-local": 3.58, "cache-global": 3.07}
POLICY_ORDER = ("random", "load", "cache-local", "cache-global")
# Fig. 9/10, Table 2: the global pool's prefix-cache hit rate, up to this many times the local
# caches' on the paper's traces.
PAPER_GLOBAL_OVER_LOCAL = 2.36
# Fig. 11-14: effective request capacity under SLOs, Mooncake over its baselines.
PAPER_CAPACITY_GAIN = (1.59, 5.98)


@dataclass(frozen=True)
class Claim:
    """One statement of the paper, checked on our points."""

    figure: str
    text: str
    holds: bool
    evidence: str

    @property
    def verdict(self) -> str:
        """HOLDS or DIFFERS."""
        return "HOLDS" if self.holds else "DIFFERS"


def policy_claims(ttft: dict[str, float]) -> list[Claim]:
    """Fig. 5: each policy's mean TTFT is below the one before it in the paper's order."""
    claims = []
    known = [p for p in POLICY_ORDER if p in ttft]
    for worse, better in zip(known, known[1:]):
        claims.append(Claim("Fig. 5", f"{better} has a lower mean TTFT than {worse}",
                            ttft[better] < ttft[worse],
                            f"{ttft[better]:.2f} s vs {ttft[worse]:.2f} s"))
    if "cache-global" in ttft and len(known) > 1:
        best = min(known, key=lambda p: ttft[p])
        claims.append(Claim("Fig. 5", "global cache-aware scheduling has the lowest mean TTFT",
                            best == "cache-global", f"lowest: {best} ({ttft[best]:.2f} s)"))
    return claims


def by_capacity(points: Sequence[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Cache points as capacity -> mode -> hit rate."""
    out: dict[int, dict[str, float]] = {}
    for p in points:
        out.setdefault(int(p["capacity_blocks"]), {})[p["mode"]] = float(p["hit_rate"])
    return out


def cache_claims(points: Sequence[dict[str, Any]]) -> list[Claim]:
    """Fig. 9/10: the global pool's hit rate is at least the local caches' at every capacity."""
    claims = []
    by_cap = by_capacity(points)
    for local in ("local", "local-aware"):
        pairs = [(c, m["global"], m[local]) for c, m in sorted(by_cap.items())
                 if "global" in m and local in m]
        if not pairs:
            continue
        ratios = [g / l_ for _, g, l_ in pairs if l_ > 0]
        best = max(ratios, default=float("nan"))
        claims.append(Claim(
            "Fig. 9/10", f"a global pool hits at least as often as {local} caches of the same "
            "total size, at every capacity", all(g >= l_ for _, g, l_ in pairs),
            f"global / {local} up to {best:.2f}x (paper: up to {PAPER_GLOBAL_OVER_LOCAL}x "
            "over local caches)"))
    return claims


def goodput_claims(points: Sequence[dict[str, Any]], ours: str = "all-slo",
                   baseline: str = "colocated") -> list[Claim]:
    """Fig. 11-14: at each rate, disaggregated Mooncake serves a larger share within SLO than
    the colocated baseline."""
    claims = []
    base = {round(p["rate"], 6): p["within_slo"] for p in points if p["system"] == baseline}
    mine = {round(p["rate"], 6): p["within_slo"] for p in points if p["system"] == ours}
    for rate in sorted(set(base) & set(mine)):
        gain = mine[rate] / base[rate] if base[rate] else float("inf")
        claims.append(Claim("Fig. 11-14", f"{ours} serves more requests within SLO than "
                            f"{baseline} at {rate:.2f} req/s", mine[rate] > base[rate],
                            f"{mine[rate]:.0%} vs {base[rate]:.0%} ({gain:.2f}x; paper: "
                            f"{PAPER_CAPACITY_GAIN[0]}-{PAPER_CAPACITY_GAIN[1]}x capacity)"))
    return claims


def write_report(out: Path, scale: dict[str, Any], sections: dict[str, Any],
                 claims: Sequence[Claim]) -> Path:
    """`report.md` in `out`: the scale, each figure beside the paper's, every claim's verdict."""
    lines = ["# Mooncake paper figures, reproduced at CPU scale", "",
             "## Scale", ""]
    lines += [f"- {k}: {v}" for k, v in scale.items()]
    policies = sections.get("policies")
    if policies:
        lines += ["", "## Fig. 5: prefill scheduling policies", "", "![policies](policies.png)",
                  "", "| policy | mean TTFT (ours) | p90 TTFT (ours) | prompt tokens cached "
                  "(ours) | mean TTFT (paper) |", "|---|---|---|---|---|"]
        for name in POLICY_ORDER:
            if name in policies:
                p = policies[name]
                hit = p.get("cache_hit_rate")
                lines.append(f"| {name} | {p['ttft_mean']:.2f} s | {p['ttft_p90']:.2f} s | "
                             f"{'-' if hit is None else f'{hit:.0%}'} | "
                             f"{PAPER_POLICY_TTFT_S[name]} s |")
    cache = sections.get("cache")
    if cache:
        lines += ["", "## Fig. 9/10, Table 2: global pool vs local caches", "",
                  "![cache](cache.png)", "",
                  f"Trace: {cache['trace']} ({cache['requests']} requests, "
                  f"{cache['blocks']} blocks); blocks asked for again by a later request: "
                  f"{cache['reused_share']:.1%} of the distinct ones; {cache['nodes']} nodes "
                  "or local caches.", "", "| capacity (blocks) | global | local | local-aware |",
                  "|---|---|---|---|"]
        for cap, modes in sorted(by_capacity(cache["points"]).items()):
            lines.append(f"| {cap} | " + " | ".join(
                f"{modes[m]:.1%}" if m in modes else "-"
                for m in ("global", "local", "local-aware")) + " |")
    goodput = sections.get("goodput")
    if goodput:
        lines += ["", "## Fig. 11-14: requests within SLO as arrival rate grows", "",
                  "![goodput](goodput.png)", "",
                  "| system | req/s | within SLO | accepted within |",
                  "|---|---|---|---|"]
        for p in goodput["points"]:
            lines.append(f"| {p['system']} | {p['rate']:.2f} | {p['within_slo']:.0%} | "
                         f"{p['accepted_within_slo']:.0%} |")
    lines += ["", "## Claims", "", "| figure | claim | verdict | evidence |", "|---|---|---|---|"]
    lines += [f"| {c.figure} | {c.text} | **{c.verdict}** | {c.evidence} |" for c in claims]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    (out / "claims.json").write_text(json.dumps(
        [{"figure": c.figure, "claim": c.text, "verdict": c.verdict, "evidence": c.evidence}
         for c in claims], indent=1))
    return path
