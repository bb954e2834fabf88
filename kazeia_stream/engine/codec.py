"""The codec decoder ("code2wav"): 16 codes per 80 ms frame -> 1920 samples of 24 kHz audio.

Exact and streaming. Every stage of Qwen3-TTS-Tokenizer-12Hz's decoder is causal, so a sequence
decoded in chunks of any sizes gives the samples of the one-shot decode, bit for bit,
provided each layer's state is carried between calls and every product gives a column the same
numbers whatever columns come with it (see `Matrix`). The layers hold weights only; an
utterance's state is a `DecoderState` (`CodecDecoder.new_state()`), made of each layer's
own state object, as in Kyutai's moshi streaming modules:

- a causal convolution keeps its last (k - 1) * dilation input columns;
- a transposed convolution (kernel 2 * stride) keeps the (k - stride) output columns that the
  next input frame overlaps;
- each transformer layer keeps a ring of K/V slots covering the last (window - 1) positions,
  and the transformer keeps the absolute RoPE position (positions count from the start of the
  utterance, as in the official one-shot decode).

One path, `CodecDecoder.push_many(states, codes)`, serves streaming and one-shot decoding, of
one utterance (`push`) or of several at once (streams: each state advanced as alone, bit for
bit). The official semantics kept here: negative codes clamp to 0, the transposed
convolutions trim (k - s) samples on the right only, the sliding window lets a query at t see
keys t - window + 1 .. t, the output is clamped to [-1, 1].

Layout and speed: activations are channel-major, [channels, time] float32, and every layer is a
few products W @ X (`Matrix`): on our float32 kernel (`f32_product`) called directly on the
layers' own buffers where it runs; else, for the layers of few columns per frame (the early
stages: reading the weights is their cost) and those that several streams share, in ggml
graphs, which read the weights in place, where OpenBLAS first packs them, and for the others on
numpy's BLAS, one frame's columns at a time (weights on the left is the fast orientation). A
convolution tap is a shifted column view of the layer's context buffer, which the producer
writes into directly. Several streams' activations are [channels, time * streams], stream index
fastest, so that a tap stays one column view and each multiplication reads its weights once for
all the streams: the layers whose weights are large and columns few (up to the second decoder
block, `JOINT_BLOCKS`) run so, on the streams' states stacked for the call; the later blocks
run per stream. Each push sets its own BLAS thread count (threadpoolctl; one by default,
whatever numpy's setting): the GEMMs are many and small, and OpenBLAS' threads spin after each
one, taking the core that ggml's threads need (a second BLAS thread made the talker's next step
~2x slower, and synthesis of the tiny test models 30-80x). The products in ggml graphs run on
one thread (`DECODER_GGML_THREADS`). `python -m kazeia_stream.engine.codec MMPROJ` measures ms
per frame.

Weights come from the mmproj GGUF (`a.gen.wav.*`, see gguf_layout); every width is read from
the tensor shapes, so the tiny test models run through the same code as the real ones.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf import GGMLQuantizationType as QType
from threadpoolctl import ThreadpoolController

from ..ggml_lib import widen
from ..model import gguf_layout as L
from ..model.gguf_file import GGUFFile
from . import cache_files, f32_product, heap, snake, winograd
from .ggml_graph import Allocator, ArrayTensor, Graph, prefault, strides, view_of
from .threads import DECODER_GGML_THREADS, DECODER_THREADS, available_cores
from .weight_cache import UNSAVED, Stale, WeightCache

# Official decoder_config values, for published files that lack our kazeia.codec.* keys.
OFFICIAL_HEAD_DIM = 64
OFFICIAL_RMS_EPS = 1e-5
OFFICIAL_ROPE_THETA = 10000.0
OFFICIAL_SLIDING_WINDOW = 72
LAYER_NORM_EPS = 1e-6  # the ConvNeXt blocks' LayerNorm (hard-coded upstream)
DILATIONS = (1, 3, 9)  # residual units of each decoder block (hard-coded upstream)

# `push` decodes at most this many frames per pass: the intermediate buffers stay small (a frame
# is 1920 x 96 floats in the last block) and the result does not depend on it.
MAX_FRAMES_PER_PASS = 16
# `push_many` runs this many decoder blocks (and the layers before them) on all the streams'
# columns at once; the later ones per stream (their many columns make the multiplications the
# cost, not the weight reads: batching them measured slower). The second block's products of
# 40-45 columns a frame share their weights once they run on our kernel (`f32_product`): four
# streams, Zen 4, 45.0-45.7 against 47.1-48.6 ms a stream-frame with the first block alone.
JOINT_BLOCKS = 2
# OpenBLAS' SkylakeX-family cores multiply a small product (M * N * K <= 100^3) with a kernel
# that packs nothing. With a few columns, packing the weights is most of an sgemm's cost: W @ X
# in row blocks of that size measured 1.3-2x faster than one sgemm from 2 to 32 columns (as
# fast at 64, slower from 128).
SMALL_GEMM_MNK = 100**3
SMALL_GEMM_MAX_COLUMNS = 32
SMALL_GEMM_CORES = ("skylakex", "cooperlake", "sapphirerapids")
# Where our kernel does not run, a product of at most this many columns runs in a ggml graph
# (`Matrix`), a wider one on numpy's BLAS. OpenBLAS packs
# the weights before multiplying, at every call; with few columns (the layers up to the first
# decoder block: 0.33 of the 0.42 GB of weights a frame reads) that copy was most of a product's
# cost, while ggml's kernels read the weights in place. One core, OpenBLAS' Haswell kernels, per
# shape: 12288x1536 by 4 columns 12.5 -> 4.7 ms, the first block's 24 taps 768x768 by 32 columns
# 13.5 -> 10.9 ms, 384x384 by 160 even, 192x192 by 640 11.2 -> 13.9 ms.
GGML_COLUMNS = 64
# Where our kernel runs (`Matrix.multiply_directly`), a product of fewer columns per frame than
# this takes its weight in panels (a copy; the weights then stream from memory at 32-43 GB/s
# on Zen 4, against 17-35 in place four rows at a time), one of more in place (the columns'
# rows are contiguous in the decoder's buffers), unless its inputs come column-major. The
# decoder alone on Zen 4 (docs/measurements.md, 2026-12-04, late night): one stream 44.3-44.4 ms
# a frame against 60.2-60.9 on ggml's graphs and numpy's BLAS, four streams 34.6 against
# 43.1-43.5 ms a stream-frame.
PANEL_COLUMNS = 8
# A causal conv of more columns per frame multiplies tap by tap, on copies of its weight
# (`CausalConv.split`); one of fewer, its weight in place on gathered columns. Per frame from
# memory, one core: the entry conv (44 MB, 4 columns) 4.4 ms in place against 4.9 tap by tap;
# the first block's k = 7 convs (17 MB, 32 columns) 4.9 against 4.1; in the later blocks
# (hundreds of columns, small weights) the gathering costs up to 0.3 ms a conv.
SPLIT_COLUMNS = 16
# The heap a decoded frame's buffers take at most (`heap.reserve`): 18 MB for the official
# decoder's first frame (its page faults, getrusage).
FRAME_HEAP = 30 << 20
# Floats of padding after each column of a `by_column` product's input (a cache line).
_ROW_PAD = 16

F32 = np.float32

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Stateless pieces
# ---------------------------------------------------------------------------------------------


def _erf(x: np.ndarray) -> np.ndarray:
    """erf in float32 to a few ulp: Eigen's rational approximation on [-4, 4] (outside,
    erf is +-1 in float32). numpy has no erf and scipy is not a dependency."""
    x = np.clip(x, -4.0, 4.0)
    x2 = x * x
    p = x2 * F32(-2.72614225801306e-10) + F32(2.77068142495902e-08)
    for c in (
        -2.10102402082508e-06,
        -5.69250639462346e-05,
        -7.34990630326855e-04,
        -2.95459980854025e-03,
        -1.60960333262415e-02,
    ):
        p *= x2
        p += F32(c)
    p *= x
    q = x2 * F32(-1.45660718464996e-05) + F32(-2.13374055278905e-04)
    for c in (-1.68282697438203e-03, -7.37332916720468e-03, -1.42647390514189e-02):
        q *= x2
        q += F32(c)
    p /= q
    return p


def _gelu(x: np.ndarray) -> np.ndarray:
    """Exact (erf) GELU, in place."""
    e = _erf(x * F32(0.7071067811865476))
    e += F32(1.0)
    x *= F32(0.5)
    x *= e
    return x


@cache
def _small_gemm() -> bool:
    """Whether numpy's BLAS is an OpenBLAS with the small-matrix kernel (SMALL_GEMM_CORES)."""
    infos = ThreadpoolController().select(internal_api="openblas").info()
    return any(str(info.get("architecture", "")).lower() in SMALL_GEMM_CORES for info in infos)


