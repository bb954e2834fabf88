"""Float32 weights times float32 columns on a kernel of our own (`f32_product.c`), called
directly on the codec decoder's own buffers (`codec.Matrix`), on one thread; packed weights
may be float16 as a file stores them, widened in the registers: the same numbers.

Two reasons. ggml's float32 kernels give a column other numbers alone (its one-column kernel)
than beside others (llamafile's tiles), and OpenBLAS's depend on the column count, so the
decoder took a layer of one column a frame through the one-column kernel column by column, and
the later layers one frame's columns at a time; this kernel sums every element of a product in
one order whatever the columns beside it (one chain of fmadds over the inner index), so
several streams, and several frames, share one product bit for bit. And it is faster: its
tiles are outer products, with no sums across lanes at the end, 55-58 G multiply-adds a second
on the decoder's shapes in a throw-away loop on Zen 4 (a core's FMAs do 58 G; OpenBLAS 47-53 G,
our earlier tiles of lanes over the inner index 38-50 G); on the weight packed in panels (for
columns of contiguous numbers, Winograd's planes, and for few columns, where the panels stream
from memory at 32-43 GB/s against 17-35 for four rows at a time in place) or in place (rows of
contiguous numbers: the decoder's channel-major buffers, many columns); with no copies of the
columns in and out, which a ggml graph takes, or of the weights, which OpenBLAS packs at every
call (README, "Measured", 2026-12-04, late night).

A plain shared library that setuptools builds at install with the package (optional: without a
C compiler, or on a CPU without AVX2, or with `KAZEIA_F32_KERNEL=0`, the products run on
ggml's kernels and numpy's BLAS; `KAZEIA_F32_KERNEL=avx2` holds a CPU with AVX-512 to the AVX2
variant, which gives the same numbers).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache

import numpy as np

from . import native

ENV = "KAZEIA_F32_KERNEL"  # "0": ggml's kernels and numpy's BLAS; "avx2": our AVX2 variant
PANEL = 16  # rows of a packed weight's panel (`multiply`, f32_product.c)


def variants() -> tuple[str, ...]:
    """The variants of the kernel this CPU runs, best first (none where it was not built)."""
    return native.variants("f32_product")


@cache
def chosen() -> str | None:
    """The variant the decoder uses (fixed at its load): the best this CPU runs, unless
    `KAZEIA_F32_KERNEL` says otherwise; None for ggml's kernels."""
    return native.chosen("f32_product", ENV)


def pack(w: np.ndarray) -> np.ndarray:
    """A float32 or float16 matrix [out, in] (any strides: a transposed view will do) as
    `multiply`'s panels take it, in its own type: PANEL rows at a time, each panel [in, PANEL],
    the rows beyond `out` zero: [ceil(out / PANEL), in, PANEL], in one pass of our kernel's
    (numpy's transposes took 3x as long to load the decoder)."""
    out, k = w.shape
    packed = np.empty((-(-out // PANEL), k, PANEL), w.dtype)
    row, col = (s // w.itemsize for s in w.strides)
    _function("pack" + _WEIGHTS[w.dtype])(_at(w), out, k, row, col, _at(packed))
    return packed


_WEIGHTS = {np.dtype(np.float32): "", np.dtype(np.float16): "16"}  # a packing's op suffix
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGS = {  # f32_product.c's direct calls (their float16 twins take the same)
    "pack": [_P, _I, _I, _I, _I, _P],
    "panels": [_P, _I, _I, _P, _I, _I, _P, _I],
    "rows": [_P, _I, _I, _I, _P, _I, _I, _P, _I],
}


@cache
def _function(op: str, variant: str | None = None) -> Callable[..., None]:
    """f32_product.c's `op` on `variant`, or, without one, the op all variants share (`pack`)."""
    if variant is None:
        lib = native.library("f32_product")
        assert lib is not None, "the kernel is not built here"
        fn = getattr(lib, f"kz_f32_product_{op}")
    else:
        fn = native.function("f32_product", variant, op)
    fn.argtypes, fn.restype = _ARGS[op.removesuffix("16")], None
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
    assert x.shape[0] == k and out.shape == (m, n) and x.dtype == out.dtype == np.float32
    if w.ndim == 3:
        assert x.strides[0] == out.strides[0] == 4, "panels take columns of contiguous numbers"
        x_col, out_col = x.strides[1] // 4, out.strides[1] // 4
        _function("panels" + _WEIGHTS[w.dtype], variant)(_at(w), m, k, _at(x), x_col, n, _at(out), out_col)
    else:
        assert w.dtype == np.float32, "weights in place are float32"
        assert x.strides[1] == out.strides[1] == w.strides[1] == 4, "rows of contiguous numbers"
        w_row, x_row, out_row = w.strides[0] // 4, x.strides[0] // 4, out.strides[0] // 4
        _function("rows", variant)(_at(w), m, k, w_row, _at(x), x_row, n, _at(out), out_row)
