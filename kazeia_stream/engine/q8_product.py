"""Q8_0 weights times float32 rows on a kernel of our own (`q8_product.c`), as a ggml custom
operation in our graphs: the talker's and the code predictor's products, where the CPU has
AVX512-VNNI.

Generating a frame is reading the weights, and ggml's Q8_0 kernels do not read them at the
memory's speed: its arithmetic is the limit. On a Xeon (family 6 model 207), 160 MB of random
Q8_0 weights (`python -m kazeia_stream.engine.q8_product --mb 160`): one thread, one row, ggml
19.7 ms (8.1 GB/s) against 13.0 ms (12.2 GB/s) here, four rows 35.1 against 16.9 ms; two
threads, one row, 10.1 against 7.2 ms (22 GB/s; numpy's max reads 15 and 26 GB/s on one and
two threads). This kernel: int8 products two blocks a register, the weights prefetched far
ahead. A row's numbers do not depend on the rows beside it (the engines' batched streams rely
on it), and they are within float rounding of ggml's (1.5e-7 of the largest output: the rows
are quantized as ggml does, per block of 32 to int8).

A plain shared library that setuptools builds at install with the package (optional: without
a C compiler the products stay on ggml's kernels, as on a CPU without AVX512-VNNI, or with
`KAZEIA_Q8_KERNEL=0`).
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from gguf import GGMLQuantizationType as QType

from .ggml_graph import Graph, Tensor, dims, strides, type_of

ENV = "KAZEIA_Q8_KERNEL"  # "0": ggml's kernels for every product


@cache
def _kernel() -> tuple[ctypes.CDLL, int] | None:
    """The library and the address of its custom operation, where it was built and runs."""
    if os.environ.get(ENV) == "0":
        return None
    for suffix in EXTENSION_SUFFIXES:
        path = Path(__file__).with_name("_q8_product" + suffix)
        if path.exists():
            lib = ctypes.CDLL(str(path))
            if lib.kz_q8_supported():
                return lib, ctypes.cast(lib.kz_q8_product, ctypes.c_void_p).value or 0
    return None


def available() -> bool:
    """Whether the kernel runs here."""
    return _kernel() is not None


def takes(w: Tensor) -> bool:
    """Whether the kernel multiplies weight `w`: a Q8_0 matrix (not a stack) with its rows in
    place, where the kernel runs."""
    return (
        type_of(w) == QType.Q8_0
        and dims(w)[2:] == (1, 1)
        and strides(w)[1] == dims(w)[0] // 32 * 34
        and available()
    )


def product(g: Graph, w: Tensor, x: Tensor) -> Tensor:
    """w @ x for `takes(w)` and the float32 columns of x [in, n]: [out, n]."""
    kernel = _kernel()
    assert kernel is not None and type_of(x) == QType.F32 and dims(x)[2:] == (1, 1)
    if strides(x)[0] != 4:
        x = g.cont(x)  # the kernel reads each column contiguous
    return g.custom(kernel[1], (dims(w)[1], dims(x)[1]), [w, x])


def _bench(argv: list[str] | None = None) -> None:
    """`python -m kazeia_stream.engine.q8_product [--mb MB] [--rows 1,4] [--threads 1,2]`: ms
    per product of a random Q8_0 weight of about MB megabytes (larger than the caches: from
    memory), on ggml's kernel and on this one (median of 5)."""
    import argparse
    import time

    import numpy as np
    from gguf.quants import quantize

    from .ggml_graph import Allocator, ArrayTensor, products

    ap = argparse.ArgumentParser(description=_bench.__doc__)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--rows", type=lambda v: [int(n) for n in v.split(",")], default=[1, 4])
    ap.add_argument("--threads", type=lambda v: [int(n) for n in v.split(",")], default=[1, 2])
    args = ap.parse_args(argv)
    if not available():
        raise SystemExit("the kernel is not built here, or this CPU lacks AVX512-VNNI")
    rng = np.random.default_rng(0)
    block = quantize(rng.standard_normal((1024, 1024), dtype=np.float32), QType.Q8_0)
    data = np.tile(block, (max(1, args.mb * 10**6 // block.nbytes), 1))
    weight, allocator = ArrayTensor(data, QType.Q8_0, (len(data), 1024)), Allocator()
    for threads in args.threads:
        for n in args.rows:
            x = rng.standard_normal((n, 1024), dtype=np.float32)
            ms = {}
            for ours in (False, True):
                times = []
                for _ in range(5):
                    start = time.perf_counter()
                    products(weight.tensor, x, allocator, threads, product if ours else None)
                    times.append(time.perf_counter() - start)
                ms[ours] = 1e3 * float(np.median(times))
            print(
                f"{data.nbytes / 1e6:.0f} MB, {threads} thread(s), {n} row(s): ggml {ms[False]:.1f} ms "
                f"({data.nbytes / ms[False] / 1e6:.1f} GB/s), ours {ms[True]:.1f} ms "
                f"({data.nbytes / ms[True] / 1e6:.1f} GB/s)",
                flush=True,
            )
    allocator.close()
    weight.close()


if __name__ == "__main__":
    _bench()
