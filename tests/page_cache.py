"""What the page cache holds of a file, and what this process's mappings of it hold, for tests
of how our files are read, mapped and written."""

from __future__ import annotations

import ctypes
import mmap
import re
from pathlib import Path

import numpy as np


def in_memory(address: int, size: int) -> np.ndarray:
    """Whether each 4 KiB page of [address, address + size) is in memory (mincore), from the
    page that holds `address` on."""
    page = mmap.PAGESIZE
    start = address // page * page
    pages = (ctypes.c_ubyte * -(-(address + size - start) // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(len(pages) * page), pages) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return np.frombuffer(pages, np.uint8) & 1 == 1


def cached_pages(path: Path) -> int:
    """Pages of the file the page cache holds (mincore)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = np.frombuffer(m, np.uint8)
        pages = int(in_memory(view.ctypes.data, len(m)).sum())
        del view  # before the mapping closes
    return pages


def resident(path: Path) -> list[tuple[int, int]]:
    """(size, resident bytes) of each mapping of `path` in this process (Linux' smaps)."""
    found, current = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", fields[0]):  # a mapping's first line
            start, end = (int(a, 16) for a in fields[0].split("-"))
            current = end - start if fields[5:] == [str(path.resolve())] else None
        elif fields[0] == "Rss:" and current is not None:
            found.append((current, int(fields[1]) * 1024))
    return found
