#!/usr/bin/env python3
"""A lone decode step of the default mode against the machine's memory bound, in one process.

  .venv/bin/python scripts/bench_decode_step.py [--context 256] [--steps 240]

Builds the bundled model twice in `--dtype auto`: as served now (Q4_1 linears in 4 bits, native
RMSNorm, native decode attention) and as before them (grouped int8 linears, torch's RMSNorm,
the gathered decode attention), then alternates one-token steps of one sequence at a
`--context`-token context between the two (20 at a time, so both see the same machine noise).
Prints each one's step p50, the bytes a step reads (every linear's packed weights, scales,
offsets and biases; the norms' weights; the context's K and V), the memory bandwidth measured
here (the best of 5 sums over a 1 GiB buffer, all threads: a read-only stream), and what share
of the step reading those bytes at that bandwidth would take.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mooncake_server.engine import llama_stack  # noqa: E402
from mooncake_server.engine import w8_linear as w8  # noqa: E402
from mooncake_server.engine.cpu import cpu_features  # noqa: E402
from mooncake_server.engine.kv_cache import KVLayout, PagedKVCache  # noqa: E402
from mooncake_server.engine.model_runner import ModelRunner, StepItem, load_model  # noqa: E402
from mooncake_server.engine.sequence import Sequence  # noqa: E402
from mooncake_server.model_assets import resolve_model  # noqa: E402
from mooncake_server.wire.jobs import SamplingParams  # noqa: E402

BLOCK_TOKENS = 16


def build(path: str, now: bool, context: int, steps: int) -> tuple[ModelRunner, Sequence]:
    """A runner as served now (`now`) or as before the decode-step work, and one sequence
    whose `context` tokens are computed, with blocks for `steps` more."""
    four_bit, fits = w8.four_bit_groups, llama_stack.row_norm_fits
    if not now:  # the earlier forward: bytes for every linear, torch's norm
        w8.four_bit_groups = lambda weight: None
        llama_stack.row_norm_fits = lambda weight: False
    try:
        model = load_model(path, torch.float32, "auto")
        layout = KVLayout.from_model_config(model.config, BLOCK_TOKENS, torch.float32)
        kv = PagedKVCache(layout, num_blocks=layout.blocks_for(context + steps) + 1)
        runner = ModelRunner(model, kv)
    finally:
        w8.four_bit_groups, llama_stack.row_norm_fits = four_bit, fits
    runner.native_decode = runner.native_decode and now
    total = context + steps
    seq = Sequence("step", [1000 + i % 20000 for i in range(total)], context,
                   SamplingParams(max_tokens=1), total)
    seq.block_ids = kv.allocate(layout.blocks_for(total))
    runner.step([StepItem(seq, context)])
    seq.num_computed = context
    return runner, seq


def step_bytes(runner: ModelRunner, context: int) -> int:
    """Bytes a one-token step reads: the linears' buffers, the norms' weights, K and V."""
    model = runner.model
    linears = sum(b.numel() * b.element_size() for m in model.modules()
                  if isinstance(m, w8.W8Linear) for b in m.buffers())
    norms = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                if "norm" in name)
    lay = runner.layout
    kv = context * lay.num_layers * 2 * lay.kv_heads * lay.head_dim * 4
    return linears + norms + kv


def bandwidth() -> float:
    """Bytes per second of a read-only pass over 1 GiB (the best of 5)."""
    buf = torch.ones(1 << 28)
    buf.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best


def main() -> None:
    """Build both, alternate their steps, print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=240, help="steps timed per forward")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(None)
    print(f"CPU: {cpu_features().describe()}; {args.threads} threads; context {args.context}")
    forwards = {"before": build(path, False, args.context, args.steps),
                "now": build(path, True, args.context, args.steps)}
    times: dict[str, list[float]] = {k: [] for k in forwards}
    for _ in range(args.steps // 20):
        for name, (runner, seq) in forwards.items():
            for _ in range(20):
                t = time.perf_counter()
                runner.step([StepItem(seq, 1)])
                times[name].append(time.perf_counter() - t)
                seq.num_computed += 1
    bw = bandwidth()
    print(f"memory bandwidth (read): {bw / 1e9:.1f} GB/s")
    print(f"{'forward':<8}{'step p50':>10}{'MB read':>9}{'at bandwidth':>14}{'share':>7}")
    for name, (runner, _) in forwards.items():
        step = statistics.median(times[name])
        nbytes = step_bytes(runner, args.context + args.steps // 2)
        floor = nbytes / bw
        print(f"{name:<8}{step * 1e3:>8.2f}ms{nbytes / 1e6:>9.1f}{floor * 1e3:>12.2f}ms"
              f"{floor / step:>7.0%}")
    ratio = statistics.median(times["now"]) / statistics.median(times["before"])
    print(f"now / before: {ratio:.2f}x")


if __name__ == "__main__":
    main()
