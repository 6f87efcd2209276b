"""Hostile input on the public API: schemathesis from the OpenAPI schema, then hypothesis bodies.

Targets: `--role colocated` and the whole disaggregated cluster (conductor -> prefill -> store ->
decode), both on a tiny random model, so accepted requests run the real engine end to end. Every
answer must be a 2xx, or a 4xx with an OpenAI error body; never a 5xx, never a hang (each call has
a timeout), and the server must still serve a normal request afterwards with no 5xx counted.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

import httpx
import pytest
import schemathesis
from fuzz_helpers import API_KEY, LiveCluster, chat_ok
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CALL_TIMEOUT_S = 30.0  # a call slower than this counts as a hang
SCHEMA_EXAMPLES = 40  # per operation and generation mode
HYPOTHESIS_EXAMPLES = 100  # per endpoint
FIGURES: Counter[str] = Counter()
_SETTINGS: dict[str, Any] = {"deadline": None, "database": None, "derandomize": True,
                             "print_blob": True, "suppress_health_check": list(HealthCheck)}


@pytest.fixture(params=["colocated", "cluster"])
def target(request: pytest.FixtureRequest) -> str:
    """Base URL of the API under test (the fixture of that name starts it)."""
    if request.param == "colocated":
        return str(request.getfixturevalue("colocated_url"))
    live: LiveCluster = request.getfixturevalue("cluster")
    return live.url


def check_answer(status: int, content_type: str, body: bytes, what: str) -> None:
    """2xx, or 4xx with an OpenAI error body; streamed 2xx bodies carry no error event."""
    FIGURES[f"{status // 100}xx"] += 1
    assert status < 500, f"{what}: HTTP {status}: {body[:500]!r}"
    if status >= 400:
        err = json.loads(body)
        assert set(err) == {"error"}, f"{what}: not an OpenAI error body: {body[:300]!r}"
        assert isinstance(err["error"]["message"], str) and err["error"]["message"]
        assert isinstance(err["error"]["type"], str)
        return
    if content_type.startswith("text/event-stream"):
        events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"{what}: stream did not end with [DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event), f"{what}: error mid-stream: {event}"


def five_xx_counted(url: str) -> float:
    """Requests the API layer itself counted with a 5xx status."""
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=10).text
    return sum(float(v) for v in re.findall(
        r'^mooncake_api_requests_total\{[^}]*status="5\d\d"[^}]*\} (\S+)$', text, re.MULTILINE))


def test_schema_driven_fuzz(target: str) -> None:
    """Every /v1 operation of the OpenAPI schema, valid and invalid inputs, gets a clean answer."""
    schema = schemathesis.openapi.from_url(target + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    ops = [op for op in ops if op.path.startswith("/v1/")]
    assert {(op.method.upper(), op.path) for op in ops} >= {
        ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models")}
    for op in ops:
        # NOTE: an operation without inputs (GET /v1/models) has no invalid variant to generate.
        with_body = op.method.upper() == "POST"
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if with_body else [])
        for mode in modes:
            @settings(max_examples=SCHEMA_EXAMPLES, **_SETTINGS)  # type: ignore[arg-type]
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                resp = case.call(base_url=target, headers=AUTH, timeout=CALL_TIMEOUT_S)
                FIGURES["schemathesis cases"] += 1
                ctype = resp.headers.get("content-type") or [""]  # header -> list of values
                check_answer(resp.status_code, ctype[0], resp.content,
                             f"{case.method} {case.path} {case.body!r:.300}")

            run()
    assert five_xx_counted(target) == 0
    chat_ok(target)  # still serving


# -- hypothesis bodies: anything JSON, near-valid requests, raw bytes --------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
_numbers = (st.integers(min_value=-2**70, max_value=2**70) | st.floats()
            | st.sampled_from([0, 1, 2, 16, 17, 127, 128, 10**9]))
_text = st.text(max_size=200) | st.sampled_from(["", " ", "\x00", "<|im_end|>", "\ud7ff" * 3])
_content = (_text | st.none() | _numbers
            | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 1]),
                                              "text": _text}), max_size=3))
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "x", None])},
    optional={"content": _content, "name": _text})
_fields = {
    "model": st.sampled_from(["tiny", "other", "", None]),
    "max_tokens": _numbers | st.none() | _text,
    "max_completion_tokens": _numbers | st.none(),
    "temperature": _numbers | st.none(), "top_p": _numbers | st.none(),
    "seed": _numbers | st.none(), "n": _numbers | st.none(),
    "stop": _text | st.lists(_text, max_size=6) | st.none(),
    "stream": st.booleans() | _numbers,
    "stream_options": st.none() | st.fixed_dictionaries({}, optional={
        "include_usage": st.booleans() | _numbers}),
    "ignore_eos": st.booleans(), "return_token_ids": st.booleans(),
    "logprobs": _json, "tools": _json, "unknown_field": _json,
}
_chat = st.fixed_dictionaries({"messages": st.lists(_message, max_size=4) | _json},
                              optional=_fields)
_completion = st.fixed_dictionaries(
    {"prompt": _text | st.lists(st.integers(min_value=-5, max_value=60_000), max_size=40) | _json},
    optional=_fields)

# Valid requests with extreme but legal values, so many reach the engine (seeds, tiny
# temperatures, streaming, stop strings that may hit).
_valid_fields = {
    "max_tokens": st.integers(min_value=1, max_value=16),
    "temperature": st.floats(min_value=0.0, max_value=2.0),
    "top_p": st.floats(min_value=1e-300, max_value=1.0),
    "seed": st.integers(min_value=-2**70, max_value=2**70),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=4),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(), "return_token_ids": st.booleans(),
}
_valid_chat = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.just("user"),
                                                 "content": st.text(min_size=1, max_size=60)}),
                          min_size=1, max_size=2)}, optional=_valid_fields)
_valid_completion = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=60)
     | st.lists(st.integers(min_value=0, max_value=49_151), min_size=1, max_size=40)},
    optional=_valid_fields)


def _bodies(near_valid: st.SearchStrategy[Any],
            valid: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    as_json = (valid | near_valid | _json).map(lambda v: json.dumps(v).encode())
    return as_json | st.binary(max_size=200)


@pytest.mark.parametrize("path,near_valid,valid",
                         [("/v1/chat/completions", _chat, _valid_chat),
                          ("/v1/completions", _completion, _valid_completion)],
                         ids=["chat", "completions"])
def test_hypothesis_bodies(target: str, path: str, near_valid: st.SearchStrategy[Any],
                           valid: st.SearchStrategy[Any]) -> None:
    """Random JSON, near-valid requests with hostile values, and raw bytes: no 5xx, no hang."""
    with httpx.Client(base_url=target, headers=AUTH, timeout=CALL_TIMEOUT_S) as http:
        @settings(max_examples=HYPOTHESIS_EXAMPLES, **_SETTINGS)  # type: ignore[arg-type]
        @given(body=_bodies(near_valid, valid))
        def run(body: bytes) -> None:
            r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            FIGURES["hypothesis cases"] += 1
            check_answer(r.status_code, r.headers.get("content-type", ""), r.content,
                         f"POST {path} {body[:300]!r}")

        run()
    assert five_xx_counted(target) == 0
    chat_ok(target)


def test_report_figures(capsys: pytest.CaptureFixture[str]) -> None:
    """Print what the fuzz tests above tried (read by the issue's closing note)."""
    with capsys.disabled():
        print(f"\nfuzz figures: {dict(sorted(FIGURES.items()))}")
    assert FIGURES["5xx"] == 0
