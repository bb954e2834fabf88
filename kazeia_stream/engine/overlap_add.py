"""A transposed convolution's overlap-add (`codec_layers.CausalTransConv`): the product Z of
every tap by every input time step made into the output, each step's taps that reach into the
next one added there, and the last step's carried into the next call (its tail). On our C loop
(`overlap_add.c`) where it was built, else on numpy: the same sums in the same order, so the
same bits. numpy's loops over the stride's phases in Python, and over the streams innermost:
4-13x the C loop's time on the decoder's shapes, and 1-2% of a decode (Zen 3, a decode
alternated push by push between the two; docs/measurements.md, "2026-12-07, night")."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache

import numpy as np

from . import native

_P, _I = ctypes.c_void_p, ctypes.c_int64


def built() -> bool:
    """Whether the C loop was built here."""
    return _function() is not None


@cache
def _function() -> Callable[..., None] | None:
    """The C loop, where it was built."""
    lib = native.library("overlap_add")
    if lib is None:
        return None
    fn = lib.kz_overlap_add
    fn.argtypes, fn.restype = [_P, _P, _P, _P, _I, _I, _I, _I, _I], None
    return fn


def overlap_add(z: np.ndarray, bias: np.ndarray, tail: np.ndarray, stride: int) -> np.ndarray:
    """The output [C_out, n * stride * S] of Z [C_out, k, n, S] (tap, input time step, stream;
    time step t's tap m goes to output time step t * stride + m) plus `bias` [C_out, 1, 1],
    with the tail [k - stride, C_out, S] of the last call (the taps of its last time step that
    reach into this call's outputs) added to the first time step's, and replaced by this
    call's. All float32 and contiguous."""
    c_out, k, n, streams = z.shape
    assert z.dtype == bias.dtype == tail.dtype == np.float32
    assert z.flags.c_contiguous and bias.flags.c_contiguous and tail.flags.c_contiguous
    assert bias.size == c_out and tail.shape == (k - stride, c_out, streams) and n > 0
    y = np.empty((c_out, n, stride, streams), np.float32)
    fn = _function()
    if fn is None:
        _numpy(z, bias, tail, stride, y)
    else:
        fn(*map(native.data, (z, bias, tail, y)), c_out, k, stride, n, streams)
    return y.reshape(c_out, n * stride * streams)


def _numpy(z: np.ndarray, bias: np.ndarray, tail: np.ndarray, stride: int, y: np.ndarray) -> None:
    """`overlap_add` on numpy, into y [C_out, n, stride, S]: one phase at a time (numpy would
    loop over the short phase axis innermost)."""
    k = z.shape[1]
    for m in range(stride):
        ym = y[:, :, m]  # output time steps t * stride + m
        np.add(z[:, m], bias, out=ym)
        if m < k - stride:
            ym[:, 1:] += z[:, stride + m, :-1]
            ym[:, 0] += tail[m]
    tail[...] = z[:, stride:, -1].transpose(1, 0, 2)
