"""Float32 weights times float32 columns on a kernel of our own (`f32_product.c`): the codec
decoder's products (`codec.Matrix`), as a ggml custom operation for those of few columns a
frame (the weights in place, read from memory), called directly for the others (`multiply`).

Two reasons. ggml's float32 kernels give a column other numbers alone (its one-column kernel)
than beside others (llamafile's tiles), and OpenBLAS' depend on the column count, so the
decoder took a layer of one column a frame through the one-column kernel column by column,
and the later layers one frame's columns at a time; this kernel sums every element of the
product in one order whatever the columns beside it, so several streams, and several frames,
share one product bit for bit. And it is faster on the decoder's shapes. The operation's
tiles give each element a vector of lanes over the inner index, summed across at the end: on
Zen 4, each timed alone through a graph (768x768 by 9 and 36 columns, 384x384 by 40 and 160,
3840x768 by 32, 192x192 by 160), 31-37 G multiply-adds a second on llamafile's tiles, 38-52 G
on these (README, "Measured", 2026-12-04 evening and night). The direct calls' tiles are outer
products, one chain of fmadds an element, no sums across lanes: 55-58 G in a throw-away loop
of the same shapes (a core's FMAs do 58 G), on W packed in panels for columns of contiguous
numbers (Winograd's planes) or on W in place for rows of them (the decoder's buffers); with
no copies of the columns in and out, which a graph takes, or of W, which OpenBLAS packs.

A plain shared library that setuptools builds at install with the package (optional: without a
C compiler, or on a CPU without AVX2, or with `KAZEIA_F32_KERNEL=0`, the products run on
ggml's kernels and numpy's BLAS; `KAZEIA_F32_KERNEL=avx2` holds a CPU with AVX-512 to the AVX2
variant). The operation's variants sum in lanes of 16 and 8, each its own numbers within float
rounding; the direct calls give the same numbers on both.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache

import numpy as np

from . import native
from .ggml_graph import Graph, Tensor

ENV = "KAZEIA_F32_KERNEL"  # "0": ggml's kernels; "avx2": our AVX2 variant
PANEL = 16  # rows of a packed weight's panel (`multiply`, f32_product.c)


def variants() -> tuple[str, ...]:
    """The variants of the kernel this CPU runs, best first (none where it was not built)."""
    return native.variants("f32_product")


@cache
def chosen() -> str | None:
    """The variant the decoder uses (fixed at its load): the best this CPU runs, unless
    `KAZEIA_F32_KERNEL` says otherwise; None for ggml's kernels."""
    return native.chosen("f32_product", ENV)


def product(g: Graph, w: Tensor, x: Tensor, variant: str | None = None) -> Tensor:
    """w @ x for a float32 matrix w [in, out] with its rows in place and the float32 columns of
    x [in, n]: [out, n], on `variant` (default: the chosen one)."""
    variant = variant or chosen()
    assert variant is not None, "the kernel does not run here"
    return g.product(native.address("f32_product", variant), w, x)


def pack(w: np.ndarray) -> np.ndarray:
    """A float32 matrix [out, in] as `multiply`'s panels take it: PANEL rows at a time, each
    panel [in, PANEL], the rows beyond `out` zero: [ceil(out / PANEL), in, PANEL]."""
    out, k = w.shape
    padded = np.zeros((-(-out // PANEL) * PANEL, k), np.float32)
    padded[:out] = w
    return np.ascontiguousarray(padded.reshape(-1, PANEL, k).transpose(0, 2, 1))


_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGS = {  # f32_product.c's direct calls
    "panels": [_P, _I, _I, _P, _I, _I, _P, _I],
    "rows": [_P, _I, _I, _I, _P, _I, _I, _P, _I],
}


@cache
def _function(variant: str, op: str) -> Callable[..., None]:
    fn = native.function("f32_product", variant, op)
    fn.argtypes, fn.restype = _ARGS[op], None
    return fn


def _at(a: np.ndarray) -> int:
    """An array's address (quicker than `.ctypes.data`)."""
    return int(a.__array_interface__["data"][0])


def multiply(w: np.ndarray, shape: tuple[int, int], x: np.ndarray, out: np.ndarray, variant: str) -> None:
    """out = W @ x on one thread, called directly on the caller's buffers, for W of `shape`
    [m, k]: either `pack(W)` (3-D), x's and out's columns each contiguous (Winograd's planes),
    or W in place, x's and out's rows contiguous (the decoder's channel-major buffers). Every
    element is one chain of fmadds over k in order either way: the same numbers."""
    (m, k), n = shape, x.shape[1]
    assert x.shape[0] == k and out.shape == (m, n) and x.dtype == out.dtype == w.dtype == np.float32
    if w.ndim == 3:
        assert x.strides[0] == out.strides[0] == 4, "panels take columns of contiguous numbers"
        x_col, out_col = x.strides[1] // 4, out.strides[1] // 4
        _function(variant, "panels")(_at(w), m, k, _at(x), x_col, n, _at(out), out_col)
    else:
        assert x.strides[1] == out.strides[1] == w.strides[1] == 4, "rows of contiguous numbers"
        w_row, x_row, out_row = w.strides[0] // 4, x.strides[0] // 4, out.strides[0] // 4
        _function(variant, "rows")(_at(w), m, k, w_row, _at(x), x_row, n, _at(out), out_row)