def _matmul(w: np.ndarray, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
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
        self.array = w if w.dtype == np.float16 else _float32(w)
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
            return _matmul(self.array, x, out)
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
            self.array = cache.final(w.shape, np.dtype(F32), lambda: _float32(w))

    def widen(self) -> None:
        """W as float32 from now on, where the file stores it in float16."""
        self.array = _float32(self.array)

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


def _sum_squares(x: np.ndarray) -> np.ndarray:
    """The sum of squares over the channels of [C, n], per column, added in one order whatever
    n: numpy sums a lone contiguous column its own way (pairwise), so one column is summed as
    two copies."""
    n = x.shape[1]
    if n == 1:
        x = np.repeat(x, 2, axis=1)
    return np.einsum("ij,ij->j", x, x)[:n]


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the channels of [C, n]; weight [C, 1]."""
    var = _sum_squares(x) / F32(x.shape[0])
    return x * (F32(1.0) / np.sqrt(var + F32(eps))) * weight


class SnakeBeta:
    """y = x + beta * sin(alpha * x)^2 per channel; alpha and beta come folded from the GGUF.
    On our kernel where it runs (`snake`), else on numpy; x of strided columns (one stream's
    of several) is copied first, so that a stream's numbers are the same alone or not."""

    def __init__(self, alpha: np.ndarray, beta: np.ndarray) -> None:
        self.alpha, self.beta = alpha.astype(F32)[:, None], beta.astype(F32)[:, None]

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if snake.variants():
            x = x if x.strides[1] == 4 else np.ascontiguousarray(x)
            return snake.snake(x, self.alpha, self.beta, np.empty_like(x) if out is None else out)
        t = np.multiply(x, self.alpha)
        np.sin(t, out=t)
        np.multiply(t, t, out=t)
        np.multiply(t, self.beta, out=t)
        return np.add(x, t, out=out)


class Linear:
    """y = W x + b on [C_in, n]; W [C_out, C_in]."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None = None) -> None:
        self.w = Matrix(weight)
        self.b = None if bias is None else bias.astype(F32)[:, None]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = self.w(x)
        if self.b is not None:
            y += self.b
        return y


# ---------------------------------------------------------------------------------------------
# Stateful convolutions
# ---------------------------------------------------------------------------------------------


class ContextBuffer:
    """A causal convolution's state and input for S streams (one utterance's: S = 1),
    [C, (context + n) * S], stream index fastest: `context` time steps of left context (the
    previous inputs; zeros at the start of an utterance), then the n new ones. The producer
    writes them into `input(n * S)`; after the layer ran, `advance(n * S)` keeps the last
    `context` time steps. A tap shifted by j time steps is the column view shifted by j * S."""

    def __init__(self, context: int, channels: int, streams: int = 1) -> None:
        self.context, self.channels, self.streams = context, channels, streams
        self.width = context * streams  # columns of context
        self.buf = np.zeros((channels, self.width), F32)

    def input(self, cols: int) -> np.ndarray:
        if self.buf.shape[1] != self.width + cols:
            buf = np.empty((self.channels, self.width + cols), F32)
            buf[:, : self.width] = self.buf[:, : self.width]
            self.buf = buf
        return self.buf[:, self.width :]

    def advance(self, cols: int) -> None:
        if self.width:
            self.buf[:, : self.width] = self.buf[:, cols:]  # numpy copes with the overlap

    @classmethod
    def stack(cls, parts: Sequence[ContextBuffer]) -> ContextBuffer:
        """One buffer for the streams of `parts` (one each): a copy of their contexts."""
        first = parts[0]
        stacked = cls(first.context, first.channels, len(parts))
        view = stacked.buf.reshape(first.channels, first.context, len(parts))
        np.stack([p.buf[:, : p.width] for p in parts], axis=2, out=view)
        return stacked

    def unstack(self, parts: Sequence[ContextBuffer]) -> None:
        """Copy each stream's context back to its own buffer in `parts`."""
        view = self.buf[:, : self.width].reshape(self.channels, self.context, self.streams)
        for s, part in enumerate(parts):
            part.buf[:, : part.width] = view[:, :, s]


