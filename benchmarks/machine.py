"""The CPU a benchmark ran on, in words for its results: the model and whether it has bf16
instructions, which decide whether low-precision products are fast there at all (on an AVX2-only
CPU bf16 products take tens of times fp32's: results/cpu_without_bf16.md)."""

from __future__ import annotations

import os
import platform

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo's names of the bf16 instructions


def cpu_words() -> str:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:  # not Linux: the model as platform gives it
        pass
    bf16 = ", ".join(f for f in BF16_FLAGS if f in flags) or "none"
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores: {model}; bf16 instructions: {bf16})"
