"""Memory read bandwidth, measured in a process of its own: the buffers must be larger than the
caches, and in the benchmark's process they would count in the peak RSS it reports.

    python -m kazeia_stream.bandwidth THREADS [THREADS ...]   # GB/s for each count, one a line
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from collections.abc import Iterable

import numpy as np

BUFFER_BYTES = 1 << 28  # per thread: more than the last-level caches of the machines measured
REPEAT = 5


def measure(threads: int) -> float:
    """GB/s read on `threads` threads: numpy's max of a buffer of `BUFFER_BYTES` each, in Python
    threads (a large reduction releases the GIL), best of `REPEAT`. Its max, not its sum: the
    sum adds pairwise and is the slower (on a Xeon of family 6 model 207, one thread: 8 GB/s
    against 13-15; two: 14-17 against 27-29), and our Q8_0 kernel reads faster than the sum."""
    buffers = [np.ones(BUFFER_BYTES // 4, np.float32) for _ in range(threads)]
    best = math.inf
    for _ in range(REPEAT):
        workers = [threading.Thread(target=np.max, args=(b,)) for b in buffers]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - start)
    return threads * BUFFER_BYTES / best / 1e9


def read_gb_s(counts: Iterable[int]) -> dict[int, float]:
    """`measure` for each thread count, in a child process (one for all the counts)."""
    counts = sorted(set(counts))
    out = subprocess.run(
        [sys.executable, "-m", __name__, *map(str, counts)], capture_output=True, text=True, check=True
    ).stdout
    return dict(zip(counts, map(float, out.split())))


if __name__ == "__main__":
    for n in sys.argv[1:]:
        print(measure(int(n)), flush=True)
