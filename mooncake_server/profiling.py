"""`mooncake-server profile`: measure the real model with the project's engine and fit a PerfModel.

Prefill: one forward pass of `n` new tokens after a cached prefix of `p` tokens, over a grid of
(n, p); fit `a·n² + b·n + c + e·n·p`. Decode: one step of `B` sequences, each attending `L`
cached tokens, over a grid of (B, L); fit `d0 + d1·B + d2·B·L`. Each point is the fastest of a few
timed passes after a warm-up (the least disturbed by other processes). The KV pool is a plain bytearray (no transfer engine needed); its
contents are zeros, which costs the same as real KV.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mooncake_server.config import ServerConfig
from mooncake_server.cost_model.perf_model import PerfModel

log = logging.getLogger(__name__)

# NOTE: sized so a default run of the bundled model takes well under a minute on 2 CPU cores;
# prompts above --prefill-chunk (default 2048) run as several passes, so longer ones add nothing.
DEFAULT_PREFILL_NEW = (32, 128, 384, 768, 1536)
DEFAULT_PREFILL_CACHED = (0, 1536)
DEFAULT_DECODE_BATCH = (1, 8, 32)
DEFAULT_DECODE_CONTEXT = (128, 1024)


@dataclass(frozen=True)
class Sample:
    """One measured point: the features and the seconds it took."""

    x: tuple[float, ...]
    seconds: float


def fit_nonnegative(samples: Sequence[Sample], names: Sequence[str]) -> dict[str, float]:
    """Least squares `seconds ≈ Σ coef·x`, dropping terms that come out negative and refitting.

    A negative coefficient is noise (e.g. the n² term of a tiny model); a cost model must never
    predict that more work takes less time.
    """
    import numpy as np

    if len(samples) < len(names):
        raise ValueError(f"need at least {len(names)} samples to fit {', '.join(names)}")
    x = np.array([s.x for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    active = list(range(len(names)))
    coefs = np.zeros(len(names))
    while active:
        # NOTE: relative errors matter (a 10 ms pass and a 2 s pass), so weight by 1/y.
        w = 1.0 / np.maximum(y, 1e-6)
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coefs[:] = 0.0
            coefs[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return {name: float(c) for name, c in zip(names, coefs)}


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: allocator, thread pool, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


class Profiler:
    """Times ModelRunner.step on a PagedKVCache sized for the largest point."""

    def __init__(self, config: ServerConfig, max_tokens: int) -> None:
        import torch

        from mooncake_server.engine.factory import build_runner

        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.block_tokens = config.block_tokens
        probe = config.replace(kv_memory_bytes=1 << 20)
        runner, info = build_runner(probe, bytearray)
        layout = runner.layout
        needed = (layout.blocks_for(max_tokens) + 64) * layout.block_bytes
        runner, info = build_runner(config.replace(kv_memory_bytes=needed), bytearray)
        self.runner = runner
        self.info = info
        self.kv_bytes_per_token = layout.block_bytes // layout.block_tokens
        self.vocab = int(getattr(runner.model.config, "vocab_size", 32000))

    def _seq(self, rid: str, total: int, computed: int):
        from mooncake_server.engine.sequence import Sequence as Seq
        from mooncake_server.wire.jobs import SamplingParams

        ids = [(i * 7919) % (self.vocab - 1000) + 500 for i in range(total)]
        seq = Seq(rid, ids, total, SamplingParams(max_tokens=1, temperature=0.0), total + 1)
        seq.block_ids = self.runner.kv.allocate(self.runner.layout.blocks_for(total))
        seq.num_computed = computed
        return seq

    def prefill_point(self, new: int, cached: int, repeats: int) -> float:
        """Seconds of one forward pass of `new` tokens after `cached` cached ones."""
        from mooncake_server.engine.model_runner import StepItem

        seq = self._seq("p", cached + new, cached)
        try:
            return _time(lambda: self.runner.step([StepItem(seq, new)]), repeats)
        finally:
            self.runner.kv.free(seq.block_ids)

    def decode_point(self, batch: int, context: int, repeats: int) -> float:
        """Seconds of one decode step of `batch` sequences attending `context` tokens each."""
        from mooncake_server.engine.model_runner import StepItem

        seqs = [self._seq(f"d{i}", context + 1, context) for i in range(batch)]
        try:
            return _time(lambda: self.runner.step([StepItem(s, 1) for s in seqs]), repeats)
        finally:
            for s in seqs:
                self.runner.kv.free(s.block_ids)


def profile(config: ServerConfig, *, prefill_new: Sequence[int] = DEFAULT_PREFILL_NEW,
            prefill_cached: Sequence[int] = DEFAULT_PREFILL_CACHED,
            decode_batch: Sequence[int] = DEFAULT_DECODE_BATCH,
            decode_context: Sequence[int] = DEFAULT_DECODE_CONTEXT, repeats: int = 2,
            transfer_bytes_per_s: float | None = None) -> tuple[PerfModel, dict[str, object]]:
    """Measure and fit; returns the model and the raw measurements."""
    max_tokens = max(max(prefill_new) + max(prefill_cached),
                     max(decode_batch) * (max(decode_context) + config.block_tokens))
    prof = Profiler(config, max_tokens)
    pre: list[Sample] = []
    for cached in prefill_cached:
        for new in prefill_new:
            t = prof.prefill_point(new, cached, repeats)
            log.info("prefill new=%d cached=%d: %.1f ms", new, cached, t * 1e3)
            pre.append(Sample((new * new, new, 1.0, new * cached), t))
    dec: list[Sample] = []
    for context in decode_context:
        for batch in decode_batch:
            t = prof.decode_point(batch, context, repeats)
            log.info("decode batch=%d context=%d: %.1f ms", batch, context, t * 1e3)
            dec.append(Sample((1.0, batch, batch * context), t))
    p = fit_nonnegative(pre, ("prefill_a", "prefill_b", "prefill_c", "prefill_e"))
    d = fit_nonnegative(dec, ("decode_d0", "decode_d1", "decode_d2"))
    defaults = PerfModel()
    model = PerfModel(**p, **d, kv_bytes_per_token=prof.kv_bytes_per_token,
                      transfer_bytes_per_s=transfer_bytes_per_s or defaults.transfer_bytes_per_s,
                      model=prof.info.name, block_tokens=config.block_tokens)
    measured: dict[str, object] = {
        "machine": platform.platform(),
        "prefill": [{"new": int(s.x[1]), "cached": int(s.x[3] / s.x[1]), "seconds": s.seconds}
                    for s in pre],
        "decode": [{"batch": int(s.x[1]), "context": int(s.x[2] / s.x[1]), "seconds": s.seconds}
                   for s in dec],
    }
    return model, measured


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    """Flags of `mooncake-server profile` (the model flags are the server's own)."""
    p = argparse.ArgumentParser(
        prog="mooncake-server profile",
        description="Measure prefill and decode times of the model on this machine and write "
                    "the fitted coefficients for the conductor's --profile.")
    p.add_argument("--out", default="profile.json", help="where to write (default profile.json)")
    p.add_argument("--prefill-tokens", type=_ints, default=list(DEFAULT_PREFILL_NEW),
                   help="uncached prompt lengths to time (comma-separated)")
    p.add_argument("--prefill-cached", type=_ints, default=list(DEFAULT_PREFILL_CACHED),
                   help="cached prefix lengths to time them after (comma-separated)")
    p.add_argument("--decode-batch", type=_ints, default=list(DEFAULT_DECODE_BATCH),
                   help="decode batch sizes to time (comma-separated)")
    p.add_argument("--decode-context", type=_ints, default=list(DEFAULT_DECODE_CONTEXT),
                   help="tokens each decoding sequence attends (comma-separated)")
    p.add_argument("--repeats", type=int, default=2, help="timed passes per point (the fastest counts)")
    p.add_argument("--transfer-bandwidth", type=float, default=None,
                   help="store -> engine KV bandwidth to record, bytes/s (default 1e9)")
    return p


def run(args: argparse.Namespace, config: ServerConfig) -> None:
    """`mooncake-server profile`: `args` from build_parser, `config` from the server flags."""
    from mooncake_server.logs import setup_logging

    if args.repeats < 1:
        raise ValueError("--repeats: must be at least 1")
    setup_logging("profile", config.log_level)
    started = time.perf_counter()
    model, measured = profile(
        config, prefill_new=[n for n in args.prefill_tokens if n > 0],
        prefill_cached=args.prefill_cached, decode_batch=[b for b in args.decode_batch if b > 0],
        decode_context=args.decode_context, repeats=args.repeats,
        transfer_bytes_per_s=args.transfer_bandwidth)
    data = json.loads(model.to_json())
    data["measured"] = measured
    Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
    print(f"profiled {model.model} in {time.perf_counter() - started:.1f} s -> {args.out}")
    print(f"prefill_s(n, p) = {model.prefill_a:.3g}·n² + {model.prefill_b:.3g}·n + "
          f"{model.prefill_c:.3g} + {model.prefill_e:.3g}·n·p")
    print(f"decode_step_s(B, ctx) = {model.decode_d0:.3g} + {model.decode_d1:.3g}·B + "
          f"{model.decode_d2:.3g}·ctx")
