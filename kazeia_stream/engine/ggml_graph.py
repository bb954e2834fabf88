"""Graphs of our own on the bundled libggml: weights in one buffer we own, a graph built once
per shape and replayed, its intermediate tensors in memory allocated once.

libllama builds a graph, schedules it and copies its outputs at every decode; for a model as
small as the code predictor that overhead is a large part of each of its 15 passes per frame.
Here a graph is a fixed list of ggml ops over fixed tensors: a replay is one
`ggml_graph_compute`, inputs written into and outputs read from numpy views of tensor memory.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..ggml_lib import GGMLCPlan, GGMLInitParams, GGMLTensor, ggml

Tensor = int  # the address of a struct ggml_tensor
GGML_TYPE_F32, GGML_TYPE_I32 = 0, 26
GGML_ROPE_TYPE_NEOX = 2
_ALIGN = 64  # each weight's start in the buffer: a cache line (ggml asks for 32 bytes)


def _array(t: Tensor, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    """A numpy view of a tensor's memory (numpy axis order: reversed ggml dims)."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    data = (ctypes.c_uint8 * size).from_address(ggml.ggml_get_data(t))
    return np.frombuffer(memoryview(data), dtype=np.dtype(dtype)).reshape(shape)


def _context(n_tensors: int, data_bytes: int = 0, graph_nodes: int = 0) -> int:
    """A ggml context with room for `n_tensors` tensor headers, `data_bytes` of their data
    (none: the tensors get memory elsewhere) and a graph of `graph_nodes`."""
    size = n_tensors * ggml.ggml_tensor_overhead() + data_bytes
    if graph_nodes:
        size += ggml.ggml_graph_overhead_custom(graph_nodes, False)
    ctx = ggml.ggml_init(GGMLInitParams(size, None, data_bytes == 0))
    if not ctx:
        raise MemoryError("ggml_init failed")
    return ctx


