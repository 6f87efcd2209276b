"""Faster kernels for a model's linear layers, chosen for the CPU at hand; the math stays HF's.

Decode reads every weight once per step, so its speed is bytes per token; prefill is GEMM-bound.
Two replacements of `nn.Linear`, applied to every linear of the loaded model (lm_head included):

- `PackedBF16Linear` (bfloat16 on CPUs with AMX/AVX512-BF16): the weight is reordered once into
  oneDNN's blocked layout. A plain bf16 `F.linear` reorders it on every call, which made one-token
  steps slower in bf16 than in fp32; packed, the result is bit-identical and small-batch GEMMs
  take about half the time of fp32's.
- `--quantization int8`: torch's dynamic int8 linear (fbgemm), per-output-channel int8 weights,
  activations quantized per call: a quarter of fp32's weight bytes on CPUs where bf16 is slow.
  Its activation scale is taken over the whole packed batch, so a token's logits can move by
  rounding with what shares its step; greedy output is compared with HF running the same module.

`--dtype auto` (float32 activations and KV) times the kernels the CPU has on the model's own
weights at start-up and gives each linear the fastest for the pass at hand: on the 2-core AMX
machine here oneDNN's bf16 GEMV reads weights at 13-17 GB/s against fp32's ~22, so one-token
steps go fastest in int8, while prompt passes run many times faster in bf16 on AMX.
`BatchSizedLinear` switches between the two by the rows of the call.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mooncake_server.engine.cpu import CpuFeatures

log = logging.getLogger(__name__)


def bf16_packing_supported() -> bool:
    """oneDNN can run bf16 linears with prepacked weights on this build and CPU."""
    return bool(torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedBF16Linear(nn.Module):
    """A bf16 linear whose weight lives in oneDNN's blocked layout (reordered once, not per call)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().to(torch.bfloat16)
        # NOTE: the batch-size hint only tunes the layout; any batch runs on it (measured equal).
        self.register_buffer("packed_weight",
                             torch.ops.mkldnn._reorder_linear_weight(weight, 1), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T + b with the packed weight."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [],
                                                  "")


class FloatBF16Linear(PackedBF16Linear):
    """A packed bf16 linear inside a float32 model: casts its input down and its output back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 in, float32 out, bf16 in between."""
        return super().forward(x.to(torch.bfloat16)).to(x.dtype)


def int8_linear(linear: nn.Linear) -> nn.Module:
    """fbgemm's dynamic int8 linear for one float32 linear (per-output-channel weights)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear
    from torch.ao.quantization import per_channel_dynamic_qconfig

    if "fbgemm" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "fbgemm"
    linear.qconfig = per_channel_dynamic_qconfig  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", (DeprecationWarning, UserWarning))
        return DynamicInt8Linear.from_float(linear)


KERNELS: dict[str, Callable[[nn.Linear], nn.Module]] = {
    "float32": lambda linear: linear,
    "bfloat16": FloatBF16Linear,
    "int8": int8_linear,
}


class BatchSizedLinear(nn.Module):
    """One linear, two kernels: `small` for calls of at most `up_to` rows, `large` above."""

    def __init__(self, small: nn.Module, large: nn.Module, up_to: int) -> None:
        super().__init__()
        self.small, self.large, self.up_to = small, large, up_to

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T + b by the kernel measured fastest for this many rows."""
        rows = x.numel() // x.shape[-1]
        return self.small(x) if rows <= self.up_to else self.large(x)


@dataclass(frozen=True)
class KernelChoice:
    """Which kernel a float32 model's linears run, by rows per call; and the times behind it."""

    small: str
    large: str
    up_to: int  # rows up to which `small` runs
    seconds: dict[str, dict[int, float]]  # kernel -> rows -> time of the sampled linears

    def describe(self) -> str:
        """A log line: the choice, then each kernel's times in ms."""
        rows = sorted(next(iter(self.seconds.values())))
        table = "; ".join(f"{k} " + " ".join(f"{m}:{t * 1e3:.2f}" for m, t in sorted(v.items()))
                          for k, v in self.seconds.items())
        pick = (self.small if self.small == self.large
                else f"{self.small} up to {self.up_to} rows, {self.large} above")
        return f"{pick} (ms for rows {rows[0]}..{rows[-1]}: {table})"


def choose_kernels(seconds: dict[str, dict[int, float]]) -> KernelChoice:
    """The fastest kernel at the fewest and at the most rows, and where one hands over to the other.

    `up_to` is the largest measured row count at which the one-token winner is still no slower
    than the many-row winner, so only the two ends are trusted to rank, not every point between.
    """
    rows = sorted(next(iter(seconds.values())))
    small = min(seconds, key=lambda k: seconds[k][rows[0]])
    large = min(seconds, key=lambda k: seconds[k][rows[-1]])
    up_to = rows[-1] if small == large else rows[0]
    if small != large:
        for m in rows:
            if seconds[small][m] > seconds[large][m]:
                break
            up_to = m
    return KernelChoice(small, large, up_to, seconds)


