#!/usr/bin/env python3
"""Replay a Mooncake-format trace with NVIDIA's aiperf against mooncake-server, with no network.

  .venv/bin/python scripts/aiperf_offline.py --max-requests 20            # print the command
  .venv/bin/python scripts/aiperf_offline.py --max-requests 20 --run \\
      --aiperf /path/to/aiperf-venv/bin/aiperf

aiperf synthesizes each request's prompt from the trace's hash ids with a HuggingFace tokenizer.
Given a local folder it trips over the hub's repo-id check when HF_HUB_OFFLINE=1 is set, and
without that it tries the network; `--tokenizer builtin` downloads a tiktoken file. A tokenizer
that sits in a local hub cache under a repo-id name loads offline like any cached model, so this
script lays the model folder's tokenizer files out as such a cache (symlinks,
`models--ORG--NAME/snapshots/<rev>/` and `refs/main`) and points HF_HUB_CACHE at it.
The trace slice is rewritten for a small model as scripts/replay_trace.py replays it: a 512-token
hash-id block becomes `--block-tokens` tokens (aiperf gets the same block size), outputs are
capped, and arrival gaps are multiplied by `--time-scale`. aiperf lives in a venv of its own: its
dependencies must not move this project's transformers or torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mooncake_bench.trace import DEFAULT_TRACE, PromptBuilder, load_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "mooncake-server" / "models" / "SmolLM2-135M-Instruct"
DEFAULT_REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The tokenizer's files and what AutoTokenizer reads beside them to pick its class; never weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "config.json", "generation_config.json", "vocab.json",
                   "merges.txt", "tokenizer.model")
LOCAL_REVISION = "0" * 40  # any 40-hex name: nothing is ever fetched for it


def build_hub_cache(model_dir: Path, repo_id: str, cache: Path) -> Path:
    """Lay `model_dir`'s tokenizer out as `repo_id` in a hub cache at `cache`; its snapshot dir."""
    if repo_id.count("/") != 1:
        raise ValueError(f"--repo-id: want ORG/NAME, got {repo_id!r}")
    if not (model_dir / "tokenizer.json").exists() and not (model_dir / "vocab.json").exists():
        raise ValueError(f"--model-dir: no tokenizer files in {model_dir}")
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / LOCAL_REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(LOCAL_REVISION)
    for name in TOKENIZER_FILES:
        source, link = model_dir / name, snapshot / name
        if source.exists():
            link.unlink(missing_ok=True)
            link.symlink_to(source.resolve())
    return snapshot


def write_scaled_trace(trace_path: Path, out: Path, start: int, max_requests: int,
                       block_tokens: int, max_output: int, time_scale: float) -> int:
    """The slice in Mooncake format, lengths in `block_tokens` blocks; the requests written."""
    trace = load_trace(trace_path, start, max_requests)
    builder = PromptBuilder(block_tokens)
    t0 = trace[0].timestamp_ms if trace else 0.0
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for req in trace:
            f.write(json.dumps({"timestamp": round((req.timestamp_ms - t0) * time_scale),
                                "input_length": builder.length(req),
                                "output_length": max(1, min(req.output_length, max_output)),
                                "hash_ids": list(req.hash_ids)}) + "\n")
    return len(trace)


def aiperf_command(aiperf: str, args: argparse.Namespace, trace: Path) -> list[str]:
    """aiperf profile, replaying `trace` on its timestamps against the completions endpoint."""
    return [aiperf, "profile", "--model-names", args.model, "--tokenizer", args.repo_id,
            "--url", args.url, "--endpoint-type", "completions", "--streaming",
            "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace",
            "--isl-block-size", str(args.block_tokens), "--fixed-schedule",
            "--fixed-schedule-auto-offset",
            # Exact output lengths, as the trace asks; greedy so reruns compute the same work.
            "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
            "--random-seed", str(args.seed), "--artifact-dir", str(args.artifacts),
            "--ui-type", "none", *args.aiperf_arg]


def build_parser() -> argparse.ArgumentParser:
    """The script's flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--aiperf", default="aiperf", help="aiperf executable (its own venv's)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="mooncake-server base URL")
    p.add_argument("--model", default="SmolLM2-135M-Instruct",
                   help="model name sent in requests (mooncake-server's /v1/models id)")
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                   help="local model folder whose tokenizer aiperf should use")
    p.add_argument("--repo-id", default=DEFAULT_REPO_ID,
                   help="the hub name the tokenizer is cached under (ORG/NAME)")
    p.add_argument("--cache", type=Path, default=ROOT / ".cache" / "aiperf-hub",
                   help="where to lay out the hub cache")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake trace (JSON lines)")
    p.add_argument("--start", type=int, default=0, help="first trace line")
    p.add_argument("--max-requests", type=int, default=20, help="requests to replay (20)")
    p.add_argument("--block-tokens", type=int, default=16,
                   help="tokens standing for one 512-token hash-id block (16)")
    p.add_argument("--max-output-tokens", type=int, default=32, help="output cap (32)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply the trace's arrival gaps (2 = half the rate; default 1)")
    p.add_argument("--seed", type=int, default=0, help="aiperf's prompt synthesis seed")
    p.add_argument("--artifacts", type=Path, default=Path("aiperf-artifacts"),
                   help="aiperf's output folder")
    p.add_argument("--aiperf-arg", action="append", default=[],
                   help="extra flag for aiperf profile (repeat)")
    p.add_argument("--run", action="store_true", help="run aiperf (default: print the command)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Build the cache and the scaled trace, then print or run the aiperf command."""
    args = build_parser().parse_args(argv)
    build_hub_cache(args.model_dir, args.repo_id, args.cache)
    trace = args.artifacts / "trace.jsonl"
    n = write_scaled_trace(args.trace, trace, args.start, args.max_requests, args.block_tokens,
                           args.max_output_tokens, args.time_scale)
    if not n:
        raise SystemExit("no requests in the selected trace slice")
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(args.cache.resolve()),
           "TRANSFORMERS_OFFLINE": "1"}
    cmd = aiperf_command(args.aiperf, args, trace)
    print(f"{n} requests of {args.trace} -> {trace}", file=sys.stderr)
    print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
    if not args.run:
        return 0
    return subprocess.run(cmd, env={**os.environ, **env}).returncode


if __name__ == "__main__":
    sys.exit(main())
