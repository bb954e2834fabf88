"""Winograd's minimal filtering F(m, 7) (Lavin and Gray, 2015) for the codec decoder's causal
convolutions of 7 taps, in two tilings: F(6, 7), six outputs of a channel from 12 inputs in 12
products instead of 42, and F(4, 7), four from 10 in 10 instead of 28. A convolution [C_out,
C_in, 7] over n columns costs m + 6 GEMMs [C_out, C_in] x [C_in, n / m] instead of 7 of n
columns: 2/7 of the multiply-adds in F(6, 7), 5/14 in F(4, 7). Each convolution takes the
tiling of fewer multiply-adds for its frame's columns (`fewest`): F(6, 7) but for the 0.6B's
first block at a dilation of 9, whose 32 columns a frame fill no tile of 6. The decoder's
residual units are most of its multiply-adds and bound by them on CPUs whose float32 FMA is the
limit; the transforms before and after the GEMMs are a few percent (ours, `winograd.c`).

Tiles: outputs t, t + d, ..., t + (m - 1) d (d the dilation times the streams: a context
buffer's columns), in blocks of m d columns from the first column of each frame of a call,
then tiles of fewer outputs for the rest of the frame; so every column of an utterance is
always in the same tile, whatever frames a call takes with it, and chunks of any sizes give
the samples of the one-shot decode, bit for bit. The numbers differ from the direct
convolution's by float rounding, amplified by the transforms: 2e-6 to 7e-6 of the largest
output on random weights in F(4, 7), 5e-6 to 9e-6 in F(6, 7), against 3e-7 for the direct one
(tests/test_winograd.py). The points come in pairs +p and -p, which the kernel uses, with 0 and
infinity: in F(4, 7) +-1, +-2, +-1/2 and +-3/4, the least rounding of the sets tried (+-4/3 as
little; +-3/2, +-2/3, +-1/3, +-3, +-4, +-1/4 in the last pair: up to 5e-5); in F(6, 7) +-1,
+-3/2, +-2/3, +-3 and +-1/3, of 16 sets tried the one that moved the random 0.6B's audio least
(over 12 frames, 1.7-1.8e-5 at most with its float16 decoder and 1.8-2.0e-5 with its float32
one, against 2.4-2.9e-5 for F(4, 7)'s points with +-4/3, and up to 7.5e-5 for others; two
others about as little).
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
# The interpolation points' pairs +p and -p of F(m, 7), with 0 and infinity (see above)
_PAIRS = {
    4: (Fraction(1), Fraction(2), Fraction(1, 2), Fraction(3, 4)),
    6: (Fraction(1), Fraction(3, 2), Fraction(2, 3), Fraction(3), Fraction(1, 3)),
}
OUTPUTS = tuple(_PAIRS)  # a whole tile's, in the tilings winograd.c runs (its MAX_OUT the most)
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


def size(outputs: int) -> int:
    """A tile's inputs and products in F(outputs, 7): its points and infinity."""
    return outputs + TAPS - 1


def points(outputs: int) -> tuple[Fraction, ...]:
    """The finite interpolation points of F(outputs, 7): 0 and the pairs +p, -p."""
    return (Fraction(0), *(q for p in _PAIRS[outputs] for q in (p, -p)))


def _vandermonde(columns: int, outputs: int) -> list[list[Fraction]]:
    """Polynomials of `columns` coefficients evaluated at `points(outputs)` and at infinity
    (the leading one)."""
    infinity = [Fraction(int(j == columns - 1)) for j in range(columns)]
    return [[p**j for j in range(columns)] for p in points(outputs)] + [infinity]


