"""`--dtype auto`: float32 activations, the linears' kernels timed among those the CPU has."""

from __future__ import annotations

import copy

import pytest
import torch

from mooncake_server.engine.cpu import parse_cpuinfo, resolve_dtype_name, resolve_quantization
from mooncake_server.engine.kernel_choice import (
    MAX_KERNEL_ERROR,
    choice_key,
    choose_kernels,
    default_choice,
    faithful_choice,
    kernel_candidates,
    kernel_errors,
    measure_kernels,
    remembered_choice,
)
from mooncake_server.engine.linears import (
    KERNELS,
    BatchSizedLinear,
    Int8Linear,
    apply_kernels,
    bf16_packing_supported,
    fp16_weights_supported,
    int8_linear,
    prepare_linears,
)
from mooncake_server.engine.vnni_linear import vnni_supported

AMX = "processor : 0\nmodel name : Intel(R) Xeon(R) Platinum 8480+\nflags : fpu sse2 avx2 " \
      "avx512f avx512bw avx512_bf16 amx_bf16 amx_tile avx512_vnni\n\nprocessor : 1\nflags : fpu\n"
AVX2 = "processor : 0\nmodel name : AMD EPYC 7B12\nflags : fpu sse2 avx avx2 fma\n"
OLD = "processor : 0\nmodel name : QEMU Virtual CPU\nflags : fpu sse2\n"


def test_amx_cpu_times_bf16_and_int8_beside_fp32() -> None:
    cpu = parse_cpuinfo(AMX)
    assert cpu.bf16 and cpu.model.startswith("Intel")
    assert "amx_bf16" in cpu.describe()
    kernels = kernel_candidates(cpu)
    assert kernels[0] == "float32"
    assert ("bfloat16" in kernels) == bf16_packing_supported()
    assert ("int8-vnni" in kernels) == vnni_supported()


def test_avx2_only_cpu_never_times_bf16() -> None:
    """torch's bf16 GEMM runs ~100x slower than fp32 there: not even worth one timing."""
    kernels = kernel_candidates(parse_cpuinfo(AVX2))
    assert "bfloat16" not in kernels and "float32" in kernels
    assert "int8-vnni" not in kernels  # the kernel's VPDPBUSD is AVX512-VNNI


def test_cpu_without_vector_units_keeps_plain_float32() -> None:
    assert kernel_candidates(parse_cpuinfo(OLD)) == ["float32"]


def test_auto_runs_float32_activations_and_measured_linears() -> None:
    assert resolve_dtype_name("auto") == "float32"
    assert resolve_quantization("auto", "auto") == "auto"


def test_a_dtype_named_by_hand_gets_plain_linears() -> None:
    """--dtype float32 is the exact mode on every CPU, AVX2-only ones included."""
    assert resolve_quantization("auto", "float32") == "none"
    assert resolve_quantization("auto", "bfloat16") == "none"
    assert resolve_quantization("int8", "float32") == "int8"


def test_choice_hands_over_where_the_many_row_winner_gets_ahead() -> None:
    seconds = {"float32": {1: 5.0, 4: 5.0, 16: 6.0, 64: 20.0, 256: 80.0},
               "int8": {1: 2.0, 4: 2.1, 16: 3.0, 64: 9.0, 256: 30.0},
               "bfloat16": {1: 4.0, 4: 4.0, 16: 2.9, 64: 4.0, 256: 8.0}}
    choice = choose_kernels(seconds)
    assert (choice.small, choice.large, choice.up_to) == ("int8", "bfloat16", 4)
    assert "int8 up to 4 rows, bfloat16 above" in choice.describe()


def test_one_kernel_fastest_everywhere_is_used_alone() -> None:
    seconds = {"float32": {1: 5.0, 256: 80.0}, "int8": {1: 2.0, 256: 30.0}}
    choice = choose_kernels(seconds)
    assert (choice.small, choice.large) == ("int8", "int8")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    apply_kernels(model, choice)
    assert not isinstance(model[0], BatchSizedLinear) and not isinstance(model[0], torch.nn.Linear)


def test_measured_choice_names_every_candidate_it_timed() -> None:
    linears = [torch.nn.Linear(64, 96) for _ in range(4)]
    choice = measure_kernels(linears, ["float32", "int8"], rows=(1, 8), reps=1)
    assert set(choice.relative) == {"float32", "int8"}
    assert choice.relative["float32"] == {1: 1.0, 8: 1.0}  # the reference
    assert all(r > 0 for r in choice.relative["int8"].values())
    assert {choice.small, choice.large} <= {"float32", "int8"}


