"""The host allocator: keep freed memory for the next step instead of handing
it back to the operating system.

A step allocates and frees the same large activations every time (a prefill
chunk of 1,024 tokens: a 6 MB gate/up product per layer; a 2,048-token step
twice that). glibc's malloc serves a block above its mmap threshold with a
fresh `mmap` and unmaps it on free, and trims the top of its heaps once more
than its trim threshold lies free there. Either way the next step touches new
pages, and every page costs a page fault and a zeroed page. The dynamic
threshold that glibc raises after such a free does not hold in an engine
whose allocations interleave (several sizes, several threads' arenas).

Measured on the 2-core Xeon (a microVM, where a fault costs ~6 us): the bf16
gate/up output of a 1,024-token chunk took 9.4 ms to convert to float32
inside the engine (0.17 ms alone, on pages already mapped), more than the
product itself; steps of 2,048 prompt tokens ran 1.4-1.7x slower than with
the thresholds below. This is what PyTorch's CPU performance guides get by
preloading jemalloc or tcmalloc; glibc's own `mallopt` does it with no
dependency.

`tune()` sets, through `mallopt`, an mmap threshold of 32 MiB (glibc's
largest) and a trim threshold of 1 GiB: blocks up to 32 MiB come from the
heaps and stay there once freed, so the process keeps its high-water mark of
such memory (the activations of its largest step) instead of faulting it in
again every step. It does nothing where the C library is not glibc, where
`STEPSERVE_HOST_MALLOC=0`, or where the user set glibc's own
`MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` (theirs stand).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger("stepserve.host_memory")

ENV = "STEPSERVE_HOST_MALLOC"
# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's HEAP_MAX_SIZE / 2 on 64-bit: the most mallopt accepts
TRIM_THRESHOLD = 1 << 30

_done: dict | None = None


def tune() -> dict:
    """Sets the thresholds once per process; returns what was done
    (`{"applied": bool, "reason": str, ...}`), also on later calls."""
    global _done
    if _done is not None:
        return _done
    _done = _tune()
    if _done["applied"]:
        log.debug("host malloc: mmap threshold %d, trim threshold %d", MMAP_THRESHOLD, TRIM_THRESHOLD)
    return _done


def _tune() -> dict:
    if os.environ.get(ENV, "1").strip() == "0":
        return {"applied": False, "reason": f"{ENV}=0"}
    if any(os.environ.get(v) for v in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return {"applied": False, "reason": "glibc's MALLOC_*_THRESHOLD_ set in the environment"}
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return {"applied": False, "reason": "not glibc"}
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return {"applied": False, "reason": "no mallopt"}
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return {"applied": ok, "reason": "" if ok else "mallopt refused",
            "mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD}
