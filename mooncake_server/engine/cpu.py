"""What the CPU at hand computes fast: read once from /proc/cpuinfo, never assumed.

Machines differ: Intel parts with AMX-BF16 run bf16 GEMMs several times faster than fp32, while
AVX2-only parts run torch's bf16 GEMM ~100x slower than fp32. The flags decide which kernel
`--dtype auto` runs (float32 activations and KV everywhere, so every machine's KV bytes agree;
see kernel_choice.py) and which kernels a user may pick by hand.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # bf16 matmul in hardware
INT8_FLAGS = ("avx512_vnni", "avx_vnni", "avx2")  # fbgemm's int8 kernels
VNNI_FLAGS = ("avx512bw", "avx512_vnni")  # vnni_linear.py's int8 kernel
W8_FLAGS = ("avx2", "fma")  # w8_linear.py's weight-only int8 kernel (auto's)


@dataclass(frozen=True)
class CpuFeatures:
    """The instruction-set flags that decide the fast dtype."""

    model: str
    flags: frozenset[str]

    @property
    def bf16(self) -> bool:
        """bf16 matmuls run in hardware (AMX or AVX512-BF16)."""
        return any(f in self.flags for f in BF16_FLAGS)

    @property
    def int8(self) -> bool:
        """int8 matmul kernels (fbgemm) have the vector units they need."""
        return any(f in self.flags for f in INT8_FLAGS)

    @property
    def vnni(self) -> bool:
        """512-bit int8 dot products (VPDPBUSD), which vnni_linear.py's kernel needs."""
        return all(f in self.flags for f in VNNI_FLAGS)

    @property
    def avx2_fma(self) -> bool:
        """256-bit FMA, which w8_linear.py's kernel (auto's) needs."""
        return all(f in self.flags for f in W8_FLAGS)

    def describe(self) -> str:
        """A log line: model name and the flags that matter here."""
        shown = [f for f in dict.fromkeys((*BF16_FLAGS, *INT8_FLAGS, *W8_FLAGS, *VNNI_FLAGS))
                 if f in self.flags]
        return f"{self.model or 'unknown CPU'} [{' '.join(shown) or 'no bf16/int8 flags'}]"


def parse_cpuinfo(text: str) -> CpuFeatures:
    """Features from the text of /proc/cpuinfo (the first processor's entry)."""
    model, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return CpuFeatures(model, flags)


@lru_cache(maxsize=1)
def cpu_features() -> CpuFeatures:
    """This machine's features (no flags where /proc/cpuinfo is unreadable: the safe choice)."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return CpuFeatures("", frozenset())


def resolve_dtype_name(name: str) -> str:
    """--dtype as the activations' and KV's dtype ('auto' runs float32 activations)."""
    return "float32" if name == "auto" else name


def resolve_quantization(name: str, dtype_flag: str) -> str:
    """--quantization as what load_model applies, given --dtype as passed.

    'auto' under `--dtype auto` stays "auto" (kernel_choice.py picks the kernel); a dtype named
    by hand gets plain linears in it (float32 by hand is the exact mode, whatever the CPU).
    """
    if name != "auto":
        return name
    return "auto" if dtype_flag == "auto" else "none"
