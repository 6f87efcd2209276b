"""Which kernel `--dtype auto`'s linears run: a function of the CPU's flags and the weights only.

Earlier, each start timed float32, bf16 and int8 kernels and handed over from one to another by
the rows of a call. That made the default mode's greedy answer depend on one start's timing
noise, on the CPU model, and on how many requests shared a step (a hand-over changes rounding),
and the int8-activation kernels kept float32's top token only ~97.6% of the time.

Now `auto` runs one kernel at every row count, picked by a fixed order among those the CPU
runs: the weight-only int8 kernel (w8_linear.py: int8 weights in groups of 32, float32
activations, summed in one fixed order) wherever AVX2 and FMA exist, else plain float32. Two
starts, any batch, and every role of a cluster run the same arithmetic, and the kernel's
results agree across x86-64 CPUs. The kernels that quantize activations (int8, int8-vnni) or
round them to bf16 stay selectable by hand; `scripts/bench_quality.py` says why auto does not
pick them (docs/engine.md). Each start still checks the chosen kernel against float32 on the
model's own weights, with fixed inputs, and falls back to float32 where it disagrees (a kernel
or CPU bug must cost speed, never answers).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from mooncake_server.engine.cpu import CpuFeatures
from mooncake_server.engine.linears import KERNELS
from mooncake_server.engine.w8_linear import w8_built

log = logging.getLogger(__name__)

# auto's kernels, best first: the first one the CPU runs and that agrees with float32 is used.
AUTO_ORDER = ("int8-weights", "float32")
# Relative L2 error of a kernel's output against float32's on fixed random inputs. Measured on
# SmolLM2's linears: int8-weights 1e-7 (its 4-bit levels land on exact bytes), on random
# weights ~0.4%; int8 activations 1.5-3%; a broken kernel is off by ~100%.
MAX_KERNEL_ERROR = 0.1
CHECK_ROWS = (1, 256)


class AutoChoice(NamedTuple):
    """The kernel auto runs, and why."""

    kernel: str
    reason: str


def runs_on(kernel: str, cpu: CpuFeatures) -> bool:
    """Whether `cpu`'s flags (and this build) run `kernel`: read from the flags, not probed, so
    a test can present another CPU's flags."""
    if kernel == "int8-weights":
        return cpu.avx2_fma and w8_built()
    return kernel == "float32"


def auto_candidates(cpu: CpuFeatures) -> list[str]:
    """auto's kernels that `cpu` runs, best first (float32 always last)."""
    return [k for k in AUTO_ORDER if runs_on(k, cpu)]


def _sampled(linears: Sequence[nn.Linear], sample: int) -> list[nn.Linear]:
    """Every k-th linear, at most `sample`: spans the model as a forward does."""
    step = max(1, len(linears) // sample)
    return list(linears)[::step][:sample]


def kernel_errors(linears: Sequence[nn.Linear], kernels: Sequence[str],
                  rows: Sequence[int] = CHECK_ROWS, sample: int = 8) -> dict[str, float]:
    """Each kernel's worst relative error against float32 over sampled linears and row counts,
    on inputs drawn from a fixed seed (the same verdict on every start)."""
    errors: dict[str, float] = {}
    with torch.inference_mode():
        for k in kernels:
            worst, gen = 0.0, torch.Generator().manual_seed(0)
            for lin in _sampled(linears, sample):
                built = KERNELS[k](lin)
                for m in rows:
                    x = torch.randn(m, lin.in_features, generator=gen)
                    ref = lin(x)
                    err = float((built(x) - ref).norm() / ref.norm().clamp_min(1e-30))
                    worst = max(worst, math.inf if math.isnan(err) else err)
            errors[k] = worst
    return errors


def auto_kernel(cpu: CpuFeatures, linears: Sequence[nn.Linear]) -> AutoChoice:
    """The first of auto's kernels that `cpu` runs and that agrees with float32 on `linears`."""
    for kernel in auto_candidates(cpu):
        if kernel == "float32":
            break
        error = kernel_errors(linears, [kernel])[kernel]
        if error <= MAX_KERNEL_ERROR:
            return AutoChoice(kernel, f"{kernel} (relative error {error:.1e} against float32)")
        log.warning("linear kernel %s disagrees with float32 (relative error %.3g): not used",
                    kernel, error)
    why = "no AVX2+FMA" if not cpu.avx2_fma else "the int8-weights kernel was not used"
    return AutoChoice("float32", f"float32 ({why})")
