"""The fitted cost model of one engine on one machine: prefill and decode-step times, KV transfer.

`mooncake-server profile` measures the real model and writes these coefficients as JSON; the
conductor loads them with `--profile PATH` (built-in defaults otherwise):

    prefill_s(new, cached) = a·new² + b·new + c + e·new·cached     (new = uncached prompt tokens)
    decode_step_s(batch, context) = d0 + d1·batch + d2·context     (context = tokens attended)
    transfer_s(tokens) = tokens · kv_bytes_per_token / transfer_bytes_per_s
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROFILE_VERSION = 1


@dataclass(frozen=True)
class PerfModel:
    """Coefficients of the prefill, decode and transfer time models (seconds, bytes)."""

    # Defaults: the bundled SmolLM2-135M (float32) measured on 2 CPU cores by `profile`.
    prefill_a: float = 1.0e-7  # s per new token², attention over the new tokens themselves
    prefill_b: float = 1.0e-3  # s per new token, the linear layers
    prefill_c: float = 0.05  # s per forward pass, fixed overhead
    prefill_e: float = 6.0e-7  # s per (new token × cached token), attention over the prefix
    decode_d0: float = 0.033  # s per decode step, fixed overhead
    decode_d1: float = 3.0e-3  # s per sequence in the batch
    decode_d2: float = 7.5e-6  # s per context token attended in the step
    kv_bytes_per_token: int = 46080  # SmolLM2-135M in float32: 30 layers × 2 × 3 heads × 64 × 4
    transfer_bytes_per_s: float = 1.0e9  # store -> engine KV bandwidth (a 10 GbE-class link)
    model: str = "default"
    block_tokens: int = 16

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"--profile: {f.name} must not be negative, got {value}")
        if self.transfer_bytes_per_s <= 0:
            raise ValueError("--profile: transfer_bytes_per_s must be positive")

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to compute `new_tokens` prompt tokens after `cached_tokens` of cached prefix."""
        if new_tokens <= 0:
            return 0.0
        n, p = float(new_tokens), float(cached_tokens)
        return self.prefill_a * n * n + self.prefill_b * n + self.prefill_c + self.prefill_e * n * p

    def pass_s(self, items: Sequence[tuple[int, int]]) -> float:
        """Seconds of one forward pass over several prompts' chunks, each `(new, cached)`
        tokens: the fixed cost once, and each prompt its own tokens and its own attention
        (a packed pass attends within each prompt, so its n² terms add per prompt)."""
        parts = [(n, p) for n, p in items if n > 0]
        if not parts:
            return 0.0
        return self.prefill_c + sum(self.prefill_s(n, p) - self.prefill_c for n, p in parts)

    def chunked_prefill_s(self, new_tokens: int, cached_tokens: int,
                          chunk_tokens: int) -> tuple[float, int]:
        """Seconds to compute `new_tokens` in passes of at most `chunk_tokens` (each pass
        attends the prefix before it as cached), and the number of passes."""
        if new_tokens <= 0:
            return 0.0, 0
        c = max(1, chunk_tokens)
        full, rest = divmod(new_tokens, c)
        # The full passes in closed form: pass i attends cached_tokens + i*c tokens before it.
        prefix = full * cached_tokens + c * full * (full - 1) / 2
        total = full * self.prefill_s(c) + self.prefill_e * c * prefix if full else 0.0
        total += self.prefill_s(rest, cached_tokens + full * c)
        return total, full + (1 if rest else 0)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """Seconds of one decode step over `batch` sequences attending `context_tokens` in all."""
        if batch <= 0:
            return 0.0
        return self.decode_d0 + self.decode_d1 * batch + self.decode_d2 * context_tokens

    def transfer_s(self, tokens: int) -> float:
        """Seconds to move the KV of `tokens` tokens from the store into an engine."""
        return max(0, tokens) * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def to_json(self) -> str:
        """The profile file's contents."""
        return json.dumps({"version": PROFILE_VERSION, **dataclasses.asdict(self)}, indent=2)

    def save(self, path: str | Path) -> None:
        """Write the profile file."""
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PerfModel:
        """Build from a parsed profile file; unknown or missing fields are errors / defaults."""
        version = data.get("version", PROFILE_VERSION)
        if version != PROFILE_VERSION:
            raise ValueError(f"--profile: unsupported profile version {version!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known - {"version", "measured"})
        if unknown:
            raise ValueError(f"--profile: unknown field(s) {', '.join(unknown)}")
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def load(cls, path: str | Path) -> PerfModel:
        """Read a profile file written by `mooncake-server profile`."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--profile: cannot read {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"--profile: {path} must hold a JSON object")  # noqa: TRY004
        return cls.from_dict(data)