def _time_kernels(kernels: Sequence[nn.Module], rows: int, reps: int) -> float:
    """Sum over `kernels` of each one's best call time on `rows` rows, over `reps` rounds.

    Calls are timed one by one and the best of each kept: a busy machine preempts a few calls,
    rarely the same one in every round. Each round walks all kernels, so a weight has left the
    cache by the time it is read again, as in a forward.
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
    return sum(best)


def _in_features(m: nn.Module) -> int:
    """Input width of a float, packed or quantized linear."""
    in_features = getattr(m, "in_features", None)
    if in_features is None:  # torch.ao's dynamic linear keeps it in its weight
        in_features = m.weight().shape[1]  # type: ignore[operator]
    return int(in_features)


def measure_kernels(linears: Sequence[nn.Linear], kernels: Sequence[str],
                    rows: Sequence[int] = (1, 4, 16, 64, 256), sample: int = 24,
                    reps: int = 5) -> KernelChoice:
    """Time each kernel on up to `sample` of the model's own linears and choose (see above).

    The sample spans the model (every k-th linear) so its weights exceed the caches as a
    forward's do; kernels are timed in turns, row count by row count, so load on the machine
    falls on all of them alike.
    """
    step = max(1, len(linears) // sample)
    picked = list(linears)[::step][:sample]
    built = {k: [KERNELS[k](lin) for lin in picked] for k in kernels}
    seconds: dict[str, dict[int, float]] = {k: {} for k in kernels}
    for m in rows:
        for k in kernels:
            seconds[k][m] = _time_kernels(built[k], m, reps)
    return choose_kernels(seconds)


def kernel_candidates(cpu: CpuFeatures) -> list[str]:
    """The kernels worth timing on `cpu`: bf16 only with bf16 hardware (else ~100x slower)."""
    kernels = ["float32"]
    if cpu.bf16 and bf16_packing_supported():
        kernels.append("bfloat16")
    if cpu.int8 and "fbgemm" in torch.backends.quantized.supported_engines:
        kernels.append("int8")
    return kernels


def apply_kernels(model: nn.Module, choice: KernelChoice) -> int:
    """Give every nn.Linear of `model` the kernels `choice` names; returns how many."""
    if choice.small == choice.large:
        return _replace_linears(model, KERNELS[choice.small])
    return _replace_linears(model, lambda lin: BatchSizedLinear(
        KERNELS[choice.small](lin), KERNELS[choice.large](lin), choice.up_to))


def _replace_linears(model: nn.Module, make: type[nn.Module] | object) -> int:
    """Swap every nn.Linear for `make(linear)`; returns how many were swapped."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, make(child))  # type: ignore[operator]
                count += 1
    return count


def quantize_int8(model: nn.Module) -> nn.Module:
    """Every linear as fbgemm's dynamic int8 linear with per-channel weights (float32 models)."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    if "fbgemm" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "fbgemm"
    # NOTE: torch.ao's eager quantization warns that it moves to torchao; pyproject pins a torch
    # that still has it, and its kernels (fbgemm) are the ones measured here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", (DeprecationWarning, UserWarning))
        return quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig},
                                dtype=torch.qint8, inplace=True)


def prepare_linears(model: nn.Module, dtype: torch.dtype, quantization: str,
                    measure: Callable[[list[nn.Linear]], KernelChoice] | None = None) -> str:
    """Put the fast kernel for (dtype, quantization) into `model`; returns what was done.

    `quantization` "auto" (float32 only) gives each linear the kernels `measure` chooses.
    """
    if quantization == "auto":
        if dtype != torch.float32 or measure is None:
            raise ValueError("measured kernels need a float32 model and a measure")
        linears = [m for m in model.modules() if type(m) is nn.Linear]
        choice = measure(linears)
        n = apply_kernels(model, choice)
        return f"{n} linears measured fastest: {choice.describe()}"
    if quantization == "int8":
        if dtype != torch.float32:
            raise ValueError("--quantization int8 needs --dtype float32 (activations stay fp32)")
        quantize_int8(model)
        return "int8 dynamic linears (fbgemm, per-channel weights)"
    if dtype == torch.bfloat16 and bf16_packing_supported():
        n = _replace_linears(model, PackedBF16Linear)
        return f"{n} bf16 linears prepacked for oneDNN"
    return "plain linears"