class CausalConv:
    """Causal Conv1d, stride 1, left-padded by (k - 1) * dilation; weight [C_out, C_in, k].

    y = b + W [C_out, C_in * k] X, one product with the weight as the file holds it (in place),
    over X [C_in * k, n * S] gathered from the context buffer of S streams: row c * k + j is
    channel c shifted by j * d time steps (im2col). Once `split`, y = b + sum_j W_j X_j instead:
    one product per tap, on a copy of its weight, reading the shifted buffer in place (for many
    columns, where gathering X costs more: `SPLIT_COLUMNS`). Once `tile`d, in Winograd's F(4,
    7) (`winograd`): 10 products of a quarter of the columns each, between two transforms of
    ours."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray, dilation: int = 1) -> None:
        c_out, c_in, k = weight.shape
        self.k, self.dilation = k, dilation
        self.products = [Matrix(weight.reshape(c_out, c_in * k))]  # W, the W_j, or the U_k
        self.bias = bias.astype(F32)[:, None]
        self.context, self.c_in = (k - 1) * dilation, c_in
        self.method = "gathered"  # "taps" once `split`, "winograd" once `tile`d

    def split(self) -> None:
        """Multiply tap by tap from now on (the weight in place is let go)."""
        if self.k > 1 and self.method == "gathered":
            weight = self.products[0].array.reshape(-1, self.c_in, self.k)
            self.products = [Matrix(weight[:, :, j]) for j in range(self.k)]
            self.method = "taps"

    def tile(self, cache: WeightCache = UNSAVED) -> None:
        """Multiply in Winograd's F(4, 7) from now on, where it runs (7 taps, our kernel built):
        5/14 of the multiply-adds, within float rounding of the direct products. The transformed
        weights only matter packed (`cache`: where it holds those, they are not computed)."""
        if self.k != winograd.TAPS or not winograd.available() or self.method != "gathered":
            return
        weight = self.products[0].array
        shape = (winograd.SIZE, weight.shape[0], self.c_in)
        make = lambda: winograd.kernel_weights(_float32(weight).reshape(-1, self.c_in, self.k))
        u = cache.interim(shape, np.dtype(F32), make)
        self.products = [Matrix(u_k, column_major=True) for u_k in u]
        self.method = "winograd"
        winograd.float32_matrices()  # the transforms' matrices made now, not in the first frame

    def calls(self, n: int) -> Iterator[tuple[Matrix, int]]:
        """The products of a call on n columns, in order: (weight, columns it multiplies)."""
        if self.method != "winograd":
            yield from ((m, n) for m in self.products)
            return
        for chunk in winograd.chunks(n, self.dilation):
            yield from ((m, chunk.tiles) for m in self.products)

    def new_state(self) -> ContextBuffer:
        return ContextBuffer(self.context, self.c_in)

    def run(self, state: ContextBuffer, n: int) -> np.ndarray:
        """The output for the n columns written into `state.input(n)`."""
        buf, d, products = state.buf, self.dilation * state.streams, self.products
        if self.method == "winograd":
            y = np.empty((len(self.bias), n), F32)
            for chunk in winograd.chunks(n, d):
                v = winograd.transform_in(buf, chunk, d)
                m = winograd.planes(chunk.tiles, len(self.bias))
                for product, v_k, m_k in zip(products, v, m):
                    product(v_k.T, out=m_k.T)  # tile-major, as the transforms take them
                winograd.transform_out(m, chunk, d, self.bias, y)
            state.advance(n)
            return y
        if self.k == 1:
            y = products[0](buf[:, :n])
        elif self.method == "taps":
            y = products[0](buf[:, 0:n])
            t = np.empty_like(y)
            for j in range(1, self.k):
                products[j](buf[:, j * d : j * d + n], out=t)
                y += t
        else:  # gathered column by column: ggml's kernels take X's columns as rows
            x = np.empty((n, self.c_in, self.k), F32)
            for j in range(self.k):
                x[:, :, j] = buf[:, j * d : j * d + n].T
            y = products[0](x.reshape(n, self.c_in * self.k).T)
        y += self.bias
        state.advance(n)
        return y

    def __call__(self, state: ContextBuffer, x: np.ndarray) -> np.ndarray:
        state.input(x.shape[1])[...] = x
        return self.run(state, x.shape[1])


class DepthwiseCausalConv:
    """Causal depthwise Conv1d (groups = channels); weight [C, 1, k]."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray) -> None:
        c, _, k = weight.shape
        self.k = k
        self.taps = np.ascontiguousarray(weight[:, 0, :].T, dtype=F32)[:, :, None]  # [k, C, 1]
        self.bias = bias.astype(F32)[:, None]
        self.channels = c

    def new_state(self) -> ContextBuffer:
        return ContextBuffer(self.k - 1, self.channels)

    def __call__(self, state: ContextBuffer, x: np.ndarray) -> np.ndarray:
        n, s = x.shape[1], state.streams
        state.input(n)[...] = x
        buf = state.buf
        y = buf[:, 0:n] * self.taps[0]
        for j in range(1, self.k):
            y += buf[:, j * s : j * s + n] * self.taps[j]
        y += self.bias
        state.advance(n)
        return y


class CausalTransConv:
    """ConvTranspose1d(k, stride s) with the (k - s) last samples trimmed on the right, as the
    official CausalTransConvNet: n input time steps give n * s output time steps. Weight
    [C_in, C_out, k].

    One sgemm [C_out * k, C_in] x [C_in, n * S] (S streams; the left one the stored weight's
    2-D transpose, copied once) gives Z[:, m, t], the contribution of input t to output t * s + m; then
    an overlap-add: output t * s + m = Z[m, t] (m < s) + Z[s + m, t - 1] (m < k - s).
    Z[:, s:, last t], the tail [k - s, C_out, S], is the state carried into the next call."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray, stride: int) -> None:
        c_in, c_out, k = weight.shape
        if not stride <= k <= 2 * stride:
            raise ValueError(f"transposed conv kernel {k} with stride {stride} is not supported")
        self.k, self.s, self.c_out = k, stride, c_out
        # a copy: the transposed view as the left operand measured ~15% slower per frame
        self.w = Matrix(weight.reshape(c_in, c_out * k).T)
        self.bias = bias.astype(F32)[:, None, None]

    def new_state(self) -> np.ndarray:
        return np.zeros((self.k - self.s, self.c_out, 1), F32)

    def __call__(self, tail: np.ndarray, x: np.ndarray) -> np.ndarray:
        k, s, streams = self.k, self.s, tail.shape[2]
        n = x.shape[1] // streams
        z = self.w(x).reshape(self.c_out, k, n, streams)
        y = np.empty((self.c_out, n, s, streams), F32)
        for m in range(s):  # one phase at a time: numpy would loop over the short m axis innermost
            ym = y[:, :, m]  # output time steps t * s + m
            np.add(z[:, m], self.bias, out=ym)
            if m < k - s:
                ym[:, 1:] += z[:, s + m, :-1]
                ym[:, 0] += tail[m]
        tail[...] = z[:, s:, -1].transpose(1, 0, 2)
        return y.reshape(self.c_out, n * s * streams)


# ---------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------


class ConvNeXtBlock:
    """x + gamma * pw2(gelu(pw1(LayerNorm(dwconv(x)))))."""

    def __init__(self, f: GGUFFile, bid: int) -> None:
        self.dwconv = DepthwiseCausalConv(*_conv(f, L.WAV_UP_DWCONV.format(bid=bid)))
        norm_w, norm_b = _pair(f, L.WAV_UP_NORM.format(bid=bid))
        self.norm_w, self.norm_b = norm_w[:, None], norm_b[:, None]
        self.pw1 = Linear(*_kernel(f, L.WAV_UP_PW1.format(bid=bid)))
        self.pw2 = Linear(*_kernel(f, L.WAV_UP_PW2.format(bid=bid)))
        self.gamma = f.read(L.WAV_UP_GAMMA.format(bid=bid))[:, None]

    def new_state(self) -> ContextBuffer:
        return self.dwconv.new_state()

    def __call__(self, state: ContextBuffer, x: np.ndarray) -> np.ndarray:
        h = self.dwconv(state, x)
        h -= h.mean(axis=0)
        var = _sum_squares(h) / F32(h.shape[0])
        h *= F32(1.0) / np.sqrt(var + F32(LAYER_NORM_EPS))
        h *= self.norm_w
        h += self.norm_b
        h = self.pw2(_gelu(self.pw1(h)))
        h *= self.gamma
        h += x
        return h


class ResidualUnit:
    """x + conv2(snake2(conv1(snake1(x)))), conv1 k=7 with a dilation, conv2 k=1."""

    def __init__(self, f: GGUFFile, bid: int, xid: int, dilation: int) -> None:
        ids = {"bid": bid, "xid": xid}
        self.act1 = SnakeBeta(*_snake(f, L.WAV_DAC_RES_ACT1.format(**ids)))
        self.conv1 = CausalConv(*_conv(f, L.WAV_DAC_RES_CONV1.format(**ids)), dilation=dilation)
        self.act2 = SnakeBeta(*_snake(f, L.WAV_DAC_RES_ACT2.format(**ids)))
        self.conv2 = CausalConv(*_conv(f, L.WAV_DAC_RES_CONV2.format(**ids)))

    def new_state(self) -> tuple[ContextBuffer, ContextBuffer]:
        return self.conv1.new_state(), self.conv2.new_state()

    def __call__(self, state: tuple[ContextBuffer, ContextBuffer], x: np.ndarray) -> np.ndarray:
        n = x.shape[1]
        s1, s2 = state
        self.act1(x, out=s1.input(n))
        h = self.conv1.run(s1, n)
        self.act2(h, out=s2.input(n))
        y = self.conv2.run(s2, n)
        y += x
        return y


class DecoderBlock:
    """SnakeBeta, CausalTransConv(k = 2 * rate, stride rate), three residual units."""

    def __init__(self, f: GGUFFile, bid: int) -> None:
        self.act = SnakeBeta(*_snake(f, L.WAV_DAC_UP_SNAKE.format(bid=bid)))
        w, b = _kernel(f, L.WAV_DAC_UP_CONV.format(bid=bid))
        w = w.reshape(-1, len(b), w.shape[-1])
        self.up = CausalTransConv(w, b, stride=w.shape[-1] // 2)
        self.units = [ResidualUnit(f, bid, xid, d) for xid, d in enumerate(DILATIONS)]

    @property
    def convs(self) -> list[CausalConv]:
        """Its residual units' convolutions, in order."""
        return [conv for unit in self.units for conv in (unit.conv1, unit.conv2)]

    def new_state(self) -> tuple[np.ndarray, list[tuple[ContextBuffer, ContextBuffer]]]:
        return self.up.new_state(), [unit.new_state() for unit in self.units]

    def __call__(
        self, state: tuple[np.ndarray, list[tuple[ContextBuffer, ContextBuffer]]], x: np.ndarray
    ) -> np.ndarray:
        tail, units = state
        h = self.up(tail, self.act(x))
        for unit, unit_state in zip(self.units, units):
            h = unit(unit_state, h)
        return h


