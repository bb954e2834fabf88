"""The attention's products over the KV cache on a kernel of our own (`kv_product.c`), as a
ggml custom operation in our graphs: a step's queries times the keys, and its weights times the
values, where the CPU has AVX2 with FMA and F16C.

ggml multiplies a float16 cache by a step's row as one dot product per position and head (the
keys) or per channel and head (the values), each a call with its sum across lanes, after
rounding the row to float16, and a step's cost grew with the positions it attends to well
beyond reading the cache: a talker step (random 0.6B, Q8_0, one thread, Zen 4) took 18.1 ms at
position 8 and 35.1 ms at 1000, where reading 1000 positions' cache takes about 4.5 ms. This
kernel reads each row of the cache once for every query head it serves, a few rows at a time,
in float32: 26.6-28.6 ms at 1000 (README, "How it works", Talker). Its numbers differ from
ggml's by that rounding; a step's do not depend on the threads or the steps beside it.

A step's whole attention (parts of one query row each: the talker's and the code predictor's
steps) runs as one operation of the same library (`attend`): the q and k heads normed and
rotated, k and v written into the caches, the scores, their softmax and the weighted values,
where ggml's graph ran nine operations a layer, each ended by a barrier at which one of the
threads waited. On the Xeon with AMX (2 threads, random 0.6B, Q8_0) a code predictor layer's
attention took 11 us against 35 and a talker layer's 51 against about 100; `bench --pipeline`
gave 1.26-1.31x its floor against 1.27-1.34x in three alternated pairs. Its numbers are
those of ggml's operations to rounding (its exponentials are its own; tested).

A plain shared library that setuptools builds at install with the package (optional: without
a C compiler, or on a CPU without AVX2, or with `KAZEIA_KV_KERNEL=0`, the products run on
ggml's `mul_mat`, and a step attends in ggml's operations, as it does with `KAZEIA_ATTEND=0`).
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Sequence
from functools import cache

from gguf import GGMLQuantizationType as QType

from . import native
from .ggml_graph import Graph, Tensor, dims, strides, type_of

ENV = "KAZEIA_KV_KERNEL"  # "0": ggml's mul_mat
ATTEND_ENV = "KAZEIA_ATTEND"  # "0": a step attends in ggml's operations and these products
NAME = "kv_product"
OUTS = 8  # rows of b a row of a serves, at most (kv_product.c's OUTS)


@cache
def chosen() -> str | None:
    """The variant the engines use (fixed at its first use), or None for ggml's mul_mat."""
    return native.chosen(NAME, ENV)


def product(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    """ggml_mul_mat(a, b) for a cache's view a [k, m, A, B] (float16 or float32) and few rows
    b [k, n, A g, B] (float32): [m, n, A g, B], on our kernel where it runs."""
    (k, m, heads, count), (_, n, b_heads, b_count) = dims(a), dims(b)
    variant, item = chosen(), {QType.F16: 2, QType.F32: 4}.get(type_of(a))
    if variant is None or item is None or n * b_heads // heads > OUTS:
        return g.mul_mat(a, b)
    assert type_of(b) == QType.F32 and strides(a)[0] == item and strides(b)[0] == 4
    assert dims(b)[0] == k and b_heads % heads == 0 and b_count == count
    return g.custom(native.address(NAME, variant), (m, n, b_heads, count), [a, b])


def attends(cache_type: QType, group: int, head_dim: int) -> bool:
    """Whether `attend` runs here (and `ATTEND_ENV` does not turn it off) for a cache of
    `cache_type` and `group` query heads per KV head of `head_dim` channels."""
    return (
        chosen() is not None
        and os.environ.get(ATTEND_ENV) != "0"
        and cache_type in (QType.F16, QType.F32)
        and group <= OUTS
        and head_dim % 2 == 0
    )


@cache
def _userdata(parts: int) -> type[ctypes.Structure]:
    """`struct attend` (kv_product.c) for `parts` parts."""
    fields = [
        ("eps", ctypes.c_float),
        ("theta", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("unused", ctypes.c_int32),
    ]
    fields += [("v_block", ctypes.c_int64), ("parts", ctypes.c_int64), ("slots", ctypes.c_int64 * parts)]
    return type(f"Attend{parts}", (ctypes.Structure,), {"_fields_": fields})


def attend(
    g: Graph,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    norms: tuple[Tensor, Tensor],
    positions: Tensor,
    caches: tuple[Tensor, Tensor],
    slots: Sequence[int],
    eps: float,
    theta: float,
) -> Tensor:
    """A layer's attention for parts of one row each (`attends`), as one operation: the rows q
    [hd heads, P], k and v [hd kvh, P] of the parts in `slots` at `positions` (int32 [P]), their
    q and k heads RMS-normed by `norms` (q_norm, k_norm [hd]) with `eps` and rotated (NeoX,
    base `theta`), k and v written into `caches` (K [kv channels, n_ctx, slots], V [positions
    in a block, kv channels, blocks, slots]) at the parts' positions, and each query head's
    softmax-weighted values over the positions up to its part's: [hd heads, P]."""
    variant = chosen()
    assert variant is not None
    head_dim = dims(norms[0])[0]
    data = _userdata(len(slots))(eps, theta, 1.0 / math.sqrt(head_dim), 0, dims(caches[1])[0], len(slots))
    data.slots[:] = list(slots)
    args = [q, k, v, *norms, positions, *caches]
    return g.custom(native.address(NAME, variant, "attend"), (dims(q)[0], len(slots)), args, data)
