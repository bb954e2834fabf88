"""Multiply-adds a second of the engines' one-row products with their weights in the caches:
the arithmetic side of `bench`'s floors, beside the memory's (`bandwidth.read_gb_s`).

A frame reads each weight once for one row of input, so it is bound by the memory or by the
product's arithmetic, whichever is slower: on an AMD Zen 1 (AVX2 on 128-bit units, no VNNI)
our Q8_0 kernel on one thread ran 2.82-2.93 ns per 32 multiply-adds from the L2 against
3.08-3.27 from memory, and a Q4_K_M talker, 0.36 GB a step against Q8_0's 0.65, took as long
(51 against 48 ms): its products are bound by the same int8 multiplies.

Measured in a process of its own (`rates`): a graph run on several threads from another thread
of the benchmark's process starts a second pool of libgomp's threads beside the generator's,
which then outnumber the cores and sleep at every barrier (see `threads.py`). On 2 cores of an
Intel Xeon with AMX, the pipeline's code predictor took 81-102 ms a frame after the rates had
been measured in its process, against 51-56 ms before and without them.

    python -m kazeia_stream.engine.product_rate THREADS QTYPE [QTYPE ...]   # one rate a line
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Iterable

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from .ggml_graph import Allocator, ArrayTensor, Graph, view_of
from .qwen3 import convert, product_kernel

WEIGHT_BYTES = 2_500_000  # at most: in the caches (Zen 1's L3 is 8 MB), larger than the calls' costs
CHAIN = 32  # products in one graph, each one's output the next one's input


def side(qtype: QType) -> int:
    """The side of the square weight timed: a multiple of 256 (a K-quant's block), its bytes at
    most `WEIGHT_BYTES` (1280 at Q8_0, 2048 at Q4_K, 1024 at F16)."""
    block, size = GGML_QUANT_SIZES[qtype]
    return max(256, int(math.sqrt(WEIGHT_BYTES * block / size)) // 256 * 256)


def macs_per_s(qtype: QType, threads: int, repeat: int = 5) -> float:
    """Multiply-adds a second of a `qtype` weight times one row on `threads` threads, by the
    product the engines use for it (our kernel where one takes it, else ggml's): the fastest
    of `repeat` calls of a graph of `CHAIN` products over one weight kept in the caches."""
    n = side(qtype)
    rng = np.random.default_rng(0)
    values = rng.standard_normal((n, n), dtype=np.float32) / np.float32(math.sqrt(n))  # norms kept
    weight, allocator, g = ArrayTensor(convert(values, qtype), qtype, (n, n)), Allocator(), Graph(CHAIN + 4)
    try:
        kernel = product_kernel(weight.tensor)
        x = y = g.input(QType.F32, (1, n))
        for _ in range(CHAIN):
            y = kernel.product(g, weight.tensor, y) if kernel else g.mul_mat(weight.tensor, y)
        g.output(y)
        g.allocate(allocator)
        view_of(x, QType.F32, (n,))[...] = rng.standard_normal(n, dtype=np.float32)
        g.compute(threads)  # the weight into the caches, the threads started
        best = np.inf
        for _ in range(repeat):
            start = time.perf_counter()
            g.compute(threads)
            best = min(best, time.perf_counter() - start)
        return CHAIN * n * n / best
    finally:
        g.close()
        allocator.close()
        weight.close()


def rates(qtypes: Iterable[QType], threads: int) -> dict[QType, float]:
    """`macs_per_s` of each type on `threads` threads, in a child process (one for all)."""
    qtypes = sorted(set(qtypes))
    out = subprocess.run(
        [sys.executable, "-m", __name__, str(threads), *(q.name for q in qtypes)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(zip(qtypes, map(float, out.split())))


if __name__ == "__main__":
    for name in sys.argv[2:]:
        print(macs_per_s(QType[name], int(sys.argv[1])), flush=True)
