"""Faster kernels for a model's linear layers, chosen for the CPU at hand; the math stays HF's.

Decode reads every weight once per step, so its speed is bytes per token; prefill is GEMM-bound.
Replacements of `nn.Linear`, applied to every linear of the loaded model:

- `PackedBF16Linear` (bfloat16 on CPUs with AMX/AVX512-BF16): the weight is reordered once into
  oneDNN's blocked layout. A plain bf16 `F.linear` reorders it on every call, which made one-token
  steps slower in bf16 than in fp32; packed, the result is bit-identical and small-batch GEMMs
  take about half the time of fp32's.
- `--quantization int8`: torch's dynamic int8 linear (fbgemm), per-output-channel int8 weights,
  activations quantized per call: a quarter of fp32's weight bytes on CPUs where bf16 is slow.
  Its activation scale is taken over the whole packed batch, so a token's logits can move by
  rounding with what shares its step; greedy output is compared with HF running the same module.
  The output projection (lm_head) is the exception: it keeps 16-bit weights (`Fp16WeightLinear`,
  see `OUTPUT_PROJECTION`).
- `W8Linear` (w8_linear.py, CPUs with AVX2 and FMA): int8 weights in groups of 32 with float32
  activations; `--dtype auto`'s kernel (kernel_choice.py), at every row count.
- `VnniInt8Linear` (vnni_linear.py, CPUs with AVX512-VNNI): an int8 GEMV for decode-sized calls,
  activations quantized per row; scored by scripts/bench_quality.py, not served.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

import torch
from torch import nn

from mooncake_server.engine.cpu import CpuFeatures, cpu_features
from mooncake_server.engine.vnni_linear import VnniInt8Linear
from mooncake_server.engine.w8_linear import W8Linear, w8_fits

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


class Int8Linear(nn.Module):
    """fbgemm's dynamic int8 linear, called straight rather than through torch.ao's module.

    torch.ao's module checks its dtype and version on every call: a one-token step runs 121
    linears, and dropping the module took a 16.3 ms step to 15.6 ms (A/B in one process). The
    output is the same op's, bit for bit.
    """

    def __init__(self, quantized: nn.Module) -> None:
        super().__init__()
        self.in_features, self.out_features = quantized.in_features, quantized.out_features
        self.packed = quantized._packed_params._packed_params  # type: ignore[union-attr]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 in, float32 out; activations quantized per call (reduce_range as torch.ao)."""
        return _LINEAR_DYNAMIC(x, self.packed, True)


def _raw_op(overload: object) -> Callable[..., torch.Tensor]:
    """The C++ function behind an op overload: skips the Python wrapper's per-call check for
    fake script objects (taken because the packed weights are one; ~0.1 ms a one-token step)."""
    return getattr(overload, "_op", overload)  # type: ignore[return-value]


_LINEAR_DYNAMIC = _raw_op(torch.ops.quantized.linear_dynamic.default)


def int8_linear(linear: nn.Linear) -> nn.Module:
    """fbgemm's dynamic int8 linear for one float32 linear (per-output-channel weights)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear
    from torch.ao.quantization import per_channel_dynamic_qconfig

    if "fbgemm" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "fbgemm"
    linear.qconfig = per_channel_dynamic_qconfig  # type: ignore[assignment]
    # NOTE: torch.ao's eager quantization warns that it moves to torchao; pyproject pins a torch
    # that still has it, and its kernels (fbgemm) are the ones measured here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", (DeprecationWarning, UserWarning))
        return Int8Linear(DynamicInt8Linear.from_float(linear))


class Fp16WeightLinear(nn.Module):
    """fbgemm's linear over float16 weights: float32 activations, half the weight bytes.

    For the output projection, where int8 fails (see `OUTPUT_PROJECTION`): on SmolLM2's README
    question its logits are 5e-4 off float32's (relative L2), and a one-row call over the
    vocabulary takes about half of float32's time.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach()
        self.packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 in, float32 out."""
        return _LINEAR_DYNAMIC_FP16(x, self.packed)


_LINEAR_DYNAMIC_FP16 = _raw_op(torch.ops.quantized.linear_dynamic_fp16.default)


def fp16_weights_supported() -> bool:
    """fbgemm (x86 with AVX2 and F16C) runs float16-weight linears here."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def int8_weights(linear: nn.Linear) -> nn.Module:
    """The weight-only int8 kernel where the input width is whole groups, else the linear."""
    return W8Linear(linear) if w8_fits(linear) else linear


