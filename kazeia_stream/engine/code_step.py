"""The code predictor's steps after its first, each in one C call (`code_step.c`): the input
rows from the table, the graph's run and the draws, the GIL released throughout. Where the
kernel was not built, or a table's type is not one it reads, or `KAZEIA_CODE_STEP=0`, the code
predictor's Python steps run instead (the same numbers: tested)."""

from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QType

from ..ggml_lib import ggml
from . import native
from .qwen3 import Replay
from .sampler import CodeSampler

TYPES = (QType.F32, QType.F16, QType.Q8_0)  # the table types the kernel reads
ENV = "KAZEIA_CODE_STEP"  # "0": the Python steps


class _Copy(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_void_p), ("src", ctypes.c_void_p), ("size", ctypes.c_int64)]


class _Draw(ctypes.Structure):
    _fields_ = [
        ("temperature", ctypes.c_double),
        ("top_p", ctypes.c_double),
        ("uniform", ctypes.c_double),
        ("top_k", ctypes.c_int64),
        ("greedy", ctypes.c_int64),
    ]


class _Step(ctypes.Structure):
    """struct kz_code_step."""

    _p = ctypes.c_void_p
    _fields_ = [
        ("compute", _p),
        ("graph", _p),
        ("plan", _p),
        ("copies", _p),
        ("n_copies", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("width", ctypes.c_int64),
        ("vocab", ctypes.c_int64),
        ("x", _p),
        ("sums", _p),
        ("table", _p),
        ("table_type", ctypes.c_int64),
        ("logits", _p),
        ("draws", _p),
        ("codes", _p),
        ("status", ctypes.c_int64),
    ]


@cache
def kernel() -> Any:
    """The library (`kz_code_step`, `kz_code_step_row`), where it was built and `ENV` does not
    turn it off (read at the first use); else None."""
    lib: Any = None if os.environ.get(ENV) == "0" else native.library("code_step")
    if lib is not None:
        lib.kz_code_step.argtypes, lib.kz_code_step.restype = [ctypes.POINTER(_Step)], ctypes.c_int
        row_args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        lib.kz_code_step_row.argtypes, lib.kz_code_step_row.restype = row_args, ctypes.c_int
    return lib


@cache
def _compute() -> int:
    """The address of ggml_graph_compute."""
    return ctypes.cast(ggml.ggml_graph_compute, ctypes.c_void_p).value or 0


# each replay's inputs as the kernel's copies, made once (and gone with the replay)
_copies: weakref.WeakKeyDictionary[Replay, ctypes.Array[_Copy]] = weakref.WeakKeyDictionary()


def _copies_of(replay: Replay) -> ctypes.Array[_Copy]:
    copies = _copies.get(replay)
    if copies is None:
        items = [_Copy(native.data(dst), native.data(src), src.nbytes) for dst, src in replay.inputs]
        copies = _copies[replay] = (_Copy * len(items))(*items)
    return copies


class CodeSteps:
    """One frame's steps for a group of streams: each step writes the rows of their last codes
    from one of the `tables` [tables, rows, width] (stored as `table_type`, one of the kernel's
    `TYPES`), adds them to `sums` [streams, width] (in place), runs the replay and draws the
    streams' next `codes` [streams] (int64, in place) with their samplers."""

    def __init__(
        self,
        samplers: Sequence[CodeSampler],
        codes: np.ndarray,
        sums: np.ndarray,
        tables: np.ndarray,
        table_type: QType,
    ) -> None:
        self._samplers, self.codes, self.sums, self._tables = samplers, codes, sums, tables
        self._table0, self._table_size = native.data(tables), tables.strides[0]
        self._draws = (_Draw * len(samplers))()
        for draw, sampler in zip(self._draws, samplers):
            p = sampler.params
            draw.temperature, draw.top_p, draw.top_k = p.temperature, p.top_p, p.top_k
            draw.greedy = not p.do_sample
        self._step = _Step(
            compute=_compute(),
            rows=len(samplers),
            width=sums.shape[1],
            sums=native.data(sums),
            draws=ctypes.addressof(self._draws),
            codes=native.data(codes),
            table_type=int(table_type),
        )

    def __call__(self, replay: Replay, threads: int, table: int) -> None:
        """One step: the rows from table `table`, the replay on `threads`."""
        s = self._step
        copies = _copies_of(replay)
        s.graph, s.plan = replay.graph.graph, ctypes.addressof(replay.graph.plan(threads))
        s.copies, s.n_copies = ctypes.addressof(copies), len(copies)
        s.x, s.logits, s.vocab = native.data(replay.x), native.data(replay.logits), replay.logits.shape[1]
        s.table = self._table0 + table * self._table_size
        for draw, sampler in zip(self._draws, self._samplers):
            if not draw.greedy:
                draw.uniform = sampler.rng.random()
        result = kernel().kz_code_step(ctypes.byref(s))
        if result == 1:
            raise RuntimeError(f"ggml_graph_compute failed ({s.status})")
        if result == 2:
            raise ValueError("nothing to draw: every logit is -inf")
