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

A plain shared library that setuptools builds at install with the package (optional: without
a C compiler, or on a CPU without AVX2, or with `KAZEIA_KV_KERNEL=0`, the products run on
ggml's `mul_mat`).
"""

from __future__ import annotations

from functools import cache

from gguf import GGMLQuantizationType as QType

from . import native
from .ggml_graph import Graph, Tensor, dims, strides, type_of

ENV = "KAZEIA_KV_KERNEL"  # "0": ggml's mul_mat
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
