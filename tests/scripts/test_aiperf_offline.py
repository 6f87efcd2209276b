"""scripts/aiperf_offline.py: a hub cache that loads offline under a repo id; the scaled trace."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ao() -> ModuleType:
    spec = importlib.util.spec_from_file_location("aiperf_offline", ROOT / "scripts" /
                                                  "aiperf_offline.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["aiperf_offline"] = module
    spec.loader.exec_module(module)
    return module


def test_tokenizer_loads_by_repo_id_with_the_hub_offline(ao: ModuleType, tiny_model_dir: str,
                                                         tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    snapshot = ao.build_hub_cache(Path(tiny_model_dir), "someorg/tiny", cache)
    assert (snapshot / "tokenizer.json").is_symlink()
    assert not (snapshot / "model.safetensors").exists()  # tokenizer files only, never weights
    ao.build_hub_cache(Path(tiny_model_dir), "someorg/tiny", cache)  # a second run is harmless
    # A fresh process: huggingface_hub reads HF_HUB_OFFLINE once, at import.
    code = ("from transformers import AutoTokenizer; "
            "print(AutoTokenizer.from_pretrained('someorg/tiny')('hello world')['input_ids'])")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache),
           "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    from transformers import AutoTokenizer

    assert json.loads(out.stdout.strip().splitlines()[-1]) == \
        AutoTokenizer.from_pretrained(tiny_model_dir)("hello world")["input_ids"]
    with pytest.raises(ValueError, match="--repo-id"):
        ao.build_hub_cache(Path(tiny_model_dir), "no-org", cache)


def test_scaled_trace_keeps_hash_ids_and_shrinks_lengths(ao: ModuleType, tmp_path: Path) -> None:
    src = tmp_path / "t.jsonl"
    src.write_text("\n".join(json.dumps(d) for d in [
        {"timestamp": 1000, "input_length": 1100, "output_length": 500, "hash_ids": [1, 2, 3]},
        {"timestamp": 3000, "input_length": 100, "output_length": 5, "hash_ids": [1]}]) + "\n")
    out = tmp_path / "out" / "trace.jsonl"
    assert ao.write_scaled_trace(src, out, 0, 10, 16, 32, 2.0) == 2
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # 2 full blocks of 16 + the last 76 of 512 tokens scaled to 2; timestamps from 0, gaps x2.
    assert rows == [{"timestamp": 0, "input_length": 34, "output_length": 32,
                     "hash_ids": [1, 2, 3]},
                    {"timestamp": 4000, "input_length": 3, "output_length": 5, "hash_ids": [1]}]


def test_command_replays_the_trace_on_its_timestamps(ao: ModuleType) -> None:
    args = ao.build_parser().parse_args(["--aiperf-arg=--request-count=5"])
    cmd = ao.aiperf_command("aiperf", args, Path("x.jsonl"))
    flags = dict(zip(cmd, cmd[1:], strict=False))
    assert flags["--custom-dataset-type"] == "mooncake_trace" and flags["--isl-block-size"] == "16"
    assert flags["--tokenizer"] == ao.DEFAULT_REPO_ID and "--fixed-schedule" in cmd
    assert "ignore_eos:true" in cmd and cmd[-1] == "--request-count=5"
