"""Zeroed memory handed back to the kernel: libllama writes zeros over a context's whole KV
cache when it creates it (so that padding cells hold no NaN), which makes every page of it
resident (the talker's 2048 positions per stream: 235 MB on the 0.6B), though a stream's K
cache is only resident where its cells are written. (V is stored transposed, one row of all
positions per channel, so any written cell touches every page of it: half the cache, per
stream that has run.)

A private anonymous page that holds only zeros reads the same after `madvise(MADV_DONTNEED)`
(the kernel maps a zero page until it is written), so releasing it changes no value: only
runs of such pages in mappings that appeared during the call are released, and only long ones
(a buffer, not a page of some allocator's bookkeeping). Elsewhere than Linux this does nothing.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

MADV_DONTNEED = 4
_MIN_RUN = 1 << 21  # bytes: 2 MiB, a huge page
_SCAN = 1 << 24  # bytes read at a time

Span = tuple[int, int]  # [start, end) addresses


def _anonymous() -> list[Span] | None:
    """The process's private anonymous read-write mappings, or None where /proc says nothing."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return None
    spans = []
    for line in lines:
        fields = line.split()
        if len(fields) == 5 and fields[1] == "rw-p":  # no path: anonymous
            start, end = fields[0].split("-")
            spans.append((int(start, 16), int(end, 16)))
    return spans


def _new(after: list[Span], before: list[Span]) -> Iterator[Span]:
    """The parts of `after` that no span of `before` covers."""
    for start, end in after:
        for b0, b1 in before:
            if b0 <= start < b1:
                start = b1
            elif start < b0 < end:
                yield start, b0
                start = min(b1, end)
            if start >= end:
                break
        if start < end:
            yield start, end


def _zero_runs(start: int, end: int) -> Iterator[Span]:
    """Runs of all-zero pages in [start, end), at least `_MIN_RUN` long."""
    page = mmap.PAGESIZE
    run = None
    for at in range(start, end, _SCAN):
        n = min(_SCAN, end - at)
        words = np.ctypeslib.as_array((ctypes.c_uint64 * (n // 8)).from_address(at))
        zero = ~words.reshape(-1, page // 8).any(axis=1)
        # page indices where a run of zero pages starts or ends
        edges = np.flatnonzero(np.diff(np.concatenate(([False], zero, [False])).astype(np.int8)))
        for i in range(0, len(edges), 2):
            r0, r1 = at + int(edges[i]) * page, at + int(edges[i + 1]) * page
            if run is not None and run[1] == r0:
                run = (run[0], r1)
                continue
            if run is not None and run[1] - run[0] >= _MIN_RUN:
                yield run
            run = (r0, r1)
    if run is not None and run[1] - run[0] >= _MIN_RUN:
        yield run


@contextmanager
def zeroed_pages_released() -> Iterator[None]:
    """Around a call that maps memory and fills much of it with zeros (libllama's context
    creation), give those zero pages back to the kernel."""
    before = _anonymous()
    yield
    after = _anonymous()
    if before is None or after is None:
        return
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for start, end in _new(after, before):
        if end - start >= _MIN_RUN:
            for r0, r1 in _zero_runs(start, end):
                madvise(r0, r1 - r0, MADV_DONTNEED)
