"""Zeroed memory handed back to the kernel: libllama writes zeros over a context's whole KV
cache when it creates it (so that padding cells hold no NaN), which makes every page of it
resident (the talker's 2048 positions per stream: 235 MB on the 0.6B), though a stream's K
cache is only resident where its cells are written. (V is stored transposed, one row of all
positions per channel, so any written cell touches every page of it: half the cache, per
stream that has run.)

A private anonymous page that holds only zeros reads the same after `madvise(MADV_DONTNEED)`
(the kernel maps a zero page until it is written), so releasing it changes no value. What is
released is only a run of resident zero pages in mappings that appeared during the call, as
long as the buffer (within a page). Another thread's fresh memory, zero for a moment before it
writes it (a huge page being filled), would have to be exactly that long to be taken for the
buffer and lose a write: checking the length is what makes this safe beside other threads (a
rule that released every long zero run gave other audio when the decoder's weights were read
in another thread meanwhile). A buffer that shares its run with other zero pages is left as it
is.
Elsewhere than Linux this does nothing.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

MADV_DONTNEED = 4
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


def _runs(mask: np.ndarray) -> Iterator[tuple[int, int]]:
    """The [i0, i1) runs of True in `mask`."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).astype(np.int8)))
    return zip(edges[::2].tolist(), edges[1::2].tolist())


def _zero_runs(libc: ctypes.CDLL, start: int, end: int, size: int) -> Iterator[Span]:
    """Runs of resident all-zero pages in [start, end) as long as `size` bytes, within a page.
    Only resident pages are read (`mincore`): reading the others would fault each one in."""
    page = mmap.PAGESIZE
    vec = (ctypes.c_ubyte * ((end - start) // page))()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) != 0:
        return
    zero = np.ctypeslib.as_array(vec) & 1 != 0  # resident, then: and all zero
    for i0, i1 in _runs(zero):
        for c0 in range(i0, i1, _SCAN // page):
            c1 = min(i1, c0 + _SCAN // page)
            words = (ctypes.c_uint64 * ((c1 - c0) * page // 8)).from_address(start + c0 * page)
            zero[c0:c1] = ~np.ctypeslib.as_array(words).reshape(c1 - c0, page // 8).any(axis=1)
    for i0, i1 in _runs(zero):
        if abs((i1 - i0) * page - size) <= page:
            yield start + i0 * page, start + i1 * page


@contextmanager
def zeroed_pages_released(size: int) -> Iterator[None]:
    """Around a call that allocates a buffer of `size` bytes and fills it with zeros (libllama's
    context creation, its KV cache), give the buffer's pages back to the kernel."""
    before = _anonymous()
    yield
    after = _anonymous()
    if before is None or after is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for start, end in _new(after, before):
        if end - start >= size - mmap.PAGESIZE:
            for r0, r1 in _zero_runs(libc, start, end, size):
                libc.madvise(ctypes.c_void_p(r0), ctypes.c_size_t(r1 - r0), MADV_DONTNEED)
