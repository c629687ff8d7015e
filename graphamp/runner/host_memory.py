"""Freed CPU memory kept in the process while CPU steps run (``config.set_keep_cpu_memory``).

A step allocates and frees the same buffers every time it runs. glibc's malloc gives a freed
buffer back to the OS when it was mapped on its own (above the mmap threshold) or when the
heap's free top grows past the trim threshold, and the next step faults each of its pages in
again, zeroed by the kernel. On the CPU that was thousands of page faults a step, and how many
depended on the order a program happened to free in, not on its work: outlined and inlined
steps of the same model differed by 0 to 5,700 faults a step from one process to the next,
and by up to 14% in step time (``benchmarks/outline_cost.py``, one process per program).

So when graphamp compiles a CPU step it sets glibc's mmap threshold to its largest value
(32 MiB on 64-bit systems: smaller buffers come from the heap and are reused) and turns off
trimming of the heap, once per process; what the process has freed is reused instead of faulted
in again, as a caching allocator reuses memory on the GPU. The process's peak memory is the
same (a step reaches it every time it runs; measured on ViT-Ti, transformers' GPT-2 and
ResNet-18, docs/usage.md), but it is no longer given back between steps: a process that trains
and then does something else with less memory keeps the peak.

This is process-wide, and it is not undone: glibc cannot go back to its dynamic threshold.
Buffers above 32 MiB are still mapped on their own (a large vocabulary's logits). Other C
libraries (musl, macOS, Windows) are left alone.
"""

from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger("graphamp")

_M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)

_kept: bool | None = None  # None: not tried in this process


def keep_freed_memory(name: str) -> bool:
    """Make glibc's malloc keep freed memory in this process (once; ``name``: the Graph that
    asked, for the log line). Returns whether it does; False where the C library is not
    glibc or refused a setting."""
    global _kept
    if _kept is None:
        _kept = _set_glibc_thresholds()
        if _kept:
            log.info(
                "%s: glibc's malloc now keeps freed memory in this process (mmap threshold "
                "%d MiB, no trimming): CPU steps reuse their buffers instead of faulting them in "
                "every step; config.set_keep_cpu_memory(False) leaves malloc as it was",
                name,
                MMAP_THRESHOLD >> 20,
            )
    return _kept


def _set_glibc_thresholds() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; -1 as the trim threshold is "never trim" (mallopt(3))
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, -1))