KERNELS: dict[str, Callable[[nn.Linear], nn.Module]] = {
    "float32": lambda linear: linear,
    "int8-weights": int8_weights,
    "bfloat16": FloatBF16Linear,
    "int8": int8_linear,
    "int8-vnni": VnniInt8Linear,
    "fp16-weights": Fp16WeightLinear,
}
# Kernels that quantize activations to int8: not for the output projection (below).
INT8_ACTIVATIONS = frozenset({"int8", "int8-vnni"})

# The output projection's input (the final norm's output) carries a few channels 25-40x its
# median, and int8 quantizes a call's activations with one scale: on the README question the
# int8 lm_head's logits were 5% off float32's (relative L2, float32 layers before it) and its
# first token was wrong; served under --dtype auto the answer was "L'Étoile, la Marseur, ...".
# A scale per row does not help: the outliers are channels, in every row. LLM quantizers (GPTQ,
# AWQ) keep the lm_head unquantized too; here it keeps 16-bit weights.
OUTPUT_PROJECTION = "lm_head"


def output_kernel(kernel: str) -> str:
    """The kernel the output projection runs where the others run `kernel`."""
    if kernel not in INT8_ACTIVATIONS:
        return kernel
    return "fp16-weights" if fp16_weights_supported() else "float32"


def direct_call(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """What calling `module` ends in, without nn.Module's call machinery (hooks are not used)."""
    return module.forward


def apply_kernel(model: nn.Module, kernel: str) -> int:
    """Give every nn.Linear of `model` the kernel `kernel` (the output projection
    `output_kernel(kernel)`); returns how many."""
    return _replace_linears(model, lambda linear, output: KERNELS[
        output_kernel(kernel) if output else kernel](linear))


def _replace_linears(model: nn.Module, make: Callable[[nn.Linear, bool], nn.Module]) -> int:
    """Swap every nn.Linear for `make(linear, is the output projection)`; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                output = parent is model and name == OUTPUT_PROJECTION
                setattr(parent, name, make(child, output))
                count += 1
    return count


def prepare_linears(model: nn.Module, dtype: torch.dtype, quantization: str,
                    cpu: CpuFeatures | None = None) -> str:
    """Put the kernel for (dtype, quantization) into `model`; returns what was done.

    `quantization` "auto" (float32 only) gives every linear the kernel kernel_choice.py picks
    for `cpu` (default: this machine's).
    """
    if quantization in ("auto", "int8-weights", "int8") and dtype != torch.float32:
        raise ValueError(f"--quantization {quantization} needs float32 activations "
                             "(--dtype auto or float32)")
    if quantization == "auto":
        from mooncake_server.engine.kernel_choice import auto_kernel

        linears = [m for m in model.modules() if type(m) is nn.Linear]
        choice = auto_kernel(cpu or cpu_features(), linears)
        n = apply_kernel(model, choice.kernel)
        return f"{n} linears: {choice.reason}"
    if quantization in ("int8", "int8-weights"):
        n = apply_kernel(model, quantization)
        return f"{n} linears {quantization}; {OUTPUT_PROJECTION} {output_kernel(quantization)}"
    if dtype == torch.bfloat16 and bf16_packing_supported():
        n = _replace_linears(model, lambda lin, output: PackedBF16Linear(lin))
        return f"{n} bf16 linears prepacked for oneDNN"
    return "plain linears"
