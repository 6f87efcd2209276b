"""The machine a benchmark ran on (CPU model, cores, the SIMD / matrix flags that decide CPU
inference speed, load average), and the start every one-server benchmark shares."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mooncake_bench.client import Prompts

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """CPU model, core count and the SIMD / matrix flags that decide CPU inference speed."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.startswith("model name")), "unknown")
    flags_line = next((line.split(":", 1)[1] for line in cpuinfo.splitlines()
                       if line.startswith("flags")), "")
    present = set(flags_line.split())
    try:
        load = list(os.getloadavg())
    except OSError:
        load = []
    return {"model": model, "cores": os.cpu_count(), "load_avg": load,
            "flags": {f: f in present for f in CPU_FLAGS}}


def print_cpu(info: dict[str, Any]) -> None:
    """One header line about the CPU (a shared machine shows in its load average)."""
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in info["flags"].items())
    load = " ".join(f"{x:.2f}" for x in info["load_avg"])
    print(f"CPU: {info['model']}, {info['cores']} cores; {flags}; load average {load}")




def one_server_bench(description: str, logs: str,
                     add_flags: Callable[[argparse.ArgumentParser], None],
                     ) -> tuple[argparse.Namespace, str, Prompts]:
    """A one-server benchmark's start: its flags (plus --model, --logs), the model resolved,
    the CPU printed, and the prompt maker."""
    from mooncake_server.model_assets import resolve_model

    p = argparse.ArgumentParser(description=description)
    add_flags(p)
    p.add_argument("--model", default=None)
    p.add_argument("--logs", default=logs)
    args = p.parse_args()
    model = str(resolve_model(args.model))
    print_cpu(cpu_info())
    return args, model, Prompts(model)
