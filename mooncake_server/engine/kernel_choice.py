"""Which linear kernel is fastest on this CPU, by rows per call: timed once, remembered.

`--dtype auto` runs float32 activations and lets each linear use another kernel inside: bf16
(oneDNN, prepacked) where the CPU multiplies bf16 in hardware, int8 (fbgemm) where its vector
units allow. Which wins depends on the part and on the call: on the 2-core AMX machine here
oneDNN's bf16 GEMV reads weights at 13-17 GB/s against fp32's ~22, so one-token steps go
fastest in int8, while prompt passes run many times faster in bf16. So the kernels are timed on
the model's own weights at a few row counts, and the result is kept in the cache directory
(keyed by CPU, torch version and weight shapes): every later start, and every process of a
cluster on this machine, uses the same choice without timing again. Timings that do not agree
with themselves (a busy machine) are not trusted: the CPU flags' default is used and nothing
is remembered. Each start also checks the kernels chosen against float32 on the model's own
weights, at the team size its passes run with, and drops one that does not agree (a kernel or
CPU bug must cost speed, never answers).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from mooncake_server.engine.cpu import CpuFeatures
from mooncake_server.engine.linears import KERNELS, bf16_packing_supported
from mooncake_server.engine.vnni_linear import vnni_supported

log = logging.getLogger(__name__)

CHOICE_VERSION = 1
ROWS = (1, 4, 16, 64, 256)
# Relative L2 error of a kernel's output against float32's on random inputs. Measured on
# SmolLM2's linears: int8 1.5-3%, bf16 well under 1%; a broken kernel is off by ~100%.
MAX_KERNEL_ERROR = 0.1


@dataclass(frozen=True)
class KernelChoice:
    """Which kernel a float32 model's linears run, by rows per call; and the timing behind it."""

    small: str
    large: str
    up_to: int  # rows up to which `small` runs
    relative: dict[str, dict[int, float]]  # kernel -> rows -> time relative to the first kernel
    # False: two timings disagreed (a busy machine), so the choice is the CPU flags' default
    # and is not remembered.
    trusted: bool = True

    def describe(self) -> str:
        """A log line: the choice, then each kernel's time relative to float32 per row count."""
        table = "; ".join(f"{k} " + " ".join(f"{m}:{r:.2f}" for m, r in sorted(v.items()))
                          for k, v in self.relative.items())
        pick = (self.small if self.small == self.large
                else f"{self.small} up to {self.up_to} rows, {self.large} above")
        how = "" if self.trusted else ", timings disagreed: the CPU flags' default"
        return f"{pick}{how} (time vs {next(iter(self.relative))} by rows: {table})"


def choose_kernels(relative: dict[str, dict[int, float]]) -> KernelChoice:
    """The fastest kernel at the fewest and at the most rows, and where one hands over to the other.

    `up_to` is the largest measured row count up to which the one-row winner is never slower
    than the many-row winner.
    """
    rows = sorted(next(iter(relative.values())))
    small = min(relative, key=lambda k: relative[k][rows[0]])
    large = min(relative, key=lambda k: relative[k][rows[-1]])
    up_to = rows[-1] if small == large else rows[0]
    if small != large:
        for m in rows:
            if relative[small][m] > relative[large][m]:
                break
            up_to = m
    return KernelChoice(small, large, up_to, relative)


def kernel_candidates(cpu: CpuFeatures) -> list[str]:
    """The kernels worth timing on `cpu`: bf16 only with bf16 hardware (else ~100x slower)."""
    kernels = ["float32"]
    if cpu.bf16 and bf16_packing_supported():
        kernels.append("bfloat16")
    if cpu.int8 and "fbgemm" in torch.backends.quantized.supported_engines:
        kernels.append("int8")
    if cpu.vnni and vnni_supported():
        kernels.append("int8-vnni")
    return kernels


def _in_features(m: nn.Module) -> int:
    """Input width of a float, packed or quantized linear."""
    in_features = getattr(m, "in_features", None)
    if in_features is None:  # torch.ao's dynamic linear keeps it in its weight
        in_features = m.weight().shape[1]  # type: ignore[operator]
    return int(in_features)


