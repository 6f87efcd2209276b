"""The Grafana dashboard's queries, and the metric names mooncake-server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "mooncake-dashboard.json"
_NAME = re.compile(r"\bmooncake_[a-z0-9_]+\b")
# What prometheus_client appends to a family's name in the exposition.
_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def panel_queries(path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query target of the dashboard."""
    panels = json.loads(path.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p["targets"]]


def family(series_name: str) -> str:
    """The metric family a series name belongs to (`x_bucket` -> `x`)."""
    for suffix in _SUFFIXES:
        if series_name.endswith(suffix):
            return series_name[: -len(suffix)]
    return series_name


def metric_names_in(expr: str) -> set[str]:
    """mooncake_* series names a PromQL expression reads."""
    return set(_NAME.findall(expr))


def exported_families(package: Path = ROOT / "mooncake_server") -> set[str]:
    """Every mooncake_* metric family name the package's source declares."""
    names: set[str] = set()
    for source in package.rglob("*.py"):
        names.update(re.findall(r"[\"'](mooncake_[a-z0-9_]+)[\"']", source.read_text()))
    return names
