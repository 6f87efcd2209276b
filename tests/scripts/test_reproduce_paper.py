"""scripts/reproduce_paper.py: the cache simulator's figures, the claims it checks, and the report
built from a tiny run (no servers: the serving steps come from fixture files)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from mooncake_bench import paper
from mooncake_bench.cache_sim import reused_share, simulate

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Two users alternating over one shared document, each asking follow-ups: a pool of 16 blocks in
# all holds it once for both; two local caches of 8 each hold it twice and thrash.
SHARED = list(range(6))
TRACE = [SHARED + [100], SHARED + [200], SHARED + [100, 101], SHARED + [200, 201],
         SHARED + [100, 101, 102], SHARED + [200, 201, 202]]


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("reproduce_paper",
                                                  ROOT / "scripts" / "reproduce_paper.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["reproduce_paper"] = module
    spec.loader.exec_module(module)
    return module


def test_a_global_pool_hits_where_split_local_caches_miss() -> None:
    """Same total capacity: the global pool keeps the shared document once for both users;
    round-robin local caches each see half the requests and hold less of it."""
    glob = simulate(TRACE, 16, mode="global", nodes=2)
    local = simulate(TRACE, 16, mode="local", nodes=2)
    aware = simulate(TRACE, 16, mode="local-aware", nodes=2)
    assert glob.per_request == [0, 6, 7, 7, 8, 8]  # the prefix each request finds cached
    assert glob.hits > local.hits and glob.hits >= aware.hits
    assert glob.blocks == local.blocks == sum(len(r) for r in TRACE)
    unbounded = simulate(TRACE, 10_000, mode="global", nodes=1)
    assert unbounded.hits == glob.hits == 36  # 16 blocks were enough here
    assert reused_share(TRACE) == pytest.approx(10 / 12)  # 6 shared + 100, 101, 200, 201


def test_a_cache_smaller_than_the_nodes_is_refused() -> None:
    with pytest.raises(ValueError, match="one block per node"):
        simulate(TRACE, 1, nodes=2)
    with pytest.raises(ValueError, match="mode"):
        simulate(TRACE, 8, mode="lru")


def test_claims_say_holds_or_differs_never_nothing() -> None:
    claims = paper.policy_claims({"random": 9.0, "load": 4.0, "cache-local": 4.5,
                                  "cache-global": 3.0})
    verdicts = {c.text: c.verdict for c in claims}
    assert verdicts["load has a lower mean TTFT than random"] == "HOLDS"
    assert verdicts["cache-local has a lower mean TTFT than load"] == "DIFFERS"
    assert verdicts["global cache-aware scheduling has the lowest mean TTFT"] == "HOLDS"
    goodput = paper.goodput_claims([
        {"system": "all-slo", "rate": 0.5, "within_slo": 0.8},
        {"system": "colocated", "rate": 0.5, "within_slo": 0.2},
        {"system": "all-slo", "rate": 1.0, "within_slo": 0.5},
        {"system": "colocated", "rate": 1.0, "within_slo": 0.6}])
    assert [c.verdict for c in goodput] == ["HOLDS", "DIFFERS"]
    assert "4.00x" in goodput[0].evidence


def test_the_report_builds_from_a_tiny_run(script: ModuleType, tmp_path: Path) -> None:
    """Cache step computed on a tiny trace; the policy step kept from an earlier run (resume);
    the goodput step taken from a given goodput.json: report.md, PNGs, claims."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(h),
                                         "output_length": 4, "hash_ids": h}) + "\n"
                             for i, h in enumerate(TRACE)))
    out = tmp_path / "report"
    out.mkdir()
    (out / "policies.json").write_text(json.dumps({
        p: {"ttft_mean": t, "ttft_p90": 2 * t, "cache_hit_rate": 0.1, "ok": 8}
        for p, t in (("random", 8.0), ("load", 5.0), ("cache-local", 4.0),
                     ("cache-global", 3.5))}))
    given = tmp_path / "gp"
    given.mkdir()
    (given / "goodput.png").write_bytes(PNG_MAGIC)
    (given / "goodput.json").write_text(json.dumps({"points": [
        {"system": "all-slo", "rate": 0.8, "within_slo": 0.77, "accepted_within_slo": 1.0},
        {"system": "colocated", "rate": 0.8, "within_slo": 0.08, "accepted_within_slo": 0.08},
    ]}))
    script.main(["--resume", str(out), "--cache-trace", str(trace), "--capacities", "8,16",
                 "--nodes", "2", "--goodput", str(given / "goodput.json")])
    report = (out / "report.md").read_text()
    for figure in ("Fig. 5", "Fig. 9/10", "Fig. 11-14"):
        assert figure in report
    assert "| cache-global | 3.50 s | 7.00 s | 10% | 3.07 s |" in report  # ours, the paper's
    assert "**HOLDS**" in report and "**DIFFERS**" not in report
    for png in ("cache.png", "policies.png", "goodput.png"):
        assert (out / png).read_bytes().startswith(PNG_MAGIC)
    claims = json.loads((out / "claims.json").read_text())
    assert {c["figure"] for c in claims} == {"Fig. 5", "Fig. 9/10", "Fig. 11-14"}
    cache = json.loads((out / "cache.json").read_text())
    assert {p["mode"] for p in cache["points"]} == {"global", "local", "local-aware"}
