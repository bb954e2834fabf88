"""Float32 weights times float32 columns on a kernel of our own (`f32_product.c`), called
directly on the codec decoder's own buffers (`matrix.Matrix`), on one thread or shared by rows
with helper threads (`Team`); packed weights may be float16 as a file stores them, widened in
the registers: the same numbers.

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
call (docs/measurements.md, 2026-12-04, late night).

A plain shared library that setuptools builds at install with the package (optional: without a
C compiler, or on a CPU without AVX2, or with `KAZEIA_F32_KERNEL=0`, the products run on
ggml's kernels and numpy's BLAS; `KAZEIA_F32_KERNEL=avx2` holds a CPU with AVX-512 to the AVX2
variant, which gives the same numbers).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar, Token
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


def packed_shape(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """The shape of `pack`'s panels of a matrix of `shape` [out, in]."""
    out, k = shape
    return -(-out // PANEL), k, PANEL


def pack(w: np.ndarray) -> np.ndarray:
    """A float32 or float16 matrix [out, in] (any strides: a transposed view will do) as
    `multiply`'s panels take it, in its own type: PANEL rows at a time, each panel [in, PANEL],
    the rows beyond `out` zero: [ceil(out / PANEL), in, PANEL], in one pass of our kernel's
    (numpy's transposes took 3x as long to load the decoder)."""
    out, k = w.shape
    packed = np.empty(packed_shape(w.shape), w.dtype)
    row, col = (s // w.itemsize for s in w.strides)
    _function("pack" + _WEIGHTS[w.dtype])(native.data(w), out, k, row, col, native.data(packed))
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


def multiply(w: np.ndarray, shape: tuple[int, int], x: np.ndarray, out: np.ndarray, variant: str) -> None:
    """out = W @ x, called directly on the caller's buffers, for W of `shape` [m, k]: either
    `pack(W)` (3-D), x's and out's columns each contiguous (Winograd's planes), or W in place,
    x's and out's rows contiguous (the decoder's channel-major buffers). Every element is one
    chain of fmadds over k in order either way: the same numbers, on this thread alone or
    shared by rows with a `Team`'s helpers."""
    (m, k), n = shape, x.shape[1]
    assert x.shape[0] == k and out.shape == (m, n) and x.dtype == out.dtype == np.float32
    if w.ndim == 3:
        assert x.strides[0] == out.strides[0] == 4, "panels take columns of contiguous numbers"
        op, w_row, x_step, out_step = "panels" + _WEIGHTS[w.dtype], 0, x.strides[1], out.strides[1]
    else:
        assert w.dtype == np.float32, "weights in place are float32"
        assert x.strides[1] == out.strides[1] == w.strides[1] == 4, "rows of contiguous numbers"
        op, w_row, x_step, out_step = "rows", w.strides[0] // 4, x.strides[0], out.strides[0]
    address, parts = sharing()
    _calls().kz_f32_product_shared(
        address,
        parts,
        native.address("f32_product", variant, op),
        native.data(w),
        w.itemsize,
        m,
        k,
        w_row,
        native.data(x),
        x_step // 4,
        n,
        native.data(out),
        out_step // 4,
    )


def sharing() -> tuple[int | None, int]:
    """The team that this thread's products share their rows with now (`Team`): its address
    and threads, or (None, 1) for none."""
    team = _team.get()
    return (team.address, team.threads) if team else (None, 1)


def shared_address() -> int:
    """The address of f32_product.c's `kz_f32_product_shared` (`multiply`'s call), for a kernel
    of ours that multiplies on this one (winograd.c)."""
    return ctypes.cast(_calls().kz_f32_product_shared, ctypes.c_void_p).value or 0


class Team:
    """While `with Team(n)` holds, the products that its thread calls share their rows among
    `n` threads: it and n - 1 helpers, which spin between the products until the block ends
    (for a block that has the cores to itself: the decoder's first frames)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._state = ctypes.create_string_buffer(_calls().kz_f32_product_team_size())
        self.address = ctypes.addressof(self._state)
        self._token: Token[Team | None] | None = None
        self._helpers = [
            threading.Thread(
                target=_calls().kz_f32_product_serve, args=(self._state, i), name="kazeia-product"
            )
            for i in range(1, threads)
        ]

    @property
    def shared(self) -> int:
        """How many products it has shared with its helpers."""
        return ctypes.c_uint64.from_buffer(self._state).value

    def __enter__(self) -> Team:
        for helper in self._helpers:
            helper.start()
        self._token = _team.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        _team.reset(self._token)
        _calls().kz_f32_product_stop(self._state)
        for helper in self._helpers:
            helper.join()


def threads(n: int) -> AbstractContextManager[Team | None]:
    """The products called in the block on `n` threads: a `Team` of them, or, for one (or
    without the kernel), this thread alone."""
    return Team(n) if n > 1 and variants() else nullcontext()


_team: ContextVar[Team | None] = ContextVar("f32_product_team", default=None)


@cache
def _calls() -> ctypes.CDLL:
    """f32_product.c's library with its teams' calls declared."""
    lib = native.library("f32_product")
    assert lib is not None, "the kernel is not built here"
    calls = {
        "team_size": ([], ctypes.c_size_t),
        "serve": ([_P, _I], None),
        "stop": ([_P], None),
        "shared": ([_P, _I, _P, _P, ctypes.c_size_t, _I, _I, _I, _P, _I, _I, _P, _I], None),
    }
    for name, (args, result) in calls.items():
        fn = getattr(lib, f"kz_f32_product_{name}")
        fn.argtypes, fn.restype = args, result
    return lib
