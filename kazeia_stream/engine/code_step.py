"""The code predictor's steps after its first, in C (`code_step.c`): each step's input rows
from the table, its graph's run and its draws, the GIL released throughout; a frame's steps in
one call, until the cores' sharing changes (`SharedCores.changes`: the decoder takes or gives
back a core, a stream waits to begin), where the caller chooses the threads again and goes on.
Between one call a step, Python took 105-151 us a step, 1.5-1.7 ms a frame (the Xeon with
AMX); the generator alone now takes 38.9-39.7 ms a frame in the code predictor against
40.5-42.1 (docs/measurements.md, "2026-12-06, afternoon"). Where the kernel was not built, or a
table's type is not one it reads, or `KAZEIA_CODE_STEP=0`, the code predictor's Python steps
run instead (the same numbers: tested)."""

from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Callable, Sequence
from functools import cache, partial
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
    """The library (`kz_code_run`, `kz_code_step_row`), where it was built and `ENV` does not
    turn it off (read at the first use); else None."""
    lib: Any = None if os.environ.get(ENV) == "0" else native.library("code_step")
    if lib is not None:
        lib.kz_code_run.argtypes, lib.kz_code_run.restype = [ctypes.c_void_p], ctypes.c_int
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


class _Run(ctypes.Structure):
    """struct kz_code_run."""

    _p = ctypes.c_void_p
    _fields_ = [
        ("steps", _p),
        ("count", ctypes.c_int64),
        ("done", ctypes.c_int64),
        ("uniforms", _p),
        ("out", _p),
        ("changes", _p),
        ("seen", ctypes.c_int64),
    ]


class CodeSteps:
    """One frame's steps for a group of streams: each step writes the rows of their last codes
    from one of the `tables` [tables, rows, width] (stored as `table_type`, one of the kernel's
    `TYPES`), adds them to `sums` [streams, width] (in place), runs its replay and draws the
    streams' next `codes` [streams] (int64, in place) with their samplers. The uniforms of a
    sampling stream's draws are drawn ahead for all the frame's steps (the ones its generator
    would give step by step), so that steps run in C and in Python draw alike (`drawer`)."""

    def __init__(
        self,
        samplers: Sequence[CodeSampler],
        codes: np.ndarray,
        sums: np.ndarray,
        tables: np.ndarray,
        table_type: QType,
    ) -> None:
        self.codes, self.sums, self._tables = codes, sums, tables
        self._table0, self._table_size = native.data(tables), tables.strides[0]
        steps = len(tables)
        self.uniforms = np.zeros((steps, len(samplers)))  # [step, stream]
        self._draws = (_Draw * len(samplers))()
        for s, (draw, sampler) in enumerate(zip(self._draws, samplers)):
            p = sampler.params
            draw.temperature, draw.top_p, draw.top_k = p.temperature, p.top_p, p.top_k
            draw.greedy = not p.do_sample
            if p.do_sample:
                self.uniforms[:, s] = sampler.rng.random(steps)
        self._samplers = samplers
        self.out = np.empty((steps, len(samplers)), np.int64)  # each step's codes, as `run` left them
        self._step = _Step(
            compute=_compute(),
            rows=len(samplers),
            width=sums.shape[1],
            sums=native.data(sums),
            draws=ctypes.addressof(self._draws),
            codes=native.data(codes),
            table_type=int(table_type),
        )

    def drawer(self, stream: int, step: int) -> Callable[[np.ndarray], int]:
        """Stream `stream`'s draw at step `step` (of `tables`) in Python, with its uniform."""
        return partial(self._samplers[stream].with_uniform, uniform=float(self.uniforms[step, stream]))

    def run(self, replays: Sequence[Replay], threads: int, first: int, changes: np.ndarray, seen: int) -> int:
        """Steps first, first + 1, .. (of `tables`), one per replay, in one C call on `threads`,
        until they are done or `changes` [1] no longer reads `seen` (then the caller chooses
        the threads again): the steps run (their codes in `out`)."""
        steps = (_Step * len(replays))()
        for i, (step, replay) in enumerate(zip(steps, replays)):
            ctypes.pointer(step)[0] = self._step
            copies = _copies_of(replay)
            step.graph, step.plan = replay.graph.graph, ctypes.addressof(replay.graph.plan(threads))
            step.copies, step.n_copies = ctypes.addressof(copies), len(copies)
            step.x, step.logits = native.data(replay.x), native.data(replay.logits)
            step.vocab = replay.logits.shape[1]
            step.table = self._table0 + (first + i) * self._table_size
        run = _Run(
            steps=ctypes.addressof(steps),
            count=first + len(replays),
            done=first,
            uniforms=native.data(self.uniforms),
            out=native.data(self.out),
            changes=native.data(changes),
            seen=seen,
        )
        result = kernel().kz_code_run(ctypes.byref(run))
        if result == 1:
            raise RuntimeError(f"ggml_graph_compute failed ({steps[run.done - first].status})")
        if result == 2:
            raise ValueError("nothing to draw: every logit is -inf")
        return int(run.done) - first
