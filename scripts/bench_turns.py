#!/usr/bin/env python3
"""What sharing the cores costs `--role all`: a decode and a prefill process taking turns on the
core board, against the same forwards alone and against colocated's one fused forward.

  .venv/bin/python scripts/bench_turns.py [--rows 10] [--context 300] [--chunk 32] [--rounds 3]

Each round runs, in fresh processes of the bundled model (`--dtype auto`):
- alone: a decode step of `--rows` rows at a `--context`-token context, then a prompt pass of
  `--chunk` tokens after a 200-token prefix, each process by itself (`--forwards` each);
- turns: the same two forwards in two processes that take turns through one core board
  (engine/core_budget.py), as `--role all`'s decode and prefill do beside each other;
- fused: one process, one forward of the rows and the chunk together, as `--role colocated`
  runs a prompt chunk beside its decoding rows.
It prints each one's p50 (ms) per round and, over the rounds, the medians of: turns / alone
per forward, and the token gap each design gives those rows when a chunk runs beside them
(turns: decode + pass; colocated: the fused forward). Rounds interleave the three so that all
see the same machine noise.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mooncake_server.engine.model_runner import ModelRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PREFIX = 200


def _runner(board: str | None) -> ModelRunner:
    """A runner of the bundled model in this process, on `board` (None: fixed threads); torch
    is imported here, in the child only."""
    import torch

    from mooncake_server.engine.core_budget import core_budget_for, machine_cores
    from mooncake_server.engine.kv_cache import KVLayout, PagedKVCache
    from mooncake_server.engine.model_runner import ModelRunner, load_model
    from mooncake_server.model_assets import resolve_model

    torch.set_num_threads(machine_cores())
    model = load_model(resolve_model(None), torch.float32, "auto")
    layout = KVLayout.from_model_config(model.config, 16, torch.float32)
    kv = PagedKVCache(layout, num_blocks=1600)
    return ModelRunner(model, kv, core_budget_for(board, None, None))


def _forwards(kind: str, board: str | None, rows: int, context: int, chunk: int,
              forwards: int, ready: mp.Barrier, out: mp.Queue) -> None:
    """Time `forwards` forwards of `kind` (decode, prefill, fused) in this process."""
    from mooncake_server.engine.model_runner import StepItem
    from mooncake_server.engine.sequence import Sequence
    from mooncake_server.wire.jobs import SamplingParams

    runner = _runner(board)
    kv = runner.kv

    def sequence(name: str, computed: int, total: int) -> Sequence:
        seq = Sequence(name, [1000 + (i * 7) % 20000 for i in range(total)], computed,
                       SamplingParams(max_tokens=1), total)
        seq.block_ids = kv.allocate(kv.layout.blocks_for(total))
        runner.step([StepItem(seq, computed)])
        seq.num_computed = computed
        return seq

    decoding = [sequence(f"d{i}", context, context + 8) for i in range(rows)] \
        if kind != "prefill" else []
    prompt = sequence("p", PREFIX, PREFIX + chunk) if kind != "decode" else None

    def items() -> list[StepItem]:
        # The same forward every time: the rows at their context, the chunk after its prefix.
        for seq in decoding:
            seq.num_computed = context
        batch = [StepItem(seq, 1) for seq in decoding]
        if prompt is not None:
            prompt.num_computed = PREFIX
            batch.insert(0, StepItem(prompt, chunk))
        return batch

    ready.wait()
    times = []
    for _ in range(forwards):
        runner.step(items())
        times.append(runner.last_compute_s)
    out.put((kind, statistics.median(times) * 1000))


def run(kinds: list[str], board: str | None, args: argparse.Namespace) -> dict[str, float]:
    """The p50 ms of each kind's forwards, the kinds' processes running at once."""
    ready = mp.Barrier(len(kinds))
    out: mp.Queue = mp.Queue()
    procs = [mp.Process(target=_forwards, args=(k, board, args.rows, args.context, args.chunk,
                                                args.forwards, ready, out)) for k in kinds]
    for p in procs:
        p.start()
    got = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    return got


def main() -> None:
    """Interleave the rounds, print each and the medians."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--forwards", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    mp.set_start_method("spawn")
    from mooncake_server.engine.cpu import cpu_features

    print(f"CPU: {cpu_features().describe()}; {args.rows} rows at {args.context} tokens, "
          f"a {args.chunk}-token chunk after {PREFIX}")
    slow, gaps = [], []
    for r in range(args.rounds):
        alone = {**run(["decode"], None, args), **run(["prefill"], None, args)}
        with tempfile.NamedTemporaryFile(prefix="mooncake-cores-") as board:
            turns = run(["decode", "prefill"], board.name, args)
        fused = run(["fused"], None, args)["fused"]
        print(f"round {r + 1}: alone decode {alone['decode']:.1f} ms, pass {alone['prefill']:.1f}"
              f" ms; taking turns {turns['decode']:.1f} ms, {turns['prefill']:.1f} ms; "
              f"fused {fused:.1f} ms", flush=True)
        slow.append((turns["decode"] + turns["prefill"]) / (alone["decode"] + alone["prefill"]))
        gaps.append((turns["decode"] + turns["prefill"]) / fused)
    print(f"taking turns / alone, per forward: {statistics.median(slow):.2f}x")
    print(f"token gap beside a chunk, --role all / colocated: {statistics.median(gaps):.2f}x")


if __name__ == "__main__":
    main()
