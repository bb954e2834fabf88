"""Q8_0 weights times float32 rows on a kernel of our own (`q8_product.c`), as a ggml custom
operation in our graphs: the talker's and the code predictor's products, where the CPU has
AVX2 (two variants of the same loops: AVX512-VNNI where it runs, else AVX2).

Generating a frame is reading the weights, and ggml's Q8_0 kernels do not read them at the
memory's speed: its arithmetic is the limit. On a Xeon (family 6 model 207), 160 MB of random
Q8_0 weights (`python -m kazeia_stream.engine.q8_product --mb 160`): one thread, one row, ggml
21.2 ms (7.5 GB/s) against 13.8 ms (11.5 GB/s) on either variant, four rows 38.0 against 17.4
(AVX512-VNNI) and 24.7 ms (AVX2); two threads, one row, 11.0 against 6.8 ms (23.5 GB/s; numpy's
max reads 15 and 26 GB/s on one and two threads). On an AMD Zen 1 (AVX2 at half width, no VNNI)
it keeps a small lead over ggml's in the engines (README, "Measured", 2026-12-03 afternoon)
once its threads claim the weight rows in chunks, as ggml's one-column product does, and its
tile bodies are inlined per row count: with fixed shares, a thread that the host or the codec
decoder held back held the whole product up, and the engines ran 25-35% slower than on ggml's.
Each thread takes its chunks from a contiguous share of its own first, the others' only once
it is done: on Zen 4 (family 25 model 17), two threads taking chunks in turn read 35-36 GB/s
where numpy's max read 61, from shares 49-52 (the same command).
This kernel: int8 products two blocks a register, weight rows in tiles that every row of x
passes, the weights prefetched far ahead. On AVX2 the two blocks are interleaved eight bytes at
a time (x laid out to match, with its magnitudes beside it), so that one conversion to float,
one product of the scales and one fmadd serve both, and each row signs the weights by x
instead of the weights' magnitudes being taken: on Zen 1 a third faster than a block a
register from registers (`tools/mac_rate.c`), 1.2x from memory. A row's numbers do not
depend on the rows beside it (the engines' batched streams rely on it), and they are within
float rounding of ggml's (1-3e-7 of the largest output: the rows are quantized as ggml does, per
block of 32 to int8).

A plain shared library that setuptools builds at install with the package (optional: without
a C compiler the products stay on ggml's kernels, as on a CPU without AVX2, or with
`KAZEIA_Q8_KERNEL=0`; `KAZEIA_Q8_KERNEL=avx2` holds a CPU with AVX512-VNNI to the AVX2 variant).
"""

from __future__ import annotations

from functools import cache

from gguf import GGMLQuantizationType as QType

from . import native
from .ggml_graph import Graph, Tensor, dims, strides, type_of

ENV = "KAZEIA_Q8_KERNEL"  # "0": ggml's kernels for every product; "avx2": our AVX2 variant


def variants() -> tuple[str, ...]:
    """The variants of the kernel this CPU runs, best first (none where it was not built)."""
    return native.variants("q8_product")


@cache
def chosen() -> str | None:
    """The variant the engines use: the best this CPU runs, unless `KAZEIA_Q8_KERNEL` says
    otherwise; None for ggml's kernels."""
    return native.chosen("q8_product", ENV)


def available() -> bool:
    """Whether the engines' Q8_0 products run on the kernel."""
    return chosen() is not None


def takes(w: Tensor) -> bool:
    """Whether the kernel multiplies weight `w`: a Q8_0 matrix, or a stack of them, with its
    rows in place, where the kernel runs."""
    return (
        type_of(w) == QType.Q8_0
        and dims(w)[3] == 1
        and strides(w)[1] == dims(w)[0] // 32 * 34
        and available()
    )


def product(g: Graph, w: Tensor, x: Tensor, variant: str | None = None, ids: Tensor | None = None) -> Tensor:
    """w @ x for `takes(w)` and the float32 columns of x [in, n]: [out, n], on `variant`
    (default: the chosen one). For a stack w, `ids` (int32, n in a row) names the matrix each
    column takes: the code predictor's heads, all the streams' columns in one product."""
    variant = variant or chosen()
    assert variant is not None, "the kernel does not run here"
    assert (ids is None) == (dims(w)[2] == 1), "a stack's product needs ids, a matrix's none"
    return g.product(native.address("q8_product", variant), w, x, ids)


def _bench(argv: list[str] | None = None) -> None:
    """`python -m kazeia_stream.engine.q8_product [--mb MB] [--rows 1,4] [--threads 1,2]`: ms
    per product of a random Q8_0 weight of about MB megabytes (larger than the caches: from
    memory), on ggml's kernel and on each variant of this one that runs here (median of 5)."""
    import argparse
    import time
    from functools import partial

    import numpy as np
    from gguf.quants import quantize

    from .ggml_graph import Allocator, ArrayTensor, products

    ap = argparse.ArgumentParser(description=_bench.__doc__)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--rows", type=lambda v: [int(n) for n in v.split(",")], default=[1, 4])
    ap.add_argument("--threads", type=lambda v: [int(n) for n in v.split(",")], default=[1, 2])
    args = ap.parse_args(argv)
    if not variants():
        raise SystemExit("the kernel is not built here, or this CPU lacks AVX2")
    rng = np.random.default_rng(0)
    block = quantize(rng.standard_normal((1024, 1024), dtype=np.float32), QType.Q8_0)
    data = np.tile(block, (max(1, args.mb * 10**6 // block.nbytes), 1))
    weight, allocator = ArrayTensor(data, QType.Q8_0, (len(data), 1024)), Allocator()
    ops = {"ggml": None, **{v: partial(product, variant=v) for v in variants()}}
    for threads in args.threads:
        for n in args.rows:
            x = rng.standard_normal((n, 1024), dtype=np.float32)
            figures = []
            for name, op in ops.items():
                times = []
                for _ in range(5):
                    start = time.perf_counter()
                    products(weight.tensor, x, allocator, threads, op)
                    times.append(time.perf_counter() - start)
                ms = 1e3 * float(np.median(times))
                ns = 1e6 * ms / (len(data) * 1024 // 32 * n)  # per block of 32 weights and row of x
                figures.append(f"{name} {ms:.1f} ms ({data.nbytes / ms / 1e6:.1f} GB/s, {ns:.2f} ns/32 MACs)")
            head = f"{data.nbytes / 1e6:.0f} MB, {threads} thread(s), {n} row(s)"
            print(f"{head}: {', '.join(figures)}", flush=True)
    allocator.close()
    weight.close()


if __name__ == "__main__":
    _bench()
