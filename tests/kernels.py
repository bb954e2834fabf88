"""What the tests of our ggml custom operations (`q8_product`, `kquant_product`) share: each runs
on every variant of its kernel that this CPU runs, and replays graphs of its products."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from kazeia_stream.engine import native
from kazeia_stream.engine.ggml_graph import Allocator, Graph, view_of


def on_variant(kernel, variant: str):
    """`kernel.product` (a `quantized_product.Kernel`'s) on `variant`; the test is skipped
    where the CPU does not run it."""
    if variant not in kernel.variants():
        pytest.skip(f"this CPU does not run the {variant} variant")
    return partial(kernel.product, variant=variant)


def on_each_variant(kernel):
    """The mark that skips a test module where `kernel` was not built or the CPU lacks AVX2,
    and the `op` fixture: `on_variant` for each variant."""
    mark = pytest.mark.skipif(not kernel.variants(), reason="the kernel is not built, or this CPU lacks AVX2")

    @pytest.fixture(params=native.VARIANTS)
    def op(request):
        return on_variant(kernel, request.param)

    return mark, op


def replays(w, shape, op, x, threads):
    """One graph of three products of w (each its own operation), replayed once per entry of
    `threads` on that many threads: each replay's three results."""
    m, k = shape
    allocator, g = Allocator(), Graph(8)
    try:
        columns = g.input(QType.F32, (len(x), k))
        ys = [g.output(op(g, w, columns)) for _ in range(3)]
        g.allocate(allocator)
        view_of(columns, QType.F32, (len(x), k))[...] = x
        results = []
        for n in threads:
            for y in ys:
                view_of(y, QType.F32, (len(x), m))[...] = np.nan
            g.compute(n)
            results.append([view_of(y, QType.F32, (len(x), m)).copy() for y in ys])
        return results
    finally:
        g.close()
        allocator.close()