def _sampled(linears: Sequence[nn.Linear], sample: int) -> list[nn.Linear]:
    """Every k-th linear, at most `sample`: spans the model as a forward does."""
    step = max(1, len(linears) // sample)
    return list(linears)[::step][:sample]


def kernel_errors(linears: Sequence[nn.Linear], kernels: Sequence[str],
                  rows: Sequence[int] = (1, ROWS[-1]), sample: int = 8) -> dict[str, float]:
    """Each kernel's worst relative error against float32 over sampled linears and row counts."""
    errors: dict[str, float] = {}
    with torch.inference_mode():
        for k in kernels:
            worst = 0.0
            for lin in _sampled(linears, sample):
                built = KERNELS[k](lin)
                for m in rows:
                    x = torch.randn(m, lin.in_features)
                    ref = lin(x)
                    err = float((built(x) - ref).norm() / ref.norm().clamp_min(1e-30))
                    worst = max(worst, math.inf if math.isnan(err) else err)
            errors[k] = worst
    return errors


def faithful_choice(choice: KernelChoice, errors: dict[str, float]) -> KernelChoice:
    """`choice` without the kernels whose error exceeds MAX_KERNEL_ERROR (NaN counts as inf)."""
    bad = {k for k, e in errors.items() if e > MAX_KERNEL_ERROR}
    if not bad:
        return choice
    log.warning("linear kernels %s disagree with float32 (relative error %s): not used",
                sorted(bad), {k: round(errors[k], 3) for k in sorted(bad)})
    # float32 is the reference (error 0): it is always kept.
    kept = {k: v for k, v in choice.relative.items() if k not in bad}
    return replace(choose_kernels(kept), trusted=choice.trusted)


def _best_call_times(kernels: Sequence[nn.Module], rows: int, reps: int) -> list[float]:
    """Each kernel's best call time on `rows` rows over `reps` rounds.

    Each round walks all kernels, so a weight has left the cache by the time it is read again,
    as in a forward.
    """
    inputs = {n: torch.randn(rows, n) for n in {_in_features(m) for m in kernels}}
    best = [float("inf")] * len(kernels)
    with torch.inference_mode():
        for m in kernels:  # first calls set up oneDNN/fbgemm state: not what a step pays
            m(inputs[_in_features(m)])
        for _ in range(reps):
            for i, m in enumerate(kernels):
                x = inputs[_in_features(m)]
                start = time.perf_counter()
                m(x)
                best[i] = min(best[i], time.perf_counter() - start)
    return best


def _relative_times(built: dict[str, list[nn.Module]], rows: Sequence[int],
                    reps: int) -> dict[str, dict[int, float]]:
    """Each kernel's median time ratio to the first kernel's, per row count."""
    kernels = list(built)
    relative: dict[str, dict[int, float]] = {k: {} for k in kernels}
    for m in rows:
        times = {k: _best_call_times(built[k], m, reps) for k in kernels}
        ref = times[kernels[0]]
        for k in kernels:
            relative[k][m] = statistics.median(t / r for t, r in zip(times[k], ref))
    return relative


def default_choice(kernels: Sequence[str], relative: dict[str, dict[int, float]]) -> KernelChoice:
    """What the CPU flags suggest when timings cannot be trusted (measured on an AMX part)."""
    small = next((k for k in ("int8-vnni", "int8") if k in kernels), "float32")
    large = "bfloat16" if "bfloat16" in kernels else small
    return KernelChoice(small, large, 4 if small != large else max(ROWS), relative, False)


def measure_kernels(linears: Sequence[nn.Linear], kernels: Sequence[str],
                    rows: Sequence[int] = ROWS, sample: int = 16, reps: int = 3) -> KernelChoice:
    """Time each kernel on up to `sample` of the model's own linears and choose (see above).

    The sample spans the model (every k-th linear) so its weights exceed the caches as a
    forward's do. A kernel's figure at a row count is the median, over the sampled linears, of
    its time over the first kernel's. Timing runs on one thread: with a team, one preempted
    thread stalls every call's barrier, and on a busy machine that made bf16 look 20x slower
    than fp32 at 64 rows. The whole timing runs twice: when the two disagree on the fastest
    kernel at the fewest or the most rows, the CPU flags' default is used instead (and not
    remembered); else the hand-over is placed by the mean of the two.
    """
    picked = _sampled(linears, sample)
    built = {k: [KERNELS[k](lin) for lin in picked] for k in kernels}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first = choose_kernels(_relative_times(built, rows, reps))
        second = choose_kernels(_relative_times(built, rows, reps))
    finally:
        torch.set_num_threads(threads)
    if (first.small, first.large) != (second.small, second.large):
        log.warning("linear kernel timings disagree (%s / %s): is the machine busy?",
                    first.describe(), second.describe())
        return default_choice(kernels, first.relative)
    return choose_kernels({k: {m: (r + second.relative[k][m]) / 2 for m, r in v.items()}
                           for k, v in first.relative.items()})


def choice_key(cpu: CpuFeatures, kernels: Sequence[str], linears: Sequence[nn.Linear]) -> str:
    """What a remembered choice depends on: CPU, torch, candidates and the weights' shapes."""
    shapes = sorted({(lin.out_features, lin.in_features) for lin in linears})
    text = json.dumps([CHOICE_VERSION, cpu.model, sorted(cpu.flags), torch.__version__,
                       list(kernels), shapes])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def remembered_choice(path: Path, measure: Callable[[], KernelChoice]) -> KernelChoice:
    """The choice stored at `path`, or `measure()`'s, stored there (one process measures)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        # NOTE: engines of one cluster start together; the first measures, the rest read.
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data = json.loads(path.read_text())
            relative = {k: {int(m): float(r) for m, r in v.items()}
                        for k, v in data["relative"].items()}
            choice = choose_kernels(relative)
            log.info("linear kernels as measured before (%s)", path)
            return choice
        except (OSError, ValueError, KeyError, AttributeError, StopIteration):
            pass
        choice = measure()
        if choice.trusted:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(asdict(choice), indent=1))
            tmp.replace(path)
        return choice
