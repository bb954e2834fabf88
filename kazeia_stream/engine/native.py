"""Our C kernels' shared libraries (`_q8_product` from q8_product.c, `_kquant_product` from
kquant_product.c, `_f32_product` from f32_product.c, `_kv_product` from kv_product.c, `_snake`
from snake.c, `_winograd` from winograd.c, `_overlap_add` from overlap_add.c, `_sampler` from
sampler.c, `_code_step` from code_step.c and sampler.c), built as `clib` says: where one was
not built (no C compiler), or its CPU lacks AVX2, the code it replaces runs (ggml's kernels,
numpy)."""

from __future__ import annotations

import ctypes
import os
from functools import cache
from typing import Any

import numpy as np

from .. import clib

# each kernel's, best first: `kz_*_level()` n runs the last n ("amx": the Q8_0 kernel's only)
VARIANTS = ("amx", "avx512", "avx2")


@cache
def library(name: str) -> ctypes.CDLL | None:
    """The shared library `_{name}` beside this module, where it was built."""
    return clib.load(__file__, name)


@cache
def variants(name: str) -> tuple[str, ...]:
    """The variants of library `name`'s kernels that this CPU runs, best first: the last
    `kz_{name}_level()` of `VARIANTS`."""
    lib = library(name)
    return VARIANTS[len(VARIANTS) - getattr(lib, f"kz_{name}_level")() :] if lib is not None else ()


@cache
def function(name: str, variant: str, op: str = "") -> Any:
    """Library `name`'s kernel `kz_{name}_{variant}` (or its operation `kz_{name}_{op}_{variant}`),
    for a variant this CPU runs."""
    lib = library(name)
    assert lib is not None and variant in variants(name), (name, variant)
    return getattr(lib, f"kz_{name}_{op}_{variant}" if op else f"kz_{name}_{variant}")  # a ctypes function


def chosen(name: str, env: str) -> str | None:
    """The variant of library `name` that the engines use: the best this CPU runs, unless the
    environment variable `env` says otherwise ("0": none, a variant's name: that one, where it
    runs); None for ggml's kernels."""
    wanted, runs = os.environ.get(env), variants(name)
    if wanted == "0" or not runs:
        return None
    return wanted if wanted in runs else runs[0]


@cache
def address(name: str, variant: str, op: str = "") -> int:
    """The address of library `name`'s kernel `kz_{name}_{variant}` (or `kz_{name}_{op}_{variant}`):
    a ggml custom operation."""
    return ctypes.cast(function(name, variant, op), ctypes.c_void_p).value or 0


def data(a: np.ndarray) -> int:
    """The address of an array's first element, for a kernel's call: its `data` field read in
    place, 1 us here, where `__array_interface__` builds a dict at every call (5 us; the codec
    decoder makes about 900 such calls a frame)."""
    return ctypes.c_void_p.from_address(id(a) + _DATA_FIELD).value or 0


def _data_field() -> int:
    """Where numpy's array object holds its data pointer (PyArrayObject_fields.data, the field
    after the object's header: 16 bytes in, on 64-bit CPython), found on a probe."""
    probe = np.empty(3)
    at = probe.__array_interface__["data"][0]
    for offset in range(8, 65, 8):
        if ctypes.c_void_p.from_address(id(probe) + offset).value == at:
            return offset
    raise ImportError("numpy's array object has no data pointer where expected")


_DATA_FIELD = _data_field()