class Weights:
    """Tensors in one buffer the process owns (numpy gives large arrays huge pages, which
    stream faster than a file mapping's 4 KiB pages), each a ggml tensor of its stored type."""

    def __init__(
        self, entries: Sequence[tuple[str, GGMLQuantizationType, tuple[int, ...], np.ndarray]]
    ) -> None:
        """`entries`: (name, type, shape in numpy order, stored data: plain values, or the
        rows' bytes of a quantized type)."""
        offsets, total = [], 0
        for _, _, _, data in entries:
            offsets.append(total)
            total += -(-data.nbytes // _ALIGN) * _ALIGN
        self._memory = np.empty(total + _ALIGN, np.uint8)
        start = self._memory.ctypes.data + (-self._memory.ctypes.data % _ALIGN)
        self._ctx: int | None = _context(len(entries))
        self._buffer: int | None = ggml.ggml_backend_cpu_buffer_from_ptr(start, total)
        self.tensors: dict[str, Tensor] = {}
        for (name, qtype, shape, data), offset in zip(entries, offsets):
            ne = shape[::-1]
            t = getattr(ggml, f"ggml_new_tensor_{len(ne)}d")(self._ctx, int(qtype), *ne)
            if ggml.ggml_nbytes(t) != data.nbytes:
                raise ValueError(f"{name}: {data.nbytes} bytes for {qtype.name} {shape}")
            address = start + offset
            ggml.ggml_backend_tensor_alloc(self._buffer, t, address)
            ctypes.memmove(address, np.ascontiguousarray(data).ctypes.data, data.nbytes)
            self.tensors[name] = t
        self.nbytes = total

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def close(self) -> None:
        if getattr(self, "_buffer", None):
            ggml.ggml_backend_buffer_free(self._buffer)
            self._buffer = None
        if getattr(self, "_ctx", None):
            ggml.ggml_free(self._ctx)
            self._ctx = None

    __del__ = close


class State:
    """Tensors that live between replays (KV caches, constant positions, inputs), in memory of
    their own context; numpy views of them for the caller."""

    def __init__(self, shapes: dict[str, tuple[int, tuple[int, ...]]]) -> None:
        """`shapes`: name -> (ggml type F32 or I32, shape in numpy order)."""
        data = sum(4 * int(np.prod(shape)) + _ALIGN for _, shape in shapes.values())
        self._ctx: int | None = _context(len(shapes), data)
        self.tensors: dict[str, Tensor] = {}
        self.arrays: dict[str, np.ndarray] = {}
        for name, (qtype, shape) in shapes.items():
            ne = shape[::-1]
            t = getattr(ggml, f"ggml_new_tensor_{len(ne)}d")(self._ctx, qtype, *ne)
            self.tensors[name] = t
            self.arrays[name] = _array(t, np.float32 if qtype == GGML_TYPE_F32 else np.int32, shape)
            self.arrays[name][...] = 0

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            ggml.ggml_free(self._ctx)
            self._ctx = None

    __del__ = close


class Graph:
    """One graph: ops added in the order they run (each is expanded into the graph as it is
    made, so ops of several rows on one weight run back to back while it is in cache), its
    intermediate tensors allocated once by ggml's graph allocator, then `compute` replays it."""

    def __init__(self, max_nodes: int) -> None:
        self._ctx: int | None = _context(max_nodes, graph_nodes=max_nodes)
        self.graph = ggml.ggml_new_graph_custom(self._ctx, max_nodes, False)
        self._alloc: int | None = None
        self._plans: dict[int, GGMLCPlan] = {}
        self._work = np.empty(0, np.uint8)

    def _op(self, t: Tensor) -> Tensor:
        ggml.ggml_build_forward_expand(self.graph, t)
        return t

    # the ops (ggml's own; shapes in ggml order, innermost first)
    def mul_mat(self, w: Tensor, x: Tensor) -> Tensor:
        return self._op(ggml.ggml_mul_mat(self._ctx, w, x))

    def mul(self, a: Tensor, b: Tensor) -> Tensor:
        return self._op(ggml.ggml_mul(self._ctx, a, b))

    def add(self, a: Tensor, b: Tensor) -> Tensor:
        return self._op(ggml.ggml_add(self._ctx, a, b))

    def scale(self, a: Tensor, s: float) -> Tensor:
        return self._op(ggml.ggml_scale(self._ctx, a, s))

    def rms_norm(self, a: Tensor, eps: float) -> Tensor:
        return self._op(ggml.ggml_rms_norm(self._ctx, a, eps))

    def swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        return self._op(ggml.ggml_swiglu_split(self._ctx, gate, up))

    def soft_max(self, a: Tensor, scale: float) -> Tensor:
        return self._op(ggml.ggml_soft_max_ext(self._ctx, a, None, scale, 0.0))

    def rope_neox(self, a: Tensor, positions: Tensor, theta: float) -> Tensor:
        """Rotary embedding over all of dim 0 (rotate-half pairs), no scaling."""
        n_dims = GGMLTensor.from_address(a).ne[0]
        return self._op(
            ggml.ggml_rope_ext(
                self._ctx, a, positions, None, n_dims, GGML_ROPE_TYPE_NEOX, 0, theta, 1.0, 0.0, 1.0, 32.0, 1.0
            )
        )

    def cpy(self, a: Tensor, dst: Tensor) -> Tensor:
        return self._op(ggml.ggml_cpy(self._ctx, a, dst))

    def reshape(self, a: Tensor, *ne: int) -> Tensor:
        return self._op(getattr(ggml, f"ggml_reshape_{len(ne)}d")(self._ctx, a, *ne))

    def view(self, a: Tensor, ne: Sequence[int], nb: Sequence[int] = (), offset: int = 0) -> Tensor:
        """A view of `a`: sizes `ne` and byte strides `nb` of dims 1.. (ggml order)."""
        if len(ne) == 1:
            return self._op(ggml.ggml_view_1d(self._ctx, a, ne[0], offset))
        return self._op(getattr(ggml, f"ggml_view_{len(ne)}d")(self._ctx, a, *ne, *nb, offset))

    def matrix(self, a: Tensor, index: int) -> Tensor:
        """Matrix `index` of a 3-D tensor (a view)."""
        ne, strides = GGMLTensor.from_address(a).ne, nb(a)
        return self.view(a, (ne[0], ne[1]), (strides[1],), index * strides[2])

    def output(self, t: Tensor) -> Tensor:
        """Mark `t` an output: its memory is not reused within the graph (read it through
        `f32_view` once the graph is allocated)."""
        ggml.ggml_set_output(t)
        return t

    def allocate(self) -> None:
        """Give the intermediate tensors memory (once: a replay reuses it)."""
        self._alloc = ggml.ggml_gallocr_new(ggml.ggml_backend_cpu_buffer_type())
        if not self._alloc or not ggml.ggml_gallocr_alloc_graph(self._alloc, self.graph):
            raise MemoryError("ggml could not allocate a graph")

    def compute(self, threads: int) -> None:
        """Run the graph on `threads` threads (ggml's OpenMP pool; the GIL is released)."""
        plan: GGMLCPlan | None = self._plans.get(threads)
        if plan is None:
            plan = ggml.ggml_graph_plan(self.graph, threads, None)
            if plan.work_size > self._work.nbytes:
                self._work = np.empty(plan.work_size, np.uint8)
            self._plans[threads] = plan
        plan.work_data = self._work.ctypes.data
        status = ggml.ggml_graph_compute(self.graph, ctypes.byref(plan))
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed ({status})")

    def close(self) -> None:
        if getattr(self, "_alloc", None):
            ggml.ggml_gallocr_free(self._alloc)
            self._alloc = None
        if getattr(self, "_ctx", None):
            ggml.ggml_free(self._ctx)
            self._ctx = None

    __del__ = close


def nb(t: Tensor) -> tuple[int, ...]:
    """A tensor's byte strides (ggml order)."""
    return tuple(GGMLTensor.from_address(t).nb)


def f32_view(t: Tensor, shape: tuple[int, ...]) -> np.ndarray:
    """A float32 numpy view of an allocated tensor (numpy axis order)."""
    return _array(t, np.float32, shape)


def type_nbytes(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of `qtype` and numpy `shape`."""
    block, size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block * size)
