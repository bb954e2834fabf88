"""Winograd's minimal filtering F(4, 7) (Lavin and Gray, 2015) for the codec decoder's causal
convolutions of 7 taps: four outputs of a channel from 10 inputs in 10 products instead of 28,
so a convolution [C_out, C_in, 7] over n columns costs 10 GEMMs [C_out, C_in] x [C_in, n / 4]
instead of 7 of n columns: 5/14 of the multiply-adds. The decoder's residual units are most of
its multiply-adds and bound by them on CPUs whose float32 FMA is the limit (Zen 1: 8 a cycle);
the transforms before and after the GEMMs are a few percent (ours, `winograd.c`).

Tiles: outputs t, t + d, t + 2 d and t + 3 d (d the dilation times the streams: a context
buffer's columns), in blocks of 4 d columns from the first column of each frame of a call,
then tiles of fewer outputs for the rest of the frame; so every column of an utterance is
always in the same tile, whatever frames a call takes with it, and chunks of any sizes give
the samples of the one-shot decode, bit for bit. The numbers differ from the direct convolution's
by float rounding, amplified by the transforms: about 1e-5 of the largest output on random
weights against 3e-7 for the direct one and 2e-6 for F(2, 7) (tests/test_winograd.py). The
interpolation points 0, +-1, +-2, +-1/2, +-3/4 and infinity gave the least rounding of the
sets tried, with +-4/3 (+-3/2, +-2/3, +-1/3, +-3, +-4, +-1/4 in the last pair: up to 5e-5);
they come in pairs +p and -p, which the kernel uses.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import cache

import numpy as np

from . import f32_product, native

ENV = "KAZEIA_WINOGRAD"  # "0": the direct products, each tap's, as the official decoder
TAPS = 7
OUTPUTS = 4  # a whole tile's
_PAIRS = (Fraction(1), Fraction(2), Fraction(1, 2), Fraction(3, 4))
POINTS = (Fraction(0), *(q for p in _PAIRS for q in (p, -p)))
SIZE = TAPS + OUTPUTS - 1  # a tile's inputs and products: len(POINTS) and infinity
# A call's tiles are transformed and multiplied in chunks of at most this many (about even):
# the planes of a whole frame of the last blocks (2-3 MB) spill the caches between the
# transforms and the products. In F(2, 7), block 4 (96 channels, 960 tiles), one conv with the
# L2 cache flushed first: 7.3-9.2 ms in chunks of 256 against 8.7-12.2 whole and 11.5-11.8
# direct; in F(4, 7), a 0.6B decode: 116.5 ms a frame in chunks of 256 or 128, 124-129 in 64.
CHUNK_TILES = 256
_LINE = 16  # floats in a cache line
_RUN = 4  # int64 fields of winograd.c's `struct run`: col, count, step, outputs

F32 = np.float32


def available() -> bool:
    """Whether the decoder multiplies so: our transforms' kernel runs here (built, the CPU has
    AVX2 with FMA) and so does our float32 kernel, which it calls for the products
    (`f32_product.chosen`), and `KAZEIA_WINOGRAD=0` does not ask for the direct products."""
    wanted = os.environ.get(ENV) != "0"
    return wanted and bool(native.variants("winograd")) and f32_product.chosen() is not None


def _inverse(a: list[list[Fraction]]) -> list[list[Fraction]]:
    """The inverse of a square matrix of fractions (Gauss-Jordan), exact."""
    n = len(a)
    rows = [row[:] + [Fraction(int(i == j)) for j in range(n)] for i, row in enumerate(a)]
    for col in range(n):
        pivot = next(r for r in range(col, n) if rows[r][col] != 0)
        rows[col], rows[pivot] = rows[pivot], rows[col]
        rows[col] = [v / rows[col][col] for v in rows[col]]
        for r in range(n):
            if r != col and rows[r][col] != 0:
                rows[r] = [v - rows[r][col] * p for v, p in zip(rows[r], rows[col])]
    return [row[n:] for row in rows]


def _vandermonde(columns: int) -> list[list[Fraction]]:
    """Polynomials of `columns` coefficients evaluated at POINTS and at infinity (the leading one)."""
    infinity = [Fraction(int(j == columns - 1)) for j in range(columns)]
    return [[p**j for j in range(columns)] for p in POINTS] + [infinity]


@cache
def matrices() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A^T [4, 10], G [10, 7], B^T [10, 10] (float64, exact fractions rounded once) such that
    y = A^T ((G g) * (B^T x)) is the correlation y_i = sum_j g_j x_(i + j), i = 0 .. 3: the
    transposed Toom-Cook algorithm for the linear convolution of 7 and 4 coefficients."""
    to_array = lambda m: np.array([[float(v) for v in row] for row in m])
    a_t = to_array(_vandermonde(OUTPUTS)).T.copy()
    b_t = to_array(_inverse(_vandermonde(SIZE))).T.copy()
    return a_t, to_array(_vandermonde(TAPS)), b_t


