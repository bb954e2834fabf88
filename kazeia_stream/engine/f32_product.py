"""Float32 weights times float32 columns on a kernel of our own (`f32_product.c`), as a ggml
custom operation: the codec decoder's products of few columns a frame (`codec.Matrix`).

Two reasons. ggml's float32 kernels give a column other numbers alone (its one-column kernel)
than beside others (llamafile's tiles), so the decoder took a layer of one column a frame
through the one-column kernel column by column, even for several streams' columns; this
kernel sums every element of the product in one order whatever the columns beside it, so
several streams, and several frames, share one product bit for bit. And it is faster on the
decoder's shapes: on Zen 4, each timed alone through a graph (768x768 by 9 and 36 columns,
384x384 by 40 and 160, 3840x768 by 32, 192x192 by 160), 31-37 G multiply-adds a second on
llamafile's tiles, 38-52 G on the AVX2 variant and 38-50 G on the AVX-512 one, whose tiles
now sum their 16 accumulators together (README, "Measured", 2026-12-04 evening and night).

A plain shared library that setuptools builds at install with the package (optional: without a
C compiler, or on a CPU without AVX2, or with `KAZEIA_F32_KERNEL=0`, the products run on
ggml's kernels; `KAZEIA_F32_KERNEL=avx2` holds a CPU with AVX-512 to the AVX2 variant). The
variants sum in lanes of 16 and 8: each gives its own numbers, within float rounding.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from . import native
from .ggml_graph import Graph, Tensor

ENV = "KAZEIA_F32_KERNEL"  # "0": ggml's kernels; "avx2": our AVX2 variant
PANEL = 16  # rows of a packed weight's panel (f32_product.c)


def variants() -> tuple[str, ...]:
    """The variants of the kernel this CPU runs, best first (none where it was not built)."""
    return native.variants("f32_product")


@cache
def chosen() -> str | None:
    """The variant the decoder uses (fixed at its load): the best this CPU runs, unless
    `KAZEIA_F32_KERNEL` says otherwise; None for ggml's kernels."""
    return native.chosen("f32_product", ENV)


def product(g: Graph, w: Tensor, x: Tensor, variant: str | None = None, panels: bool = False) -> Tensor:
    """w @ x for a float32 matrix w [in, out] and the float32 columns of x [in, n]: [out, n],
    on `variant` (default: the chosen one). w holds its rows in place, or is `panels`: w's
    bytes are `pack(W)` and out is W's rows rounded up to PANEL (the rows beyond, zeros)."""
    variant = variant or chosen()
    assert variant is not None, "the kernel does not run here"
    return g.product(native.address("f32_product", variant, "panels" if panels else ""), w, x)


def pack(w: np.ndarray) -> np.ndarray:
    """A float32 matrix [out, in] as the kernel's panels take it: PANEL rows at a time, each
    panel [in, PANEL], the rows beyond `out` zero: [ceil(out / PANEL), in, PANEL]."""
    out, k = w.shape
    padded = np.zeros((-(-out // PANEL) * PANEL, k), np.float32)
    padded[:out] = w
    return np.ascontiguousarray(padded.reshape(-1, PANEL, k).transpose(0, 2, 1))