def test_a_choice_is_measured_once_then_remembered(tmp_path) -> None:
    """Later starts (and the other engines of a cluster) reuse it instead of timing again."""
    cpu = parse_cpuinfo(AMX)
    linears = [torch.nn.Linear(64, 96)]
    path = tmp_path / f"{choice_key(cpu, ['float32', 'int8'], linears)}.json"
    measured = []

    def measure():
        measured.append(1)
        return choose_kernels({"float32": {1: 1.0, 256: 1.0}, "int8": {1: 0.4, 256: 0.7}})

    first = remembered_choice(path, measure)
    again = remembered_choice(path, measure)
    assert measured == [1] and first == again and first.small == "int8"
    other = choice_key(cpu, ["float32", "int8"], [torch.nn.Linear(64, 128)])
    assert other != path.stem  # other weights are timed anew


def test_a_damaged_remembered_choice_is_measured_again(tmp_path) -> None:
    path = tmp_path / "k.json"
    path.write_text("{not json")
    choice = remembered_choice(path, lambda: choose_kernels({"float32": {1: 1.0}}))
    assert choice.small == "float32" and '"relative"' in path.read_text()


@pytest.mark.skipif(not bf16_packing_supported(), reason="this CPU/torch has no oneDNN bf16")
def test_batch_sized_linear_runs_each_kernel_on_its_side_of_the_handover() -> None:
    lin = torch.nn.Linear(32, 48)
    int8_alone = int8_linear(copy.deepcopy(lin))
    model = torch.nn.Sequential(lin)
    apply_kernels(model, choose_kernels({"int8": {1: 1.0, 256: 9.0},
                                         "bfloat16": {1: 2.0, 256: 3.0}}))
    assert isinstance(model[0], BatchSizedLinear) and model[0].up_to == 1
    one, many = torch.randn(1, 32), torch.randn(5, 32)
    bf16 = torch.nn.functional.linear(many.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16())
    assert torch.equal(model(many), bf16.float())
    assert torch.equal(model(one), int8_alone(one))


def test_untrusted_timings_fall_back_to_the_flags_and_are_not_remembered(tmp_path) -> None:
    kernels = ["float32", "bfloat16", "int8"]
    fallback = default_choice(kernels, {k: {1: 1.0} for k in kernels})
    assert (fallback.small, fallback.large, fallback.trusted) == ("int8", "bfloat16", False)
    assert "timings disagreed" in fallback.describe()
    path = tmp_path / "k.json"
    assert remembered_choice(path, lambda: fallback) == fallback
    assert not path.exists()
    assert default_choice(["float32", "int8"], {}).small == "int8"
    assert default_choice(["float32"], {}).large == "float32"


def test_a_kernel_that_disagrees_with_float32_is_not_used(monkeypatch) -> None:
    """A broken kernel (a CPU or library bug) costs speed, never answers."""
    class Broken(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return -self.lin(x)

    monkeypatch.setitem(KERNELS, "int8", Broken)
    linears = [torch.nn.Linear(64, 96) for _ in range(3)]
    errors = kernel_errors(linears, ["int8"])
    assert errors["int8"] > 1.5
    choice = faithful_choice(choose_kernels({"float32": {1: 1.0, 256: 1.0},
                                             "int8": {1: 0.4, 256: 0.7}}), errors)
    assert (choice.small, choice.large) == ("float32", "float32")


def test_int8_kernel_stays_within_the_error_bound() -> None:
    linears = [torch.nn.Linear(128, 256) for _ in range(2)]
    errors = kernel_errors(linears, ["float32", "int8"])
    assert errors["float32"] == 0.0 and 0 < errors["int8"] < MAX_KERNEL_ERROR
    choice = choose_kernels({"float32": {1: 1.0}, "int8": {1: 0.4}})
    assert faithful_choice(choice, errors) is choice


class _WithHead(torch.nn.Module):
    """A layer and an output projection, named as in a causal LM."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(64, 64)
        self.lm_head = torch.nn.Linear(64, 512, bias=False)


@pytest.mark.skipif(not fp16_weights_supported(), reason="fbgemm is not built in here")
@pytest.mark.parametrize("large", ["int8", "float32"])
def test_the_output_projection_never_runs_int8(large: str) -> None:
    """Its input has a few channels far above the rest, and int8's one activation scale per
    call turned the README question's first token wrong: the lm_head keeps 16-bit weights."""
    model = _WithHead()
    head = copy.deepcopy(model.lm_head)
    apply_kernels(model, choose_kernels({"float32": {1: 1.0, 256: 1.0},
                                         "int8": {1: 0.3, 256: 0.5 if large == "int8" else 2.0}}))
    assert isinstance(model.layer, (Int8Linear, BatchSizedLinear))
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