@cache
def matrices(outputs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A^T [m, m + 6], G [m + 6, 7], B^T [m + 6, m + 6] for m = `outputs` (float64, exact
    fractions rounded once) such that y = A^T ((G g) * (B^T x)) is the correlation y_i = sum_j
    g_j x_(i + j), i = 0 .. m - 1: the transposed Toom-Cook algorithm for the linear
    convolution of 7 and m coefficients."""
    to_array = lambda m: np.array([[float(v) for v in row] for row in m])
    a_t = to_array(_vandermonde(outputs, outputs)).T.copy()
    b_t = to_array(_inverse(_vandermonde(size(outputs), outputs))).T.copy()
    return a_t, to_array(_vandermonde(TAPS, outputs)), b_t


def fewest(frame: int, d: int) -> int:
    """The tile's outputs (of `OUTPUTS`) whose tiling of a frame of `frame` columns with a
    dilation of d takes the fewest multiply-adds: tiles times products (F(6, 7) needs 12 for 6
    outputs, F(4, 7) 10 for 4, but a frame whose columns leave partial tiles may need fewer
    in F(4, 7): the 0.6B's first block, 32 columns, a dilation of 9)."""
    return min(OUTPUTS, key=lambda m: (tiles(frame, d, m) * size(m), -m))


def kernel_weights(w: np.ndarray, outputs: int) -> np.ndarray:
    """U [m + 6, C_out, C_in] float32 of a convolution's weight w [C_out, C_in, 7] in F(m, 7):
    U_k = sum_j G[k, j] w_j. One float32 product at load, 5-7 ms for the largest (in float64,
    100 ms, for a last bit, far below the transforms' rounding)."""
    c_out, c_in, taps = w.shape
    g = float32_matrices(outputs)[1]
    return (g @ w.reshape(c_out * c_in, taps).T).reshape(size(outputs), c_out, c_in)


@cache
def float32_matrices(outputs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`matrices(outputs)` in float32, as the weights' product and the transforms' kernel take
    them (computed once, in exact fractions: 11 ms on Zen 1 for F(4, 7), which a decoder's load
    spends rather than its first frame)."""
    a_t, g, b_t = matrices(outputs)
    return a_t.astype(F32), g.astype(F32), b_t.astype(F32)


@cache
def plan(cols: int, d: int, outputs: int, frame: int = 0) -> np.ndarray:
    """The tiles of `outputs` outputs at most of a call of `cols` columns with a dilation of d
    columns, as winograd.c's runs [n, 4], frame by frame (`frame` columns each; 0: the call is
    one frame): each frame's as `_frame_plan` has them, from its first column."""
    frame = frame or max(cols, 1)
    if cols % frame:
        raise ValueError(f"a call of {cols} columns is not whole frames of {frame}")
    one = _frame_plan(frame, d, outputs)
    shifts = np.arange(0, cols, frame, dtype=np.int64)[:, None, None] * np.array([1, 0, 0, 0], dtype=np.int64)
    return (one[None] + shifts).reshape(-1, _RUN)


def _frame_plan(cols: int, d: int, m: int) -> np.ndarray:
    """The tiles of one frame of `cols` columns: blocks of m d columns (d whole tiles of m
    outputs each, one run with step m for d = 1), then for the last cols mod m d columns tiles
    of the outputs that fit there."""
    span = m * d
    blocks, start = cols // span, cols // span * span
    runs = [(0, blocks, m, m)] if d == 1 else [(span * b, d, 1, m) for b in range(blocks)]
    rest = [-(-(cols - t) // d) for t in range(start, min(start + d, cols))]  # each tile's outputs
    for outputs in sorted(set(rest), reverse=True):  # tiles of fewer outputs come later
        first = rest.index(outputs)
        runs.append((start + first, rest.count(outputs), 1, outputs))
    return np.array([r for r in runs if r[1]], dtype=np.int64).reshape(-1, _RUN)


def tiles(cols: int, d: int, outputs: int, frame: int = 0) -> int:
    """The columns of each of the products for a call of `cols` columns (`plan`'s tiles)."""
    return int(plan(cols, d, outputs, frame)[:, 1].sum())


@dataclass(frozen=True)
class Chunk:
    """Consecutive tiles of a call, transformed and multiplied together: `runs` (`plan`'s,
    columns counted from `start`), reading the `width` columns from `start` on."""

    start: int
    width: int
    runs: np.ndarray
    tiles: int


@cache
def chunks(cols: int, d: int, outputs: int, frame: int = 0) -> tuple[Chunk, ...]:
    """`plan(cols, d, outputs, frame)` in chunks of at most CHUNK_TILES tiles, as even as
    they come."""
    runs, count = plan(cols, d, outputs, frame), tiles(cols, d, outputs, frame)
    even = math.ceil(count / math.ceil(count / CHUNK_TILES))
    pieces: list[list[tuple[int, int, int, int]]] = [[]]
    room = even
    for col, n, step, outputs in runs.tolist():
        while n:
            take = min(n, room)
            pieces[-1].append((col, take, step, outputs))
            col, n, room = col + take * step, n - take, room - take
            if not room:
                pieces.append([])
                room = even
    result = []
    for piece in filter(None, pieces):
        start = piece[0][0]
        end = max(col + (n - 1) * step + (TAPS - 2 + outs) * d for col, n, step, outs in piece) + 1
        rel = np.array([(col - start, n, step, outs) for col, n, step, outs in piece], dtype=np.int64)
        result.append(Chunk(start, end - start, rel, sum(n for _, n, _, _ in piece)))
    return tuple(result)


_P, _I = ctypes.c_void_p, ctypes.c_int64


class Products(ctypes.Structure):
    """winograd.c's `struct products`: a convolution's m + 6 products U_k V_k in F(m, 7) on our
    float32 kernel (`f32_product`), each U_k [C_out, C_in] packed in panels. It points into
    the arrays, which their holder keeps (the convolution's `Matrix`es)."""

    _fields_ = [
        ("shared", _P),
        ("panels", _P),
        ("size", _I),
        ("c_out", _I),
        ("c_in", _I),
        ("outputs", _I),
        ("u", _P * size(max(OUTPUTS))),
    ]

    @classmethod
    def of(
        cls, weights: Sequence[np.ndarray], shape: tuple[int, int], variant: str, outputs: int
    ) -> Products:
        """The products of `weights` in F(`outputs`, 7) (`f32_product.pack`'s panels of its
        U_k, of `shape`) on the kernel's `variant`."""
        assert outputs in OUTPUTS and len(weights) == size(outputs)
        assert all(w.ndim == 3 and w.dtype == F32 for w in weights)
        return cls(
            shared=f32_product.shared_address(),
            panels=native.address("f32_product", variant, "panels"),
            size=4,
            c_out=shape[0],
            c_in=shape[1],
            outputs=outputs,
            u=(_P * size(max(OUTPUTS)))(*(native.data(w) for w in weights)),
        )


class _Chunk(ctypes.Structure):
    """winograd.c's `struct chunk`: a `Chunk`, its runs a slice of the call's."""

    _fields_ = [("start", _I), ("width", _I), ("first", _I), ("count", _I), ("tiles", _I)]


@dataclass(frozen=True)
class _Call:
    """`chunks(cols, d, outputs, frame)` as winograd.c takes them, and the most tiles and columns of one."""

    chunks: ctypes.Array[_Chunk]
    runs: np.ndarray
    tiles: int
    width: int


@cache
def _call(cols: int, d: int, outputs: int, frame: int) -> _Call:
    """A call's chunks in winograd.c's `struct chunk`s and runs, made once per shape."""
    parts = chunks(cols, d, outputs, frame)
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
    cols)] (contiguous columns; output t's taps are columns t + j d), in F(m, 7) for the m of
    `products`: tiled as `chunks(cols, d, m, frame)` has it, each chunk's input transformed,
    multiplied by the m + 6 `products` (on the team this thread's products share,
    `f32_product.sharing`) and transformed back, in one call of our kernel."""
    assert buf.dtype == y.dtype == bias.dtype == F32 and buf.strides[1] == 4 and y.flags.c_contiguous
    assert buf.shape[0] == products.c_in and y.shape == (products.c_out, cols) and bias.flags.c_contiguous
    outputs = products.outputs
    call = _call(cols, d, outputs, frame)
    v, m = planes(call.tiles, products.c_in, outputs), planes(call.tiles, products.c_out, outputs)
    (ldv, plane_v), (ldm, plane_m) = _layout(v), _layout(m)
    team, parts = f32_product.sharing()
    a_t, _, b_t = float32_matrices(outputs)
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


def planes(tiles: int, channels: int, outputs: int) -> np.ndarray:
    """An uninitialized [m + 6, tiles, channels] float32 for F(m, 7), tile-major as the kernel
    takes the transforms' planes: rows padded to a multiple of 8 floats (a vector), planes
    starting a cache line further apart than their size (planes a multiple of 4 KB apart share
    the L1 cache's sets, and the transforms, which walk them all at once, ran 6x slower so)."""
    width = -(-channels // 8) * 8
    flat = np.empty((size(outputs), tiles * width + _LINE), F32)[:, : tiles * width]
    return flat.reshape(size(outputs), tiles, width)[:, :, :channels]


def _layout(p: np.ndarray) -> tuple[int, int]:
    """(row, plane) strides in floats of `planes`' planes, checked."""
    assert p.dtype == F32 and p.strides[2] == 4 and p.strides[1] % 32 == 0
    return p.strides[1] // 4, p.strides[0] // 4
