"""Keep freed memory in the process instead of handing it back to the system after every step.

glibc's malloc serves a large block (a convolution's activations, a gradient) from its own ``mmap`` and returns
it to the system when freed, and it trims the heap whenever its free top grows past a threshold; the next
training step then touches fresh pages again, one page fault per 4 KiB. ``benchmarks/train_throughput.py`` measures
what that costs (docs/performance.md). flatfl raises the mmap
threshold to glibc's ceiling (32 MiB on 64-bit, so blocks below it come from the heap and are reused) and the
trim threshold to 1 GiB: memory freed within a step is reused by the next. Nothing else changes: the peak memory is
the same; the process simply keeps what it has used until it exits. A no-op where the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's upper limit on 64-bit systems
TRIM_THRESHOLD = 1 << 30

_done = False


def keep_freed_memory() -> bool:
    """Apply the thresholds once per process; True when glibc took them."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    _done = ok
    return ok
