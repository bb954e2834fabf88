"""The C heap kept between frames (glibc's malloc), set once per process by the decoder.

A decoded frame allocates and frees about 20 MB of float32 buffers, 0.1-3 MB each (the later
blocks' activations, the Winograd planes). glibc's malloc gives the free memory at the top of
its heap back to the system once it exceeds a trim threshold, which it keeps at twice the
largest block it has served from a mapping of its own; so the next frame's buffers were new
pages, which the kernel zeroes on first write: 4,900 page faults a frame for the random 0.6B's
decoder (getrusage), and 169 against 180 ms a frame without them (`python -m
kazeia_stream.engine.codec`, four runs alternated). With fixed thresholds (blocks up to 32 MB
from the heap, 64 MB of free memory kept), 11 a frame. Settings the user gave glibc
(`GLIBC_TUNABLES`, `MALLOC_*_`) are left as they are, and other C libraries' mallocs.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache

import numpy as np

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for the threshold it adapts
TRIM_THRESHOLD = 64 << 20


@cache
def keep_freed_memory() -> bool:
    """Hold the heap's freed memory for the next frame, once per process; whether it did."""
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") or any(
        name.startswith("MALLOC_") and name.endswith("_") for name in os.environ
    ):
        return False
    if not _glibc():
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def _glibc() -> bool:
    """Whether the process runs on glibc."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError):  # no such name here (not glibc, not POSIX)
        return False


def reserve(nbytes: int) -> None:
    """Grow the heap by `nbytes` now (written, then freed), once `keep_freed_memory` holds the
    freed memory: the first frame's buffers are then resident pages too."""
    if keep_freed_memory():
        np.empty(nbytes, np.uint8).fill(0)
