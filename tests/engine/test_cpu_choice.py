"""`--dtype auto`: float32 activations, one linear kernel picked by the CPU's flags alone."""

from __future__ import annotations

import copy

import pytest
import torch

from mooncake_server.engine.cpu import parse_cpuinfo, resolve_dtype_name, resolve_quantization
from mooncake_server.engine.kernel_choice import (
    MAX_KERNEL_ERROR,
    auto_candidates,
    auto_kernel,
    kernel_errors,
)
from mooncake_server.engine.linears import (
    KERNELS,
    Int8Linear,
    apply_kernel,
    fp16_weights_supported,
    int8_linear,
    prepare_linears,
)
from mooncake_server.engine.w8_linear import W8Linear, w8_built, w8_supported

# The three CPU kinds the suite must pass on, as /proc/cpuinfo shows them (trimmed).
AMX = "processor : 0\nmodel name : Intel(R) Xeon(R) Platinum 8480+\nflags : fpu sse2 avx2 fma " \
      "avx512f avx512bw avx512_bf16 amx_bf16 amx_tile avx512_vnni\n\nprocessor : 1\nflags : fpu\n"
VNNI = "processor : 0\nmodel name : AMD EPYC 9B14\nflags : fpu sse2 avx avx2 fma avx512f " \
       "avx512bw avx512_vnni avx512_bf16\n"
AVX2 = "processor : 0\nmodel name : AMD EPYC 7B12\nflags : fpu sse2 avx avx2 fma\n"
OLD = "processor : 0\nmodel name : QEMU Virtual CPU\nflags : fpu sse2\n"

needs_w8 = pytest.mark.skipif(not w8_supported(), reason="this CPU has no AVX2+FMA")


@pytest.mark.parametrize("cpuinfo", [AMX, VNNI, AVX2], ids=["amx", "avx512-vnni", "avx2"])
def test_every_avx2_cpu_kind_runs_the_same_kernel(cpuinfo: str) -> None:
    """AMX Intel, AVX512-VNNI AMD and AVX2-only parts get one kernel: the same answers on all."""
    cpu = parse_cpuinfo(cpuinfo)
    expected = ["int8-weights", "float32"] if w8_built() else ["float32"]
    assert auto_candidates(cpu) == expected
    assert "avx2" in cpu.describe() and "fma" in cpu.describe()


def test_cpu_without_avx2_keeps_plain_float32() -> None:
    cpu = parse_cpuinfo(OLD)
    assert auto_candidates(cpu) == ["float32"]
    choice = auto_kernel(cpu, [torch.nn.Linear(64, 64)])
    assert choice.kernel == "float32" and "no AVX2+FMA" in choice.reason


def test_bf16_flags_do_not_change_autos_choice() -> None:
    """bf16 activations cost quality auto does not pay (docs/engine.md): flags alone decide."""
    assert auto_candidates(parse_cpuinfo(AMX)) == auto_candidates(parse_cpuinfo(AVX2))


def test_auto_runs_float32_activations() -> None:
    assert resolve_dtype_name("auto") == "float32"
    assert resolve_quantization("auto", "auto") == "auto"


def test_a_dtype_named_by_hand_gets_plain_linears() -> None:
    """--dtype float32 is the exact mode on every CPU, AVX2-only ones included."""
    assert resolve_quantization("auto", "float32") == "none"
    assert resolve_quantization("auto", "bfloat16") == "none"
    assert resolve_quantization("int8", "float32") == "int8"
    assert resolve_quantization("int8-weights", "auto") == "int8-weights"


@needs_w8
def test_the_choice_is_the_same_on_every_start() -> None:
    """No timing: the verdict is a function of the flags and the weights (fixed check inputs)."""
    torch.manual_seed(3)
    linears = [torch.nn.Linear(64, 96) for _ in range(3)]
    cpu = parse_cpuinfo(AVX2)
    first, again = auto_kernel(cpu, linears), auto_kernel(cpu, linears)
    assert first == again and first.kernel == "int8-weights"
    assert kernel_errors(linears, ["int8-weights"]) == kernel_errors(linears, ["int8-weights"])


@needs_w8
def test_auto_gives_every_linear_the_kernel_lm_head_included() -> None:
    model = _WithHead()
    described = prepare_linears(model, torch.float32, "auto", parse_cpuinfo(AVX2))
    assert isinstance(model.layer, W8Linear) and isinstance(model.lm_head, W8Linear)
    assert described.startswith("2 linears: int8-weights")


def test_a_kernel_that_disagrees_with_float32_is_not_used(monkeypatch) -> None:
    """A broken kernel (a CPU or library bug) costs speed, never answers."""
    class Broken(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return -self.lin(x)

    monkeypatch.setitem(KERNELS, "int8-weights", Broken)
    monkeypatch.setattr("mooncake_server.engine.kernel_choice.w8_built", lambda: True)
    linears = [torch.nn.Linear(64, 96) for _ in range(3)]
    assert kernel_errors(linears, ["int8-weights"])["int8-weights"] > 1.5
    assert auto_kernel(parse_cpuinfo(AVX2), linears).kernel == "float32"


@needs_w8
def test_weight_only_int8_stays_within_the_error_bound() -> None:
    linears = [torch.nn.Linear(128, 256) for _ in range(2)]
    errors = kernel_errors(linears, ["float32", "int8-weights", "int8"])
    assert errors["float32"] == 0.0
    # weights alone rounded (groups of 32, 255 levels): far closer than int8 activations
    assert 0 < errors["int8-weights"] < errors["int8"] / 3 < MAX_KERNEL_ERROR


class _WithHead(torch.nn.Module):
    """A layer and an output projection, named as in a causal LM."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(64, 64)
        self.lm_head = torch.nn.Linear(64, 512, bias=False)


@pytest.mark.skipif(not fp16_weights_supported(), reason="fbgemm is not built in here")
def test_the_output_projection_never_runs_int8_activations() -> None:
    """Its input has a few channels far above the rest, and int8's one activation scale per
    call turned the README question's first token wrong: the lm_head keeps 16-bit weights."""
    model = _WithHead()
    head = copy.deepcopy(model.lm_head)
    apply_kernel(model, "int8")
    assert isinstance(model.layer, Int8Linear)
    x = torch.randn(3, 64)
    x[:, 5] = 40.0  # an outlier channel, as the final norm's output has
    for rows in (x[:1], x):
        with torch.no_grad():
            exact = head(rows)
            err = float((model.lm_head(rows) - exact).norm() / exact.norm())
            int8 = int8_linear(copy.deepcopy(head))(rows)
        assert err < 1e-3
        assert float((int8 - exact).norm() / exact.norm()) > 10 * err  # what it would have been
    assert "fp16-weights" in prepare_linears(_WithHead(), torch.float32, "int8")
