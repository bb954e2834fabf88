"""What the page cache holds of a file, for tests of how our files are read and written."""

from __future__ import annotations

import ctypes
import mmap
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