def kernel_weights(w: np.ndarray) -> np.ndarray:
    """U [10, C_out, C_in] float32 of a convolution's weight w [C_out, C_in, 7]: U_k = sum_j
    G[k, j] w_j. One float32 product at load, 5-7 ms for the largest (in float64, 100 ms, for
    a last bit, far below the transforms' rounding)."""
    c_out, c_in, taps = w.shape
    return (float32_matrices()[1] @ w.reshape(c_out * c_in, taps).T).reshape(SIZE, c_out, c_in)


@cache
def float32_matrices() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`matrices()` in float32, as the weights' product and the transforms' kernel take them
    (computed once, in exact fractions: 11 ms on Zen 1, which a decoder's load spends rather
    than its first frame)."""
    a_t, g, b_t = matrices()
    return a_t.astype(F32), g.astype(F32), b_t.astype(F32)


@cache
def plan(cols: int, d: int, frame: int = 0) -> np.ndarray:
    """The tiles of a call of `cols` columns with a dilation of d columns, as winograd.c's
    runs [n, 4], frame by frame (`frame` columns each; 0: the call is one frame): each frame's
    as `_frame_plan` has them, from its first column."""
    frame = frame or max(cols, 1)
    if cols % frame:
        raise ValueError(f"a call of {cols} columns is not whole frames of {frame}")
    one = _frame_plan(frame, d)
    shifts = np.arange(0, cols, frame, dtype=np.int64)[:, None, None] * np.array([1, 0, 0, 0], dtype=np.int64)
    return (one[None] + shifts).reshape(-1, _RUN)


def _frame_plan(cols: int, d: int) -> np.ndarray:
    """The tiles of one frame of `cols` columns: blocks of 4 d columns (d whole tiles each,
    one run with step 4 for d = 1), then for the last cols mod 4 d columns tiles of the outputs
    that fit there."""
    span = OUTPUTS * d
    blocks, start = cols // span, cols // span * span
    runs = [(0, blocks, OUTPUTS, OUTPUTS)] if d == 1 else [(span * b, d, 1, OUTPUTS) for b in range(blocks)]
    rest = [-(-(cols - t) // d) for t in range(start, min(start + d, cols))]  # each tile's outputs
    for outputs in sorted(set(rest), reverse=True):  # tiles of fewer outputs come later
        first = rest.index(outputs)
        runs.append((start + first, rest.count(outputs), 1, outputs))
    return np.array([r for r in runs if r[1]], dtype=np.int64).reshape(-1, _RUN)


def tiles(cols: int, d: int, frame: int = 0) -> int:
    """The columns of each of the 10 products for a call of `cols` columns."""
    return int(plan(cols, d, frame)[:, 1].sum())


@dataclass(frozen=True)
class Chunk:
    """Consecutive tiles of a call, transformed and multiplied together: `runs` (`plan`'s,
    columns counted from `start`), reading the `width` columns from `start` on."""

    start: int
    width: int
    runs: np.ndarray
    tiles: int


@cache
def chunks(cols: int, d: int, frame: int = 0) -> tuple[Chunk, ...]:
    """`plan(cols, d, frame)` in chunks of at most CHUNK_TILES tiles, as even as they come."""
    runs, count = plan(cols, d, frame), tiles(cols, d, frame)
    size = math.ceil(count / math.ceil(count / CHUNK_TILES))
    pieces: list[list[tuple[int, int, int, int]]] = [[]]
    room = size
    for col, n, step, outputs in runs.tolist():
        while n:
            take = min(n, room)
            pieces[-1].append((col, take, step, outputs))
            col, n, room = col + take * step, n - take, room - take
            if not room:
                pieces.append([])
                room = size
    result = []
    for piece in filter(None, pieces):
        start = piece[0][0]
        end = max(col + (n - 1) * step + (TAPS - 2 + outs) * d for col, n, step, outs in piece) + 1
        rel = np.array([(col - start, n, step, outs) for col, n, step, outs in piece], dtype=np.int64)
        result.append(Chunk(start, end - start, rel, sum(n for _, n, _, _ in piece)))
    return tuple(result)


_P, _I = ctypes.c_void_p, ctypes.c_int64


class Products(ctypes.Structure):
    """winograd.c's `struct products`: a convolution's 10 products U_k V_k on our float32
    kernel (`f32_product`), each U_k [C_out, C_in] packed in panels. It points into the
    arrays, which their holder keeps (the convolution's `Matrix`es)."""

    _fields_ = [
        ("shared", _P),
        ("panels", _P),
        ("size", _I),
        ("c_out", _I),
        ("c_in", _I),
        ("u", _P * SIZE),
    ]

    @classmethod
    def of(cls, weights: Sequence[np.ndarray], shape: tuple[int, int], variant: str) -> Products:
        """The products of `weights` (`f32_product.pack`'s panels of U_k, of `shape`) on the
        kernel's `variant`."""
        assert len(weights) == SIZE and all(w.ndim == 3 and w.dtype == F32 for w in weights)
        return cls(
            shared=f32_product.shared_address(),
            panels=native.address("f32_product", variant, "panels"),
            size=4,
            c_out=shape[0],
            c_in=shape[1],
            u=(_P * SIZE)(*(native.data(w) for w in weights)),
        )


class _Chunk(ctypes.Structure):
    """winograd.c's `struct chunk`: a `Chunk`, its runs a slice of the call's."""

    _fields_ = [("start", _I), ("width", _I), ("first", _I), ("count", _I), ("tiles", _I)]


@dataclass(frozen=True)
class _Call:
    """`chunks(cols, d, frame)` as winograd.c takes them, and the most tiles and columns of one."""

    chunks: ctypes.Array[_Chunk]
    runs: np.ndarray
    tiles: int
    width: int


@cache
def _call(cols: int, d: int, frame: int) -> _Call:
    """A call's chunks in winograd.c's `struct chunk`s and runs, made once per shape."""
    parts = chunks(cols, d, frame)
    firsts = np.cumsum([0] + [len(c.runs) for c in parts])
    table = (_Chunk * len(parts))(
        *(_Chunk(c.start, c.width, f, len(c.runs), c.tiles) for c, f in zip(parts, firsts))
    )
    runs = np.concatenate([c.runs for c in parts]).astype(np.int64)
    return _Call(table, runs, max(c.tiles for c in parts), max(c.width for c in parts))


@cache
def _convolve() -> Callable[..., None]:
    fn = native.function("winograd", native.variants("winograd")[0], "conv")
    fn.argtypes = [_P, _I, _I, _P, _I, _P, _P, _P, _I, _P, _P, _P, _P, _I, _P, _I, _I, _P, _I, _I, _P]
    fn.restype = None
    return fn


def convolve(
    buf: np.ndarray, cols: int, d: int, frame: int, products: Products, bias: np.ndarray, y: np.ndarray
) -> None:
    """y [C_out, cols] = bias + the causal convolution of a context buffer buf [C_in, (6 d +
    cols)] (contiguous columns; output t's taps are columns t + j d), in F(4, 7): tiled as
    `chunks(cols, d, frame)` has it, each chunk's input transformed, multiplied by the 10
    `products` (on the team this thread's products share, `f32_product.sharing`) and
    transformed back, in one call of our kernel."""
    assert buf.dtype == y.dtype == bias.dtype == F32 and buf.strides[1] == 4 and y.flags.c_contiguous
    assert buf.shape[0] == products.c_in and y.shape == (products.c_out, cols) and bias.flags.c_contiguous
    call = _call(cols, d, frame)
    v, m = planes(call.tiles, products.c_in), planes(call.tiles, products.c_out)
    (ldv, plane_v), (ldm, plane_m) = _layout(v), _layout(m)
    team, parts = f32_product.sharing()
    a_t, _, b_t = float32_matrices()
    scratch = np.empty(9 * (call.width + 8), F32)
    _convolve()(
        native.data(buf),
        buf.strides[0] // 4,
        d,
        ctypes.addressof(call.chunks),
        len(call.chunks),
        native.data(call.runs),
        ctypes.addressof(products),
        team,
        parts,
        native.data(b_t),
        native.data(a_t),
        native.data(bias),
        native.data(y),
        cols,
        native.data(v),
        ldv,
        plane_v,
        native.data(m),
        ldm,
        plane_m,
        native.data(scratch),
    )


def planes(tiles: int, channels: int) -> np.ndarray:
    """An uninitialized [10, tiles, channels] float32, tile-major as the kernel takes the
    transforms' planes: rows padded to a multiple of 8 floats (a vector), planes starting a
    cache line further apart than their size (planes a multiple of 4 KB apart share the L1
    cache's sets, and the transforms, which walk the 10 at once, ran 6x slower so)."""
    width = -(-channels // 8) * 8
    flat = np.empty((SIZE, tiles * width + _LINE), F32)[:, : tiles * width]
    return flat.reshape(SIZE, tiles, width)[:, :, :channels]


def _layout(p: np.ndarray) -> tuple[int, int]:
    """(row, plane) strides in floats of `planes`' planes, checked."""
    assert p.dtype == F32 and p.strides[2] == 4 and p.strides[1] % 32 == 0 and p.shape[0] == SIZE
    return p.strides[1] // 4, p.strides[0] // 4
