"""What the page cache holds of a file, and what this process's mappings of it hold, for tests
of how our files are read, mapped and written."""

from __future__ import annotations

import ctypes
import mmap
import re
from pathlib import Path

import numpy as np


def cached_pages(path: Path) -> int:
    """Pages of the file the page cache holds (mincore)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = np.frombuffer(m, np.uint8)
        pages = (ctypes.c_ubyte * -(-len(m) // mmap.PAGESIZE))()
        libc = ctypes.CDLL(None)
        assert libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(len(m)), pages) == 0
        del view  # before the mapping closes
    return sum(page & 1 for page in pages)


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
