"""The codec decoder's matrix products W @ X, and where each runs: on our float32 kernel
(`f32_product`) called directly on the layers' own buffers where it runs; else, for products of
few columns per frame (reading the weights is their cost) and those that several streams share,
in ggml graphs, which read the weights in place, where OpenBLAS first packs them, and for the
others on numpy's BLAS. Exact streaming needs a column's numbers not to depend on the columns
that come with it (`Matrix`).
"""

from __future__ import annotations

from functools import cache
from typing import Literal

import numpy as np
from gguf import GGMLQuantizationType as QType
from threadpoolctl import ThreadpoolController

from ..ggml_lib import widen
from . import f32_product
from .ggml_graph import Allocator, ArrayTensor, Graph, strides, view_of
from .threads import DECODER_GGML_THREADS
from .weight_cache import UNSAVED, WeightCache

# OpenBLAS' SkylakeX-family cores multiply a small product (M * N * K <= 100^3) with a kernel
# that packs nothing. With a few columns, packing the weights is most of an sgemm's cost: W @ X
# in row blocks of that size measured 1.3-2x faster than one sgemm from 2 to 32 columns (as
# fast at 64, slower from 128).
SMALL_GEMM_MNK = 100**3
SMALL_GEMM_MAX_COLUMNS = 32
SMALL_GEMM_CORES = ("skylakex", "cooperlake", "sapphirerapids")
# Floats of padding after each column of a `by_column` product's input (a cache line).
_ROW_PAD = 16

F32 = np.float32


@cache
def _small_gemm() -> bool:
    """Whether numpy's BLAS is an OpenBLAS with the small-matrix kernel (SMALL_GEMM_CORES)."""
    infos = ThreadpoolController().select(internal_api="openblas").info()
    return any(str(info.get("architecture", "")).lower() in SMALL_GEMM_CORES for info in infos)


