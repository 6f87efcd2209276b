"""A Mooncake trace and what a replay of it measured: requests, their token prompts, outcomes
and the figures every benchmark reports (TTFT / TBT percentiles, hit rate, share within SLO).

A trace line has `timestamp` (ms), `input_length`, `output_length` and `hash_ids` (one per
512-token block, chained: equal ids mean an equal prefix). `PromptBuilder` turns hash ids into
token blocks of `block_tokens`, so requests sharing hash-id prefixes share exactly that token
prefix. A request's TBT is the mean of its longest tenth of gaps after the second token, as the
paper judges it; the gap before the second token (the prefill -> decode hand-off) is held to
TTFT + TBT.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

TRACE_BLOCK = 512  # tokens per hash id in the Mooncake traces
TRACES = Path(__file__).resolve().parents[1] / "traces"
DEFAULT_TRACE = TRACES / "mooncake_sample.jsonl"
SYNTHETIC_TRACE = TRACES / "synthetic_trace.jsonl"


@dataclass(frozen=True)
class TraceRequest:
    """One line of a Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, start: int = 0, max_requests: int | None = None,
               ) -> list[TraceRequest]:
    """Lines `start .. start + max_requests` of a trace file."""
    out: list[TraceRequest] = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < start or not line.strip():
                continue
            if max_requests is not None and len(out) >= max_requests:
                break
            d = json.loads(line)
            out.append(TraceRequest(float(d["timestamp"]), int(d["input_length"]),
                                    int(d["output_length"]), tuple(d.get("hash_ids", ()))))
    return out


class PromptBuilder:
    """Maps hash ids to fixed token blocks: equal hash-id prefixes give equal token prefixes."""

    def __init__(self, block_tokens: int, token_range: tuple[int, int] = (1000, 40000),
                 seed: int = 0) -> None:
        if block_tokens < 1:
            raise ValueError(f"--block-tokens: must be positive, got {block_tokens}")
        self.block_tokens = block_tokens
        self.lo, self.hi = token_range
        self.seed = seed
        self._blocks: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        """The tokens standing for one 512-token trace block."""
        tokens = self._blocks.get(hash_id)
        if tokens is None:
            rnd = random.Random(f"{self.seed}:{hash_id}")
            tokens = [rnd.randrange(self.lo, self.hi) for _ in range(self.block_tokens)]
            self._blocks[hash_id] = tokens
        return tokens

    def length(self, req: TraceRequest) -> int:
        """Prompt tokens of `req` after scaling 512 -> block_tokens (at least 1)."""
        n_blocks = max(1, math.ceil(req.input_length / TRACE_BLOCK))
        last = min(TRACE_BLOCK, req.input_length - TRACE_BLOCK * (n_blocks - 1))
        scaled_last = max(1, round(last * self.block_tokens / TRACE_BLOCK))
        return (n_blocks - 1) * self.block_tokens + scaled_last

    def prompt(self, req: TraceRequest, index: int = 0) -> list[int]:
        """The token ids of `req` (`index` keeps requests without hash ids distinct)."""
        ids = list(req.hash_ids) or [-(index + 1)]
        tokens: list[int] = []
        for h in ids:
            tokens.extend(self.block(h))
        want = self.length(req)
        while len(tokens) < want:  # more input than hash ids cover: pad with private blocks
            tokens.extend(self.block(-(10**9) - index * 1000 - len(tokens)))
        return tokens[:want]


@dataclass
class Outcome:
    """What happened to one request."""

    status: str  # ok | rejected | error
    arrival_s: float = 0.0
    index: int = 0  # the request's place in the replayed slice
    max_tokens: int = 0  # output tokens asked for
    ttft_s: float | None = None
    token_times: list[float] = field(default_factory=list)  # seconds since the request was sent
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    request_id: str = ""  # the server's id (its logs name the request by it)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); nan when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def request_tbt(token_times: Sequence[float]) -> float | None:
    """Mean of the longest 10% of the gaps between tokens the decode made (at least one gap);
    None below 3 tokens: the conductor's own judgement of a request (scheduler/outcomes.py).
    The gap before the second token is the prefill -> decode hand-off, judged on its own
    (`second_token_within`), as it is for every system replayed."""
    from mooncake_server.roles.conductor.scheduler.outcomes import longest_tenth_mean

    return longest_tenth_mean([b - a for a, b in itertools.pairwise(token_times[1:])])


def second_token_within(token_times: Sequence[float], ttft_slo: float, tbt_slo: float) -> bool:
    """The second token (if any) came within TTFT + TBT SLOs of the request being sent."""
    return len(token_times) < 2 or token_times[1] <= ttft_slo + tbt_slo


@dataclass
class Summary:
    """The figures of one configuration's replay."""

    requests: int
    ok: int
    rejected: int
    errors: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    ttft_mean: float
    tbt_p50: float
    tbt_p90: float
    tbt_p99: float
    cache_hit_rate: float
    computed_tokens_per_request: float
    within_slo: float  # effective request capacity: share of all requests within both SLOs
    accepted_within_slo: float  # of the requests not rejected, the share within both SLOs
    prefill_seconds_per_request: float = float("nan")
    wall_s: float = 0.0


def within_slo(o: Outcome, ttft_slo: float, tbt_slo: float) -> bool:
    """Answered, first token within the TTFT SLO, second within TTFT + TBT, TBT (if it has
    one) within the TBT SLO."""
    tbt = request_tbt(o.token_times)
    return (o.status == "ok" and o.ttft_s is not None and o.ttft_s <= ttft_slo
            and second_token_within(o.token_times, ttft_slo, tbt_slo)
            and (tbt is None or tbt <= tbt_slo))


def summarize(outcomes: Sequence[Outcome], ttft_slo: float, tbt_slo: float) -> Summary:
    """Percentiles, hit rate and SLO attainment over `outcomes`."""
    ok = [o for o in outcomes if o.status == "ok"]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    tbts = [t for t in (request_tbt(o.token_times) for o in ok) if t is not None]
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    good = sum(1 for o in outcomes if within_slo(o, ttft_slo, tbt_slo))
    rejected = sum(1 for o in outcomes if o.status == "rejected")
    accepted = len(outcomes) - rejected
    return Summary(
        requests=len(outcomes), ok=len(ok), rejected=rejected,
        errors=sum(1 for o in outcomes if o.status == "error"),
        ttft_p50=percentile(ttfts, 50), ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        ttft_mean=sum(ttfts) / len(ttfts) if ttfts else float("nan"),
        tbt_p50=percentile(tbts, 50), tbt_p90=percentile(tbts, 90), tbt_p99=percentile(tbts, 99),
        cache_hit_rate=cached / prompt if prompt else float("nan"),
        computed_tokens_per_request=(prompt - cached) / len(ok) if ok else float("nan"),
        within_slo=good / len(outcomes) if outcomes else float("nan"),
        accepted_within_slo=good / accepted if accepted else float("nan"))


def request_record(config: str, o: Outcome, ttft_slo: float, tbt_slo: float) -> dict[str, object]:
    """One line of the report's requests.jsonl."""
    return {"config": config, "index": o.index, "arrival_s": round(o.arrival_s, 6),
            "status": o.status, "prompt_tokens": o.prompt_tokens,
            "output_tokens": len(o.token_times), "max_tokens": o.max_tokens,
            "cached_tokens": o.cached_tokens, "ttft_s": o.ttft_s,
            "tbt_s": request_tbt(o.token_times),
            "within_slo": within_slo(o, ttft_slo, tbt_slo), "error": o.error or None,
            "request_id": o.request_id or None}
