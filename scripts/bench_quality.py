#!/usr/bin/env python3
"""How much each linear kernel moves the default model from float32, on a public-domain text.

  .venv/bin/python scripts/bench_quality.py [--modes auto,int8,...] [--quick] [--json PATH]

Every mode (each kernel of linears.KERNELS, `auto`, the server's default kernel in HF's modules,
and `served`, the engine's whole default forward as it serves: its norms, decode attention and
linears) is scored against
float32 on fixed windows of The Devil's Dictionary (mooncake_testkit/data): perplexity and its
ratio to float32's, mean and p99 KL(float32 || mode) per position, top-1 agreement; then greedy
continuations of prompts from the same text, counted identical to float32's or not. Kernels
this CPU lacks are scored by torch emulations of their rounding ("emulated"). The last line
checks auto's targets (mooncake_testkit/quality.py).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from typing import Any

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from mooncake_server.engine.cpu import cpu_features
from mooncake_server.engine.linears import KERNELS
from mooncake_server.model_assets import resolve_model
from mooncake_testkit import quality as q

REFERENCE = "float32"


def parse_args() -> argparse.Namespace:
    """Flags; --quick overrides the sizes."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--model", default=None, help="HF model folder (default: the bundled model)")
    p.add_argument("--modes", default=",".join([*KERNELS, "auto", "served"]),
                   help="comma-separated modes (float32, the reference, is always scored)")
    # Defaults sized to ~15 minutes on 2 cores (AVX2 EPYC): 40 x 511 = 20,440 scored positions;
    # 16 prompts (not 64) because greedy decoding of 7 modes dominates the time otherwise.
    p.add_argument("--windows", type=int, default=40, help="teacher-forced windows")
    p.add_argument("--window-len", type=int, default=512, help="tokens per window")
    p.add_argument("--prompts", type=int, default=16, help="greedy prompts (0: skip greedy)")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--quick", action="store_true",
                   help="4 windows of 256 tokens, 8 prompts of 16 greedy tokens")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--json", default=None, help="write every number to this file")
    args = p.parse_args()
    if args.quick:
        args.windows, args.window_len, args.prompts, args.tokens = 4, 256, 8, 16
    return args


def main() -> None:
    """Build every mode, score it against float32, print the table and auto's targets."""
    args = parse_args()
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    modes = [REFERENCE] + [m for m in args.modes.split(",") if m and m != REFERENCE]
    path = args.model or resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokens = q.load_text_tokens(tokenizer)
    wins = q.windows(tokens, args.window_len, args.windows)
    prompts = q.prompts_from_text(tokens, args.prompts, args.prompt_len) if args.prompts else []

    # Every mode's model is held at once (~0.5 GB each) so that the reference's log-probs of a
    # window are computed once and dropped: all windows' would be vocab x positions floats
    # (~5 GB by default), one window's are ~100 MB.
    models: dict[str, torch.nn.Module] = {}
    emulated: dict[str, bool] = {}
    for mode in tqdm(modes, desc="build modes", unit="mode"):
        models[mode], emulated[mode] = q.build_mode(path, mode)
    print(f"CPU: {cpu_features().describe()}")
    print(f"torch {torch.__version__}, {args.threads} threads")
    if "auto" in models:
        print(f"auto: {models['auto'].linears_note}")
    for mode in modes:
        if mode != "auto":
            print(f"{mode}: {models[mode].linears_note}")
    print(f"text: {len(tokens)} tokens; {len(wins)} windows of {args.window_len}; "
          f"{len(prompts)} prompts of {args.prompt_len} + {args.tokens} greedy tokens")

    stats: dict[str, list[q.PositionStats]] = {m: [] for m in modes}
    with tqdm(total=len(wins) * len(modes), desc="teacher-forced", unit="fwd") as bar:
        for window in wins:
            ref = q.teacher_forced(models[REFERENCE], [window])[0]
            stats[REFERENCE].append(q.position_stats(ref, ref, window))
            bar.update()
            for mode in modes[1:]:
                lp = q.teacher_forced(models[mode], [window])[0]
                stats[mode].append(q.position_stats(ref, lp, window))
                del lp
                bar.update()
            del ref
    scores = {m: q.summarize(s) for m, s in stats.items()}

    greedy: dict[str, list[list[int]]] = {m: [] for m in modes}
    with tqdm(total=len(prompts) * len(modes), desc="greedy", unit="prompt") as bar:
        for mode in modes:
            for prompt in prompts:
                greedy[mode] += q.greedy_continuations(models[mode], tokenizer, [prompt],
                                                       args.tokens)
                bar.update()
    identical = {m: sum(a == b for a, b in zip(greedy[m], greedy[REFERENCE])) for m in modes}
    prefix = {m: [common_prefix(a, b) for a, b in zip(greedy[m], greedy[REFERENCE])]
              for m in modes}
    elapsed = time.monotonic() - started

    print()
    print("| mode | kernels | perplexity | ppl ratio | mean KL | p99 KL | top-1 agree % "
          "| greedy identical |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in modes:
        s = scores[mode]
        print(f"| {mode} | {'emulated' if emulated[mode] else 'native'} | {s.perplexity:.4f} "
              f"| {s.ppl_ratio:.4f} | {s.mean_kl:.3g} | {s.p99_kl:.3g} "
              f"| {100 * s.top1_agree:.2f} | {identical[mode]}/{len(prompts)} |")
    print(f"\n{scores[REFERENCE].positions} positions per mode; KL(float32 || mode) in nats; "
          f"{elapsed:.0f} s")
    targets = q.auto_targets(scores["auto"]) if "auto" in scores else {}
    if targets:
        print("auto targets: " + "; ".join(f"{name} {'PASS' if ok else 'FAIL'}"
                                           for name, ok in targets.items()))
    if args.json:
        report: dict[str, Any] = {
            "cpu": cpu_features().describe(), "torch": torch.__version__,
            "threads": args.threads, "elapsed_s": elapsed, "text_tokens": len(tokens),
            "windows": len(wins), "window_len": args.window_len, "prompts": len(prompts),
            "prompt_len": args.prompt_len, "greedy_tokens": args.tokens,
            "auto_targets": targets,
            "modes": {m: {"emulated": emulated[m], "kernels": models[m].linears_note,
                          **asdict(scores[m]), "greedy_identical": identical[m],
                          "greedy_mean_common_prefix": (sum(prefix[m]) / len(prefix[m])
                                                        if prefix[m] else None)}
                      for m in modes}}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two continuations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


if __name__ == "__main__":
    main()