def matmul(w: np.ndarray, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """w @ x for x [K, n]. One column goes through gemv, faster than OpenBLAS' sgemm for it; a
    few columns in row blocks of w that OpenBLAS' small-matrix kernel takes, where it has one."""
    (m, k), n = w.shape, x.shape[1]
    if n == 1:
        y = np.dot(w, x[:, 0])[:, None]
        if out is None:
            return y
        out[...] = y
        return out
    rows = SMALL_GEMM_MNK // (n * k)
    if not 0 < rows < m or n > SMALL_GEMM_MAX_COLUMNS or not _small_gemm():
        return np.matmul(w, x, out=out)
    if out is None:
        out = np.empty((m, n), F32)
    for r in range(0, m, rows):
        np.matmul(w[r : r + rows], x, out=out[r : r + rows])
    return out


class Matrix:
    """A weight W [out, in] (float32, or float16 as a file may store it) and W @ X. A column's
    numbers must not depend on the columns that come with it (other frames of a push, other
    streams). The decoder's load chooses where it runs. On our kernel where it runs
    (`multiply_directly`), called on the caller's buffers, its numbers never do: W copied into
    `panels`, for inputs whose columns each hold contiguous numbers (`column_major`: Winograd's
    planes) and for few columns a frame (the weights stream from memory faster so), or W in
    place, for the others. Else on ggml's graphs once `allocator` is set (few columns per
    frame: they read W in place, where OpenBLAS first packs it; and the columns of several
    streams at once), whose several-column kernel gives the same numbers for any count of at
    least two, its one-column kernel others, so a layer of one column per frame (`by_column`)
    takes every column through the one-column kernel (ggml does when the columns are not
    contiguous: they are read with a row of padding); or on numpy's BLAS, whose numbers depend
    on the count: the decoder calls those layers with one frame's columns at a time."""

    def __init__(self, w: np.ndarray, column_major: bool = False) -> None:
        # W, or its panels. Float16 as the file stores it until the load places it: its panels
        # hold the same numbers in half the bytes (products of few columns are bound by reading
        # them); elsewhere it is widened (`multiply_directly`, `widen`)
        self.array = w if w.dtype == np.float16 else float32(w)
        self.shape: tuple[int, int] = self.array.shape  # W's
        self.column_major = column_major
        self.allocator: Allocator | None = None
        self.by_column = False
        self.variant: str | None = None  # our kernel's, once `multiply_directly`
        self._tensor: ArrayTensor | None = None
        self._graphs: dict[int, tuple[Graph, np.ndarray, np.ndarray]] = {}

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """W @ x for x [in, n] (a column view of a buffer will do)."""
        if self.variant is not None:
            return self._multiply(x, out)
        if self.allocator is None:
            return matmul(self.array, x, out)
        graph, columns, result = self._graph(x.shape[1])
        np.copyto(columns, x.T)
        graph.compute(DECODER_GGML_THREADS)
        if out is None:  # a copy: the result's memory is the next product's (one buffer)
            return result.T.copy()
        np.copyto(out, result.T)
        return out

    def multiply_directly(self, variant: str, panels: bool, cache: WeightCache = UNSAVED) -> None:
        """From now on, multiply on our kernel's `variant`, called directly: W in place, or
        copied into `panels` (the row-major copy let go), of float16 where the file stores W so;
        a copy made, or taken from `cache`."""
        self.variant, w = variant, self.array
        if panels:
            shape = f32_product.packed_shape(w.shape)
            self.array = cache.final(shape, w.dtype, lambda: f32_product.pack(w))
        elif w.dtype != F32 or not w.flags.c_contiguous:  # else in place as it is
            self.array = cache.final(w.shape, np.dtype(F32), lambda: float32(w))

    def widen(self) -> None:
        """W as float32 from now on, where the file stores it in float16."""
        self.array = float32(self.array)

    @property
    def panels(self) -> bool:
        """Whether W is held packed in panels (`f32_product.pack`: 3-D)."""
        return self.array.ndim == 3

    def _multiply(self, x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """On our kernel: x and `out` in the layout it takes are used in place, others copied."""
        assert self.variant is not None
        order: Literal["C", "F"] = "F" if self.panels else "C"
        if out is not None and _in_order(out, order):
            y = out
        else:
            y = np.empty((self.shape[0], x.shape[1]), F32, order=order)
        x = x if _in_order(x, order) else np.asarray(x, order=order)
        f32_product.multiply(self.array, self.shape, x, y, self.variant)
        if out is None:  # in C order: numpy's reductions sum a column otherwise in another order
            return np.ascontiguousarray(y)
        if y is not out:
            np.copyto(out, y)
        return out

    def prepare(self, n: int) -> None:
        """Build the product's graph for n columns now, where it runs on ggml's kernels, not at
        its first call (the decoder's load does, for a frame of one stream)."""
        if self.allocator is not None:
            self._graph(n)

    def _graph(self, n: int) -> tuple[Graph, np.ndarray, np.ndarray]:
        """The product's graph for n columns on ggml's kernels: one product, its input [n, in]
        and output [n, out] (ggml's column-major orientation) as numpy views; `by_column` the
        input's rows are padded and the product reads a view of them (not contiguous:
        llamafile's several-column kernel declines it, and ggml's own loop takes each column
        alone)."""
        assert self.allocator is not None
        if n not in self._graphs or not self._graphs[n][0].placed:
            if self._tensor is None:
                self._tensor = ArrayTensor(self.array)
            w, (m, k) = self._tensor.tensor, self.shape
            width = k + _ROW_PAD if self.by_column else k
            g = Graph(4)
            x = g.input(QType.F32, (n, width))
            columns = g.view(x, (k, n), (strides(x)[1],)) if self.by_column else x
            y = g.output(g.mul_mat(w, columns))
            g.allocate(self.allocator)
            self._graphs[n] = (g, view_of(x, QType.F32, (n, width))[:, :k], view_of(y, QType.F32, (n, m)))
        return self._graphs[n]


def _in_order(a: np.ndarray, order: str) -> bool:
    """Whether a 2-D array's rows ("C") or columns ("F") each hold contiguous float32s."""
    return a.dtype == F32 and a.strides[1 if order == "C" else 0] == 4


def float32(w: np.ndarray, columns: int = 16) -> np.ndarray:
    """A matrix as C-ordered float32: w itself where it is one (a weight used in place in the
    file's mapping), else a copy; a transposed view's a few columns at a time. numpy copies a
    transposed view in the output's order, reading one float per source cache line; a few of
    the source's rows at a time keep those lines in cache (2.5x faster for the 75 MB of the
    first decoder block's transposed conv). float16 in either order is widened by ggml first."""
    if w.dtype == np.float16 and (w.flags.c_contiguous or w.flags.f_contiguous):
        w = widen(w)
    if not w.flags.f_contiguous or w.flags.c_contiguous:
        return np.ascontiguousarray(w, dtype=F32)
    out = np.empty(w.shape, F32)
    for i in range(0, w.shape[1], columns):
        out[:, i : i + columns] = w[:, i : i + columns]
    return out