class TransformerLayer:
    """Pre-norm attention + SiLU-gated MLP, each scaled per channel (LayerScale). Attention has
    no bias and no q/k norm, NeoX RoPE, and a causal sliding window. Activations [C, n * S] of
    S streams, stream index fastest: the projections run on all the columns at once, the
    attention per stream.

    State: a ring of K/V slots (after RoPE) per stream, `KVRing`; the Transformer tracks which
    position each slot holds and hands every layer each stream's additive mask (0 or -inf) of
    the window."""

    def __init__(self, f: GGUFFile, bid: int, head_dim: int, eps: float) -> None:
        t = lambda name: f.read(name.format(bid=bid))
        m = lambda name: f.weight(name.format(bid=bid))  # weights in place: see `_kernel`
        joined = lambda *names: f.joined([name.format(bid=bid) for name in names])
        self.head_dim, self.eps = head_dim, eps
        self.n_heads = f.tensor_shape(L.WAV_TFM_ATTN_Q.format(bid=bid))[0] // head_dim
        self.n_kv = f.tensor_shape(L.WAV_TFM_ATTN_K.format(bid=bid))[0] // head_dim
        self.qkv = Linear(joined(L.WAV_TFM_ATTN_Q, L.WAV_TFM_ATTN_K, L.WAV_TFM_ATTN_V))
        self.out = Linear(m(L.WAV_TFM_ATTN_OUT))
        self.gate_up = Linear(joined(L.WAV_TFM_FFN_GATE, L.WAV_TFM_FFN_UP))
        self.down = Linear(m(L.WAV_TFM_FFN_DOWN))
        self.ln1, self.ln2 = t(L.WAV_TFM_ATTN_NORM)[:, None], t(L.WAV_TFM_FFN_NORM)[:, None]
        self.ls1, self.ls2 = t(L.WAV_TFM_ATTN_SCALE)[:, None], t(L.WAV_TFM_FFN_SCALE)[:, None]

    def new_state(self, slots: int) -> KVRing:
        return KVRing(
            np.zeros((self.n_kv, self.head_dim, slots), F32), np.zeros((self.n_kv, self.head_dim, slots), F32)
        )

    def __call__(
        self,
        kvs: Sequence[KVRing],
        x: np.ndarray,
        cos: np.ndarray,
        sin: np.ndarray,
        slots: np.ndarray,
        masks: Sequence[np.ndarray],
    ) -> np.ndarray:
        """x [C, n * S]; cos, sin [head_dim, n * S]; `slots` [n, S] where the new K/V go; each
        stream's ring and mask [n, slots]."""
        hd, nh, nkv, streams = self.head_dim, self.n_heads, self.n_kv, len(kvs)
        n, rep = x.shape[1] // streams, nh // nkv
        qkv = self.qkv(_rms_norm(x, self.ln1, self.eps))
        qk = _rope(qkv[: (nh + nkv) * hd].reshape(nh + nkv, hd, n * streams), cos, sin)
        qk = qk.reshape(nh + nkv, hd, n, streams)
        v = qkv[(nh + nkv) * hd :].reshape(nkv, hd, n, streams)
        attn = np.empty((nh * hd, n * streams), F32)
        attn_heads = attn.reshape(nkv, rep, hd, n, streams)
        for s, (kv, mask) in enumerate(zip(kvs, masks)):
            kv.keys[:, :, slots[:, s]] = qk[nh:, :, :, s]
            kv.values[:, :, slots[:, s]] = v[..., s]
            # one frame's queries at a time, contiguous: the products' shapes and layouts,
            # hence their rounding, are those of a push of one frame. Grouped-query attention:
            # the `rep` query heads of a kv head share its keys.
            for t in range(n):
                q = np.ascontiguousarray(qk[:nh, :, t, s]).reshape(nkv, rep, hd)
                scores = q @ kv.keys  # [kv heads, rep, slot]
                scores *= F32(hd**-0.5)
                scores += mask[t]
                scores -= scores.max(axis=-1, keepdims=True)
                np.exp(scores, out=scores)
                scores /= scores.sum(axis=-1, keepdims=True)
                # [nkv, hd, slot] x [nkv, slot, rep] -> [nkv, hd, rep]
                a = kv.values @ scores.transpose(0, 2, 1)
                attn_heads[:, :, :, t, s] = a.transpose(0, 2, 1)
        x = x + self.ls1 * self.out(attn)
        gu = self.gate_up(_rms_norm(x, self.ln2, self.eps))
        g, u = gu[: len(gu) // 2], gu[len(gu) // 2 :]
        h = g / (F32(1.0) + np.exp(-g))  # SiLU
        h *= u
        x += self.ls2 * self.down(h)
        return x


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """NeoX ("rotate_half") RoPE on [heads, head_dim, n] with cos, sin [head_dim, n]."""
    half = x.shape[1] // 2
    y = x * cos
    y[:, :half] -= x[:, half:] * sin[:half]
    y[:, half:] += x[:, :half] * sin[half:]
    return y


@dataclass
class KVRing:
    """A transformer layer's state: K (after RoPE) and V of the ring's slots,
    [kv heads, head_dim, slot]. Zeros until written (masked anyway; zeros keep products finite)."""

    keys: np.ndarray
    values: np.ndarray


@dataclass
class TransformerState:
    """The absolute RoPE position, the position each K/V ring slot holds (the same in every
    layer; far in the past when empty, outside every window), and each layer's ring."""

    pos: int
    slot_pos: np.ndarray
    layers: list[KVRing]


class Transformer:
    """in_proj, the layers, final RMSNorm, out_proj, on S streams' columns (stream index
    fastest), each with its own state. A pass of n <= `max_step` frames writes slots p % slots,
    which (slots >= window - 1 + n) never overwrites a key that a query of the pass still sees."""

    def __init__(self, f: GGUFFile, max_step: int = MAX_FRAMES_PER_PASS) -> None:
        key = lambda name, default: f.get(L.KEY_CODEC_PREFIX + name, default)
        head_dim = int(key("head_dim", OFFICIAL_HEAD_DIM))
        self.eps = float(key("rms_norm_eps", OFFICIAL_RMS_EPS))
        theta = float(key("rope_theta", OFFICIAL_ROPE_THETA))
        self.window = int(key("sliding_window", OFFICIAL_SLIDING_WINDOW))
        self.max_step = max_step
        self.n_slots = self.window - 1 + max_step
        self.in_proj = Linear(*_pair(f, L.WAV_TFM_IN_PROJ))
        self.out_proj = Linear(*_pair(f, L.WAV_TFM_OUT_PROJ))
        self.norm = f.read(L.WAV_TFM_OUTPUT_NORM)[:, None]
        self.layers = [
            TransformerLayer(f, bid, head_dim, self.eps) for bid in range(_count(f, L.WAV_TFM_ATTN_Q))
        ]
        # as torch: inv_freq = 1 / theta ** (arange(0, d, 2) / d) in float32
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(F32) / F32(head_dim)
        self.inv_freq = (F32(1.0) / (F32(theta) ** exponents)).astype(F32)

    def new_state(self) -> TransformerState:
        return TransformerState(
            0,
            np.full(self.n_slots, -(1 << 40), np.int64),
            [layer.new_state(self.n_slots) for layer in self.layers],
        )

    def __call__(self, states: Sequence[TransformerState], x: np.ndarray) -> np.ndarray:
        """x [C, n * S] of the S streams of `states`."""
        step = self.max_step * len(states)
        if x.shape[1] > step:
            return np.concatenate(
                [self(states, x[:, i : i + step]) for i in range(0, x.shape[1], step)], axis=1
            )
        n = x.shape[1] // len(states)
        pos = np.arange(n)[:, None] + np.array([state.pos for state in states])[None, :]  # [n, S]
        freqs = self.inv_freq[:, None] * pos.reshape(-1).astype(F32)[None, :]
        emb = np.concatenate([freqs, freqs], axis=0)  # [head_dim, n * S]
        cos, sin = np.cos(emb), np.sin(emb)
        slots = pos % self.n_slots
        masks = []
        for state, p, slot in zip(states, pos.T, slots.T):
            state.pos += n
            state.slot_pos[slot] = p
            lag = p[:, None] - state.slot_pos[None, :]  # query position - key position
            masks.append(np.where((lag >= 0) & (lag < self.window), F32(0), F32(-np.inf)).astype(F32))
        h = self.in_proj(x)
        for i, layer in enumerate(self.layers):
            h = layer([state.layers[i] for state in states], h, cos, sin, slots, masks)
        return self.out_proj(_rms_norm(h, self.norm, self.eps))


class Quantizer:
    """Split RVQ decode: codebook 0 and codebooks 1.. are each summed, projected (1x1 conv, no
    bias) and added. The GGUF codebooks are already divided by their cluster usage."""

    def __init__(self, f: GGUFFile) -> None:
        # gathered a few rows per frame, not streamed: mapped, only the rows used are resident
        self.first_cb = f.tensor(L.WAV_QUANT_FIRST_CB)  # [size, dim]
        size, dim = self.first_cb.shape
        self.rest_cb = f.tensor(L.WAV_QUANT_REST_CB).reshape(-1, size, dim)  # [groups - 1, size, dim]
        self.first_out = Linear(f.read(L.WAV_QUANT_FIRST_OUT).reshape(-1, dim))
        self.rest_out = Linear(f.read(L.WAV_QUANT_REST_OUT).reshape(-1, dim))
        self.num_groups = 1 + len(self.rest_cb)
        self.codebook_size = size

    def __call__(self, codes: np.ndarray) -> np.ndarray:
        """codes [n, groups] -> [C, n]."""
        codes = np.clip(codes, 0, None)  # the official decode clamps negative (padding) codes to 0
        rest = self.rest_cb[0, codes[:, 1]].copy()
        for i in range(2, self.num_groups):
            rest += self.rest_cb[i - 1, codes[:, i]]
        y = self.first_out(self.first_cb[codes[:, 0]].T)
        y += self.rest_out(rest.T)
        return y


# ---------------------------------------------------------------------------------------------
# The decoder
# ---------------------------------------------------------------------------------------------

UpsampleState = tuple[np.ndarray, ContextBuffer]  # a transposed conv's tail, a ConvNeXt's context
BlockState = tuple[np.ndarray, list[tuple[ContextBuffer, ContextBuffer]]]
JointState = tuple[ContextBuffer, list[UpsampleState], ContextBuffer, list[BlockState]]


@dataclass
class DecoderState:
    """One utterance's decoder state: every layer's, in the order of the layers (a
    transposed conv's tail is [k - s, C_out, 1]: one stream's)."""

    pre_conv: ContextBuffer
    transformer: TransformerState
    upsample: list[UpsampleState]
    entry: ContextBuffer
    blocks: list[BlockState]
    post_conv: ContextBuffer

    @property
    def position(self) -> int:
        """Frames decoded so far."""
        return self.transformer.pos

    def joint(self) -> JointState:
        """The states of the convolutions that a pass runs on all the streams' columns at once."""
        return self.pre_conv, self.upsample, self.entry, self.blocks[:JOINT_BLOCKS]


def _stack(parts: Sequence[Any]) -> Any:
    """The states of a layer (context buffers, tails, or tuples or lists of them), one per
    stream, as the layer's state for all the streams, stream index fastest: a copy of their
    contexts. One stream's is its own."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, ContextBuffer):
        return ContextBuffer.stack(parts)
    if isinstance(first, np.ndarray):
        return np.concatenate(parts, axis=2)
    return type(first)(_stack(p) for p in zip(*parts))


def _unstack(stacked: Any, parts: Sequence[Any]) -> None:
    """The inverse of `_stack`: copy each stream's state back into its own in `parts`."""
    if len(parts) == 1:
        return
    if isinstance(stacked, ContextBuffer):
        stacked.unstack(parts)
    elif isinstance(stacked, np.ndarray):
        for s, part in enumerate(parts):
            part[...] = stacked[:, :, s : s + 1]
    else:
        for i, sub in enumerate(stacked):
            _unstack(sub, [p[i] for p in parts])


@dataclass
class _Streams:
    """The states of S streams for a pass over all of them: the joint ones stacked (see
    `_stack`), and each stream's own `DecoderState` for the rest."""

    states: Sequence[DecoderState]
    pre_conv: ContextBuffer
    upsample: list[UpsampleState]
    entry: ContextBuffer
    blocks: list[BlockState]

    @classmethod
    def stack(cls, states: Sequence[DecoderState]) -> _Streams:
        """The streams' states for a pass: copies of their joint states, until `unstack`."""
        return cls(states, *_stack([state.joint() for state in states]))

    def unstack(self) -> None:
        """Copy each stream's joint states back into its `DecoderState`."""
        _unstack((self.pre_conv, self.upsample, self.entry, self.blocks), [s.joint() for s in self.states])


class CodecDecoder:
    """codes [n, 16] -> float32 audio [n * samples_per_frame], streaming with explicit state.

    The decoder holds weights only. `new_state()` starts an utterance, `push(state, codes)`
    continues it, `push_many(states, codes)` continues several at once, `decode(codes)` is a
    one-shot decode of a fresh one. Chunks of any sizes give the samples of the one-shot
    decode."""

    def __init__(self, mmproj: GGUFFile, threads: int) -> None:
        self.threads = threads
        self._blas = ThreadpoolController().select(user_api="blas")
        self._kernel = f32_product.chosen()  # our kernel's variant, or None: ggml's and BLAS's
        with self._threads(None):  # the load's products too: a second thread spins after them
            layout = f"winograd={winograd.available()}"
            cache = WeightCache.of(mmproj.path, _code(), layout) if self._kernel else UNSAVED
            try:
                self._load(mmproj, cache)
                cache.finish()
            except Stale as e:  # the saved arrays are others: made anew, and saved
                log.debug("%s: %s", cache.path, e)
                cache.forget()
                self._load(mmproj, cache)
                cache.finish()

    def _load(self, f: GGUFFile, cache: WeightCache) -> None:
        self.quantizer = Quantizer(f)
        self.pre_conv = CausalConv(*_conv(f, L.WAV_PRE_CONV))
        self.transformer = Transformer(f)
        self.upsample: list[tuple[CausalTransConv, ConvNeXtBlock]] = []
        for bid in range(_count(f, L.WAV_UP_CONV)):
            w, b = _kernel(f, L.WAV_UP_CONV.format(bid=bid))
            w = w.reshape(-1, len(b), w.shape[-1])
            self.upsample.append((CausalTransConv(w, b, stride=w.shape[-1]), ConvNeXtBlock(f, bid)))
        self.entry = CausalConv(*_conv(f, L.WAV_DAC_ENTRY))
        self.blocks = [DecoderBlock(f, bid) for bid in range(_count(f, L.WAV_DAC_UP_CONV))]
        self.post_act = SnakeBeta(*_snake(f, L.WAV_DAC_POST_SNAKE))
        self.post_conv = CausalConv(*_conv(f, L.WAV_DAC_POST_CONV))
        self._allocator = Allocator()  # one compute buffer for the products on ggml's kernels
        columns_of = self.matrices()
        dilated = [unit.conv1 for block in self.blocks for unit in block.units]
        for conv in self._convs():
            if conv in dilated:  # most of the multiply-adds: in Winograd's F(4, 7) where it runs
                conv.tile(cache)
            if conv.method == "gathered" and columns_of[id(conv.products[0])][1] > SPLIT_COLUMNS:
                conv.split()
        kernel = self._kernel
        per_stream = self._per_stream_matrices()
        for key, (matrix, columns) in self.matrices().items():
            if kernel is not None:
                matrix.multiply_directly(kernel, matrix.column_major or columns < PANEL_COLUMNS, cache)
            else:
                matrix.widen()
                if columns <= GGML_COLUMNS or key not in per_stream:
                    matrix.allocator, matrix.by_column = self._allocator, columns == 1
            # mapped now (from the cache file, or in place in the model's): the first frame is
            # heard first (its products took 2x as long, faulting 0.29 GB in, Zen 1)
            prefault(matrix.array)
        for _ in range(2):  # a frame's graphs too; again where the buffer's growth left one stale
            for matrix, columns in self.products():
                matrix.prepare(columns)
        self.num_groups = self.quantizer.num_groups
        self.samples_per_frame = int(
            np.prod([up.s for up, _ in self.upsample]) * np.prod([blk.up.s for blk in self.blocks])
        )
        heap.reserve(FRAME_HEAP)  # last: a frame's buffers, not the weights, take this memory

    def new_state(self) -> DecoderState:
        """A new utterance: zero context everywhere, RoPE position 0."""
        return DecoderState(
            pre_conv=self.pre_conv.new_state(),
            transformer=self.transformer.new_state(),
            upsample=[(up.new_state(), block.new_state()) for up, block in self.upsample],
            entry=self.entry.new_state(),
            blocks=[block.new_state() for block in self.blocks],
            post_conv=self.post_conv.new_state(),
        )

    def push(self, state: DecoderState, codes: np.ndarray, threads: int | None = None) -> np.ndarray:
        """Decode the next frames of the utterance: codes [n, groups] -> audio [n * spf], on
        `threads` BLAS threads (default: the decoder's `threads`)."""
        return self.push_many([state], [codes], threads)[0]

    def push_many(
        self,
        states: Sequence[DecoderState],
        codes: Sequence[np.ndarray],
        threads: int | None = None,
        between: Callable[[], None] | None = None,
    ) -> list[np.ndarray]:
        """Decode the next n frames of several utterances (streams) together, the same n for
        each: codes [n, groups] per stream -> audio [n * spf] per stream, each state advanced
        as `push` leaves it, bit for bit.
        The layers up to the first decoder blocks multiply their weights once by the columns of
        all the streams: with one stream's few columns, reading the weights is the cost. The
        later blocks run stream by stream; `between()` is called after each stream's, and may
        push other states meanwhile (a stream that must be heard soon need not wait for the
        whole pass)."""
        if len(states) != len(codes):
            raise ValueError(f"{len(states)} states for {len(codes)} code arrays")
        if len({id(state) for state in states}) != len(states):
            raise ValueError("a state is pushed twice")
        frames = [self._check(c) for c in codes]
        n = len(frames[0]) if frames else 0
        if any(len(c) != n for c in frames):
            raise ValueError(
                f"every stream must push the same number of frames, got {[len(c) for c in frames]}"
            )
        outs = [np.empty(n * self.samples_per_frame, F32) for _ in states]
        if not n:
            return outs
        count = len(states)
        joint = np.stack(frames, axis=1).reshape(n * count, self.num_groups)  # stream index fastest
        streams = _Streams.stack(states)
        done = [0] * count
        with self._threads(threads):
            for i in range(0, n, MAX_FRAMES_PER_PASS):
                h = self.quantizer(joint[i * count : (i + MAX_FRAMES_PER_PASS) * count])
                h = self.transformer(
                    [state.transformer for state in states], self.pre_conv(streams.pre_conv, h)
                )
                for s, piece in self._render(streams, h):
                    outs[s][done[s] : done[s] + len(piece)] = piece
                    done[s] += len(piece)
                    if between is not None:
                        between()
        streams.unstack()
        return outs

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """One-shot: a fresh utterance decoded whole."""
        return self.push(self.new_state(), codes)

    def prime(self, state: DecoderState, codes: np.ndarray, threads: int | None = None) -> None:
        """Advance `state` past `codes` (an in-context voice's reference) without making their
        audio: the state is then what `push(state, codes)` leaves, to float rounding, at a
        fraction of the cost. The quantizer, pre-conv and transformer run on every frame (each
        attention layer looks 71 frames back, so the transformer's state depends on them all);
        the convolutions after it hold finite contexts, which depend on the last
        `lookback_frames` frames only, so only those run through them."""
        codes = np.asarray(codes, dtype=np.int64)
        with self._threads(threads):
            h = self.transformer([state.transformer], self.pre_conv(state.pre_conv, self.quantizer(codes)))
            for _ in self._render(_Streams.stack([state]), h[:, -self.lookback_frames :]):
                pass

    @contextmanager
    def _threads(self, threads: int | None) -> Iterator[None]:
        """The products of the block run on `threads` threads (default: the decoder's): BLAS's,
        and our kernel's in a team, of no more threads than cores (its helpers spin)."""
        n = threads or self.threads
        with (
            self._blas.limit(limits=n),
            f32_product.threads(min(n, available_cores()) if self._kernel else 1),
        ):
            yield

    def _check(self, codes: np.ndarray) -> np.ndarray:
        """One stream's codes [n, groups] as int64, checked."""
        codes = np.asarray(codes)
        if codes.ndim != 2 or codes.shape[1] != self.num_groups:
            raise ValueError(f"codes must be [n, {self.num_groups}], got {codes.shape}")
        if codes.size and codes.max() >= self.quantizer.codebook_size:
            raise ValueError(f"codes must be < {self.quantizer.codebook_size}, got {codes.max()}")
        return codes.astype(np.int64)

    @cached_property
    def lookback_frames(self) -> int:
        """How many frames back the state of the layers after the transformer reaches: each
        layer's context in frames at its rate (a transposed conv sees one input column back),
        summed over the layers, rounded up (11 for the official decoder)."""
        frames, rate = 0.0, 1  # rate: columns per frame at the current layer's input
        for up, convnext in self.upsample:
            frames += 1 / rate
            rate *= up.s
            frames += (convnext.dwconv.k - 1) / rate
        frames += self.entry.context / rate
        for block in self.blocks:
            frames += 1 / rate
            rate *= block.up.s
            frames += sum(unit.conv1.context + unit.conv2.context for unit in block.units) / rate
        frames += self.post_conv.context / rate
        return math.ceil(frames)

    def products(self) -> Iterator[tuple[Matrix, int]]:
        """Every matrix product of a frame's decode, in order: (its weight, its columns per
        frame; a tiled conv's weights once per chunk of tiles, with its columns). Depthwise
        convolutions, attention and activations are left out: they are well under 1% of the
        multiply-adds."""
        q, tfm = self.quantizer, self.transformer
        yield q.first_out.w, 1
        yield q.rest_out.w, 1
        yield from self.pre_conv.calls(1)
        yield tfm.in_proj.w, 1
        for layer in tfm.layers:
            yield from ((m.w, 1) for m in (layer.qkv, layer.out, layer.gate_up, layer.down))
        yield tfm.out_proj.w, 1
        rate = 1  # columns per frame at the current layer's input
        for up, convnext in self.upsample:
            yield up.w, rate
            rate *= up.s
            yield convnext.pw1.w, rate
            yield convnext.pw2.w, rate
        yield from self.entry.calls(rate)
        for block in self.blocks:
            yield block.up.w, rate
            rate *= block.up.s
            for conv in block.convs:
                yield from conv.calls(rate)
        yield from self.post_conv.calls(rate)

    def matrices(self) -> dict[int, tuple[Matrix, int]]:
        """Each matrix of `products` by its id, with the most columns a call of it multiplies
        per frame (a tiled conv's weights come once per chunk of tiles)."""
        most: dict[int, tuple[Matrix, int]] = {}
        for matrix, columns in self.products():
            most[id(matrix)] = matrix, max(columns, most.get(id(matrix), (matrix, 0))[1])
        return most

    def _per_stream_matrices(self) -> set[int]:
        """The ids of the matrices that `push_many` multiplies stream by stream (`_render`). The
        others multiply all the streams' columns at once, so not on numpy's BLAS, whose numbers
        for a column depend on the columns beside it (OpenBLAS' Haswell kernels do even where
        its SkylakeX ones do not): on ggml's graphs, however many columns a frame they take."""
        blocks = self.blocks[JOINT_BLOCKS:]
        convs = [conv for block in blocks for conv in block.convs] + [self.post_conv]
        return {id(block.up.w) for block in blocks} | {id(m) for conv in convs for m, _ in conv.calls(1)}

    def _convs(self) -> Iterator[CausalConv]:
        yield from (self.pre_conv, self.entry, self.post_conv)
        for block in self.blocks:
            yield from block.convs

    @cached_property
    def macs_per_frame(self) -> int:
        """Multiply-adds of the matrix products per frame (`products`)."""
        return sum(math.prod(m.shape) * columns for m, columns in self.products())

    def products_time(self, frames: int = 1, repeat: int = 3, in_order: bool = False) -> float:
        """Seconds per frame that the matrix products alone take at `frames` frames per push,
        on the same kernels and shapes as a decode (the blocks' column pieces included), on
        the decoder's threads: the floor its multiply-adds set. Best of `repeat`: of each
        product repeated (its weights then come from the caches), or, `in_order`, of all the
        products one after the other as a decode runs them (weights from memory: the caches
        hold a few percent of the 0.42 GB a frame reads)."""
        rng = np.random.default_rng(0)
        calls = []  # (product, input, its calls per `frames` frames)
        for m, columns in self.products():
            n = columns * frames
            piece = n if m.allocator else columns  # as a decode calls it (see `_blocks`)
            calls.append((m, rng.standard_normal((m.shape[1], piece), dtype=F32), n // piece))

        def run(group: Sequence[tuple[Matrix, np.ndarray, int]]) -> float:
            best = math.inf
            for _ in range(repeat):
                start = time.perf_counter()
                for m, x, count in group:
                    for _ in range(count):
                        m(x)
                best = min(best, time.perf_counter() - start)
            return best

        with self._threads(None):
            total = run(calls) if in_order else sum(run([call]) for call in calls)
        return total / frames

    def _render(self, streams: _Streams, h: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """The audio of the transformer's output h [C, n * S] of S streams, in consecutive
        pieces of each stream's: (stream, samples). The upsampling, the entry conv and the first
        `JOINT_BLOCKS` decoder blocks run on all the streams' columns at once, the later blocks
        (many columns, small weights: the multiplications are the cost) per stream. Up to the
        first decoder block a pass runs whole (the weights are large, the activations small);
        from there on one frame at a time (see `_blocks`). Every layer streams, so any split
        gives the same samples."""
        count = len(streams.states)
        frames = h.shape[1] // count  # the transformer's output is a column per frame
        for (up, convnext), (tail, context) in zip(self.upsample, streams.upsample):
            h = convnext(context, up(tail, h))
        joint = _blocks(
            self.blocks[:JOINT_BLOCKS], streams.blocks, np.split(self.entry(streams.entry, h), frames, axis=1)
        )
        for s, state in enumerate(streams.states):
            pieces = [p.reshape(p.shape[0], -1, count)[:, :, s] for p in joint]
            for h in _blocks(self.blocks[JOINT_BLOCKS:], state.blocks[JOINT_BLOCKS:], pieces):
                n = h.shape[1]
                self.post_act(h, out=state.post_conv.input(n))
                yield s, np.clip(self.post_conv.run(state.post_conv, n).reshape(-1), -1.0, 1.0)


def _blocks(
    blocks: Sequence[DecoderBlock], states: Sequence[BlockState], pieces: list[np.ndarray]
) -> list[np.ndarray]:
    """Decoder blocks on consecutive pieces of their input, one frame's each: the output
    pieces, one frame's each (numpy's products then have the same columns whatever the push,
    and the activations stay in the L2 cache)."""
    for block, state in zip(blocks, states):
        pieces = [block(state, p) for p in pieces]
    return pieces


# ---------------------------------------------------------------------------------------------
# Reading the weights
# ---------------------------------------------------------------------------------------------


def _float32(w: np.ndarray, columns: int = 16) -> np.ndarray:
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


@cache
def _code() -> tuple[Path, ...]:
    """The files of the code that makes the weights' layouts (`WeightCache`'s key)."""
    return cache_files.code([sys.modules[__name__], winograd, f32_product], ["f32_product"])


def _pair(f: GGUFFile, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    return f.read(prefix + ".weight"), f.read(prefix + ".bias")


def _kernel(f: GGUFFile, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """A weight, mapped (float16 where the file stores it so: see `Matrix`), and its bias. The
    layer uses the weight in place where its layout is the file's; else it copies it into its
    own, reading the mapping once (fresh memory is slow to fault in, 0.3-2 GB/s on the hosts
    measured, so every copy costs startup)."""
    return f.weight(prefix + ".weight"), f.read(prefix + ".bias")


def _conv(f: GGUFFile, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """A Conv1d kernel [C_out, C_in, k] and its bias; C_out from the bias, since the GGUF shape
    drops a leading 1 (the last conv's C_out)."""
    w, b = _kernel(f, prefix)
    return w.reshape(len(b), -1, w.shape[-1]), b


def _snake(f: GGUFFile, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    return f.read(prefix + ".alpha"), f.read(prefix + ".beta")


def _count(f: GGUFFile, pattern: str) -> int:
    n = 0
    while f.has_tensor(pattern.format(bid=n) + ".weight") or f.has_tensor(pattern.format(bid=n)):
        n += 1
    return n


def _bench(argv: list[str] | None = None) -> None:
    """`python -m kazeia_stream.engine.codec MMPROJ [FRAMES_PER_PUSH ...] [--streams S,...]`:
    ms per frame while streaming, one stream pushing FRAMES_PER_PUSH frames per call (and its
    matrix products alone, the floor), or S streams pushing one frame each per call (ms per
    stream-frame). CPU time is what the process used; with other processes on the machine,
    wall time is the larger."""
    import argparse
    from functools import partial

    ap = argparse.ArgumentParser(description=_bench.__doc__)
    ap.add_argument("mmproj")
    ap.add_argument("per_push", nargs="*", type=int, help="default: 1 4 12 without --streams")
    ap.add_argument("--streams", type=lambda v: [int(s) for s in v.split(",")], default=[])
    ap.add_argument("--frames", type=int, default=48, help="frames decoded per measurement")
    ap.add_argument("--repeat", type=int, default=3, help="measurements; the best is shown")
    ap.add_argument(
        "--threads", type=int, default=DECODER_THREADS, help=f"BLAS threads (default {DECODER_THREADS})"
    )
    args = ap.parse_args(argv)
    dec = CodecDecoder(GGUFFile(args.mmproj), threads=args.threads)
    size = (max(args.streams, default=1), args.frames, dec.num_groups)
    codes = np.random.default_rng(0).integers(0, dec.quantizer.codebook_size, size)

    def measure(label: str, run: Callable[[], None], frames: int) -> None:
        run()  # warm up
        walls, cpus = [], []
        for _ in range(args.repeat):
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            walls.append((time.perf_counter() - wall) / frames * 1e3)
            cpus.append((time.process_time() - cpu) / frames * 1e3)
        print(
            f"{label}: {min(walls):6.1f} ms/frame wall (best of {args.repeat}; "
            f"mean {np.mean(walls):.1f}), {min(cpus):6.1f} ms/frame cpu",
            flush=True,
        )

    def one_stream(per: int) -> None:
        state = dec.new_state()
        for i in range(0, args.frames, per):
            dec.push(state, codes[0, i : i + per])

    def streams(count: int, frames: int) -> None:
        states = [dec.new_state() for _ in range(count)]
        for i in range(frames):
            dec.push_many(states, list(codes[:count, i : i + 1]))

    for per in args.per_push or ([] if args.streams else [1, 4, 12]):
        measure(f"{per:3d} frames per push", partial(one_stream, per), args.frames)
        floor = dec.products_time(per, args.repeat) * 1e3
        in_order = dec.products_time(per, args.repeat, in_order=True) * 1e3
        print(
            f"{per:3d} frames per push: {floor:6.1f} ms/frame for the matrix products alone, "
            f"{in_order:.1f} in a decode's order (weights from memory)",
            flush=True,
        )
    for count in args.streams:
        frames = max(1, args.frames // count)  # per stream: about --frames in all
        measure(f"{count:3d} streams, 1 frame each per push", partial(streams, count, frames), frames * count)


if __name__ == "__main__":
    _bench()
