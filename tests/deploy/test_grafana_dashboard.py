"""The Grafana dashboard is importable and reads only metrics the roles export (static).

The live half, every query returning series from the stack's Prometheus under real traffic,
is in test_compose_stack.py (marked `docker`).
"""

from __future__ import annotations

import json

from dashboard_queries import (
    DASHBOARD,
    exported_families,
    family,
    metric_names_in,
    panel_queries,
)


def test_dashboard_is_an_importable_grafana_model() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]


def test_dashboard_covers_what_an_operator_asks_first() -> None:
    exprs = " ".join(expr for _, expr in panel_queries())
    for needed in ("mooncake_api_time_to_first_token_seconds_bucket",
                   "mooncake_api_inter_token_latency_seconds_bucket",
                   "mooncake_engine_batch_size", "mooncake_store_hits_total",
                   "mooncake_engine_free_kv_blocks", "mooncake_scheduler_rejected_total"):
        assert needed in exprs, needed


def test_every_query_reads_a_metric_the_package_exports() -> None:
    exported = exported_families()
    assert "mooncake_api_requests" in exported  # the scan itself works
    for title, expr in panel_queries():
        names = metric_names_in(expr)
        assert names, (title, expr)
        unknown = {n for n in names if family(n) not in exported}
        assert not unknown, f"{title}: {sorted(unknown)} exported by no role"
