"""`auto` reads the CPU: bf16 where it is in hardware, int8 weights on AVX2-only parts."""

from __future__ import annotations

from mooncake_server.engine.cpu import auto_dtype, auto_quantization, parse_cpuinfo

AMX = "processor : 0\nmodel name : Intel(R) Xeon(R) Platinum 8480+\nflags : fpu sse2 avx2 " \
      "avx512f avx512_bf16 amx_bf16 amx_tile avx512_vnni\n\nprocessor : 1\nflags : fpu\n"
AVX2 = "processor : 0\nmodel name : AMD EPYC 7B12\nflags : fpu sse2 avx avx2 fma\n"
OLD = "processor : 0\nmodel name : QEMU Virtual CPU\nflags : fpu sse2\n"


def test_amx_cpu_gets_bf16_without_quantization() -> None:
    cpu = parse_cpuinfo(AMX)
    assert cpu.bf16 and cpu.model.startswith("Intel")
    assert auto_dtype(cpu) == "bfloat16"
    assert auto_quantization(cpu, "bfloat16") == "none"
    assert "amx_bf16" in cpu.describe()


def test_avx2_only_cpu_gets_fp32_with_int8_weights() -> None:
    cpu = parse_cpuinfo(AVX2)
    assert not cpu.bf16
    assert auto_dtype(cpu) == "float32"
    assert auto_quantization(cpu, "float32") == "int8"


def test_cpu_without_vector_units_stays_exact() -> None:
    cpu = parse_cpuinfo(OLD)
    assert (auto_dtype(cpu), auto_quantization(cpu, "float32")) == ("float32", "none")


def test_explicit_bf16_on_an_avx2_cpu_is_not_quantized() -> None:
    assert auto_quantization(parse_cpuinfo(AVX2), "bfloat16") == "none"
