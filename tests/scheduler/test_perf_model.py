"""The cost model: its formulas, its JSON file, and clear errors for a bad file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake_server.cost_model.perf_model import PerfModel


def test_times_grow_with_work() -> None:
    m = PerfModel()
    assert m.prefill_s(0) == 0.0
    assert 0 < m.prefill_s(100) < m.prefill_s(1000) < m.prefill_s(1000, cached_tokens=4000)
    assert m.decode_step_s(0, 0) == 0.0
    assert m.decode_step_s(1, 100) < m.decode_step_s(8, 100) < m.decode_step_s(8, 10_000)
    assert m.transfer_s(1000) == pytest.approx(1000 * m.kv_bytes_per_token / m.transfer_bytes_per_s)


@pytest.mark.parametrize(("new", "cached", "chunk"), [
    (1000, 0, 35), (1000, 200, 1000), (1708, 16, 64), (5, 0, 16), (32, 0, 16), (0, 0, 16)])
def test_a_chunked_prefill_costs_its_passes(new: int, cached: int, chunk: int) -> None:
    """Each pass attends the prefix before it: the closed form equals summing the passes."""
    m = PerfModel()
    passes = [(min(chunk, new - i), cached + i) for i in range(0, new, chunk)]
    seconds, n = m.chunked_prefill_s(new, cached, chunk)
    assert n == len(passes)
    assert seconds == pytest.approx(sum(m.prefill_s(c, p) for c, p in passes))
    if n > 1:  # more passes, more fixed cost: cutting a prompt makes it slower
        assert seconds > m.prefill_s(new, cached)


def test_a_packed_pass_pays_its_fixed_cost_once_and_each_prompts_attention_alone() -> None:
    m = PerfModel()
    alone = m.prefill_s(500) + m.prefill_s(300, 1000)
    assert m.pass_s([(500, 0), (300, 1000), (0, 40)]) == pytest.approx(alone - m.prefill_c)
    # Less than one prompt of all their tokens: the prompts do not attend each other.
    assert m.pass_s([(500, 0), (500, 0)]) < m.prefill_s(1000)
    assert m.pass_s([(700, 16)]) == pytest.approx(m.prefill_s(700, 16))
    assert m.pass_s([]) == m.pass_s([(0, 10)]) == 0.0


def test_profile_file_round_trip(tmp_path: Path) -> None:
    m = PerfModel(prefill_a=1e-7, prefill_b=2e-3, decode_d1=4e-3, model="tiny", block_tokens=32)
    path = tmp_path / "p.json"
    m.save(path)
    assert PerfModel.load(path) == m


@pytest.mark.parametrize("content, message", [
    ("not json", "cannot read"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"prefill_b": -1.0}), "prefill_b must not be negative"),
    (json.dumps({"prefil_b": 1.0}), "unknown field(s) prefil_b"),
    (json.dumps({"version": 9}), "unsupported profile version"),
])
def test_bad_profile_names_the_problem(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="--profile") as err:
        PerfModel.load(path)
    assert message in str(err.value)


def test_missing_profile_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--profile: cannot read"):
        PerfModel.load(tmp_path / "absent.json")
