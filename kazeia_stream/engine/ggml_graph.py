"""Graphs of our own on the bundled libggml: weights on huge pages (in place in the GGUF
file's mapping, or read into memory of our own), state in memory we own, and graphs built once
per shape and replayed.

libllama builds a graph, schedules it and copies its outputs at every decode (for the code
predictor's 15 small passes per frame that overhead was a large part of the work), and it
multiplies a batch's rows with ggml's several-column kernel, which reads weights from memory
several times slower than the one-column one (see `columns_agree`). Here a graph is a fixed
list of ggml ops over fixed tensors: a replay is one `ggml_graph_compute` (GIL released), its
inputs written into and its outputs read from numpy views of tensor memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import re
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from itertools import accumulate

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from ..ggml_lib import GGMLCPlan, GGMLInitParams, GGMLTensor, ggml
from ..model.gguf_file import GGUFFile, drop_from_page_cache
from . import native

Tensor = int  # the address of a struct ggml_tensor
GGML_ROPE_TYPE_NEOX = 2
_ALIGN = 64  # where each tensor of our own memory starts (ggml asks for 32 bytes)
MADV_POPULATE_READ = 22  # Linux 5.14
MADV_POPULATE_WRITE = 23  # Linux 5.14
# weights stay in place in a file's mapping where at least this share of them is on huge pages
IN_PLACE_HUGE_SHARE = 0.9
_NUMPY = {QType.F32: np.float32, QType.F16: np.float16, QType.I32: np.int32, QType.I64: np.int64}


def nbytes(qtype: QType, shape: Sequence[int]) -> int:
    """Bytes of a tensor of `qtype` and numpy `shape`."""
    block, size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block * size)


def dims(t: Tensor) -> tuple[int, ...]:
    """A tensor's sizes ne (ggml order)."""
    return tuple(GGMLTensor.from_address(t).ne)


def type_of(t: Tensor) -> QType:
    """A tensor's type."""
    return QType(GGMLTensor.from_address(t).type)


def strides(t: Tensor) -> tuple[int, ...]:
    """A tensor's byte strides nb (ggml order)."""
    return tuple(GGMLTensor.from_address(t).nb)


def view_of(t: Tensor, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    """A numpy view of an allocated tensor's memory (numpy axis order: reversed ggml dims)."""
    dtype = np.dtype(_NUMPY[qtype])
    data = (ctypes.c_uint8 * (int(np.prod(shape)) * dtype.itemsize)).from_address(ggml.ggml_get_data(t))
    return np.frombuffer(memoryview(data), dtype=dtype).reshape(shape)


def _context(n_tensors: int, graph_nodes: int = 0) -> int:
    """A ggml context for `n_tensors` tensor headers (their data lives elsewhere) and a graph."""
    size = n_tensors * ggml.ggml_tensor_overhead()
    if graph_nodes:
        size += ggml.ggml_graph_overhead_custom(graph_nodes, False)
    ctx = ggml.ggml_init(GGMLInitParams(size, None, True))
    if not ctx:
        raise MemoryError("ggml_init failed")
    return ctx


def _new(ctx: int, qtype: QType, shape: Sequence[int]) -> Tensor:
    ne = tuple(shape)[::-1]
    return getattr(ggml, f"ggml_new_tensor_{len(ne)}d")(ctx, int(qtype), *ne)


class _Tensors:
    """Tensor headers in a context of their own, placed in one ggml buffer over memory at
    `base` (which the owner keeps alive)."""

    def __init__(self, n: int, base: int, size: int) -> None:
        self._ctx: int | None = _context(n)
        self._buffer: int | None = ggml.ggml_backend_cpu_buffer_from_ptr(base, size)
        self.tensors: dict[str, Tensor] = {}

    def place(self, name: str, qtype: QType, shape: Sequence[int], address: int) -> Tensor:
        t = _new(self._ctx, qtype, shape)  # type: ignore[arg-type]
        ggml.ggml_backend_tensor_alloc(self._buffer, t, address)
        self.tensors[name] = t
        return t

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


class ArrayTensor(_Tensors):
    """A ggml tensor over a numpy array in C order, in place (the array is kept alive with it):
    a float32 array, or the bytes of a tensor of type `qtype` and numpy `shape`."""

    def __init__(self, array: np.ndarray, qtype: QType = QType.F32, shape: Sequence[int] = ()) -> None:
        shape = shape or array.shape
        if not array.flags.c_contiguous or array.nbytes != nbytes(qtype, shape):
            raise ValueError(f"an array in C order holding {qtype.name} {tuple(shape)} is needed")
        if qtype == QType.F32 and array.dtype != np.float32:
            raise ValueError("a float32 array is needed")
        self.array = array  # a temporary's memory would be freed under the tensor
        start = native.data(array)
        base = start - start % _ALIGN  # a buffer must start aligned; the tensor need not
        super().__init__(1, base, start - base + array.nbytes)
        self.tensor = self.place("array", qtype, shape, start)


def _zeroed(size: int, page: int) -> tuple[np.ndarray, mmap.mmap | None, int]:
    """`size` zero bytes of our own that become resident only where written, in pieces of
    `page` bytes: in a private anonymous mapping from a multiple of `page` on (the kernel maps
    its pages on first write; where `page` is larger than the system's, on transparent huge
    pages, which the mapping asks for); with the mapping and where in it they start. Where mmap
    has no such flags (Windows), numpy's zeroed memory, and no mapping."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        raw = np.zeros(size + _ALIGN, np.uint8)
        start = -native.data(raw) % _ALIGN
        return raw[start : start + size], None, 0
    mapping = mmap.mmap(-1, size + page - mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(mapping, np.uint8)
    start = -native.data(whole) % page
    if page > mmap.PAGESIZE:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, size)
    return whole[start : start + size], mapping, start


class Memory(_Tensors):
    """Tensors in zeroed memory of our own, resident only where written, in pieces of `page`
    bytes (`_zeroed`): on transparent huge pages where the kernel gives them (`huge_pages`) and
    each tensor fills one at least (a talker's KV cache, a layer's K or V for 2048 positions),
    else in 4 KiB pages. A step reads its slot's cache over every position so far, and through
    4 KiB pages it waited on the page walks: on the Xeon with AMX (random 0.6B, Q8_0) a talker
    step at position 256 on one thread took 69-73 ms, 47-49 on huge pages, and a live utterance
    of 600 frames took 1.47x its floor against 1.35x (docs/measurements.md, "2026-12-06, last
    hours"). A whole huge page is resident from its first write: a slot holds 112 MB of the 0.6B's
    cache from its first utterance on, against 17-28 MB for a short one in 4 KiB pages. A code
    predictor's cache of a few positions gains nothing, and its steps measured slower on one."""

    def __init__(self, specs: Mapping[str, tuple[QType, tuple[int, ...]]]) -> None:
        sizes = [-(-nbytes(qtype, shape) // _ALIGN) * _ALIGN for qtype, shape in specs.values()]
        total = max(1, sum(sizes))
        huge = _huge_page_size()
        self.page = huge if huge_pages() and min(sizes, default=0) >= huge else mmap.PAGESIZE
        self._bytes, self._mapping, self._start = _zeroed(total, self.page)
        super().__init__(len(specs), native.data(self._bytes), total)
        offset = 0
        for (name, (qtype, shape)), size in zip(specs.items(), sizes):
            self.place(name, qtype, shape, native.data(self._bytes) + offset)
            offset += size

    def populate(self, name: str, start: int, end: int) -> None:
        """Make resident now the pieces of `page` bytes that bytes [start, end) of tensor `name`
        touch, their contents as they are (madvise MADV_POPULATE_WRITE, Linux 5.14): the faults
        a first write there would take, taken ahead. Nothing where the kernel does not take it."""
        if self._mapping is None:
            return
        at, page = ggml.ggml_get_data(self[name]) - native.data(self._bytes), self.page
        first, last = (at + start) // page * page, -(-(at + end) // page) * page
        with contextlib.suppress(OSError):  # an older kernel: the first write faults them in
            self._mapping.madvise(MADV_POPULATE_WRITE, self._start + first, last - first)

    def release(self, name: str, start: int, end: int) -> None:
        """Give the kernel back the pieces of `page` bytes that lie wholly within bytes [start,
        end) of tensor `name`: they read as zeros again, and are resident again only once
        written (where the memory is a mapping of our own; else nothing changes)."""
        if self._mapping is None:
            return
        at, page = ggml.ggml_get_data(self[name]) - native.data(self._bytes), self.page
        first, last = -(-(at + start) // page) * page, (at + end) // page * page
        if first < last:
            self._mapping.madvise(mmap.MADV_DONTNEED, self._start + first, last - first)


class Weights(_Tensors):
    """A model's weights as ggml tensors of their stored types, on transparent huge pages
    where the kernel gives them (`huge_pages`): in place in the GGUF file's read-only mapping
    where the page cache holds them in huge pieces (`huge_share`), else read into memory of
    our own; without huge pages, in place. The ones converted at load are in memory
    of our own (`Memory`).

    The engines read every weight once a step, and a read through 4 KiB pages is slower: the
    code predictor's passes alone took 50 ms a frame on two threads from a mapping of 4 KiB
    pages, 40 from huge pages (Zen 4; docs/measurements.md). In place costs no copy, no fresh
    memory (on a virtual machine fresh huge pages can be slow to fault in: 0.5-0.8 s for a
    0.6B talker on Zen 1), and processes on the same file share it. Copied, where some were on
    huge pages, the whole file leaves the page cache (beside pages cached in small pieces the
    kernel reads on in small ones: a talker whose text embedding was cached so got 110 of its
    450 MB of weights on huge pages, 450 once the file was dropped); where none were, the file
    system may not give them, and a drop would have every load read the file again."""

    def __init__(
        self,
        f: GGUFFile,
        mapped: Mapping[str, str],
        converted: Mapping[str, tuple[QType, np.ndarray]] | None = None,
    ) -> None:
        """`mapped`: our name -> the file's tensor; `converted`: our name -> (type, data as
        that type stores it, shaped as the tensor in numpy order, quantized rows as bytes)."""
        self._file = f.mapping
        self.spans = [f.span(src) for src in mapped.values()]  # (offset, size) in the file
        if huge_pages() and (share := huge_share(self._file, self.spans)) < IN_PLACE_HUGE_SHARE:
            _madvise(native.data(self._file), len(self._file), mmap.MADV_DONTNEED)  # not held twice
            starts = list(accumulate((-(-size // _ALIGN) * _ALIGN for _, size in self.spans), initial=0))
            self._bytes = _on_huge_pages(max(1, starts.pop()))
            for src, (_, size), at in zip(mapped.values(), self.spans, starts):
                f.read_into(src, self._bytes[at : at + size])
            if share > 0:  # the file system gives huge pages: the next load reads them so
                drop_from_page_cache(f.path)
        else:  # in place, its pages mapped now rather than at the first step (`huge_share` did)
            if not huge_pages():
                for offset, size in self.spans:
                    prefault(self._file[offset : offset + size])
            self._bytes, starts = self._file, [offset for offset, _ in self.spans]
        base = native.data(self._bytes)
        super().__init__(len(mapped), base, len(self._bytes))
        for (name, src), at in zip(mapped.items(), starts):
            self.place(name, f.tensor_type(src), f.tensor_shape(src), base + at)
        converted = converted or {}
        shapes = {name: (qtype, _logical(qtype, data.shape)) for name, (qtype, data) in converted.items()}
        self._own = Memory(shapes)
        for name, (_, data) in converted.items():
            t, source = self._own[name], np.ascontiguousarray(data)  # held through the copy
            ctypes.memmove(ggml.ggml_get_data(t), native.data(source), data.nbytes)
            self.tensors[name] = t
        self.nbytes = sum(size for _, size in self.spans) + sum(d.nbytes for _, d in converted.values())

    @property
    def copied(self) -> bool:
        """Whether the weights were read into memory of our own (else: in the file's mapping)."""
        return self._bytes is not self._file

    def close(self) -> None:
        super().close()
        if hasattr(self, "_own"):
            self._own.close()


@cache
def huge_pages() -> bool:
    """Whether this kernel backs memory that asks for them (madvise MADV_HUGEPAGE) with
    transparent huge pages: Linux with them "always" or on "madvise"."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _on_huge_pages(size: int) -> np.ndarray:
    """`size` bytes of our own on transparent huge pages (`huge_pages`), resident once written."""
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(memory, np.uint8)


def huge_share(mapping: np.ndarray, spans: Sequence[tuple[int, int]]) -> float:
    """The share of the bytes at `spans` of a file's whole mapping, resident now, that lie on
    huge pages once mapped (`map_huge`; 0 where they could not all be mapped: the file was cut
    short)."""
    if not map_huge(mapping, spans):
        return 0.0
    return _huge_bytes(native.data(mapping)) / max(1, sum(n for _, n in spans))


def map_huge(mapping: np.ndarray, spans: Sequence[tuple[int, int]]) -> bool:
    """Map the bytes at `spans` of a file's whole mapping now, on huge pages where the page
    cache holds the file in huge pieces: where it did not hold it yet, the kernel reads it so
    for a mapping that asks (madvise MADV_HUGEPAGE; Linux 6.18 on ext4 does), from the first
    huge page a read faults in on (so each span is read from its first whole huge page on: one
    that holds pages read before, the header's, had the kernel read all the rest in small
    pieces); where it holds it in small pieces (a file just written, or read in small reads),
    they are not. Whether they could all be mapped (not where the file was cut short)."""
    huge = _huge_page_size()
    _madvise(native.data(mapping), len(mapping), mmap.MADV_HUGEPAGE)
    for offset, n in spans:  # from its first huge page on, then its head; never to SIGBUS
        cut = min(offset + n, -(-offset // huge) * huge)
        if not (_populate(mapping[cut : offset + n]) and _populate(mapping[offset:cut])):
            return False
    return True


@cache
def _huge_page_size() -> int:
    """Bytes of a transparent huge page (2 MiB on x86-64)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


_AREA = re.compile(r"([0-9a-f]+)-([0-9a-f]+) ")


def _huge_bytes(address: int) -> int:
    """Bytes of the file's mapping around `address` that are mapped on huge pages (Linux'
    /proc/self/smaps: FilePmdMapped); 0 where that cannot be read."""
    try:
        with open("/proc/self/smaps") as f:
            smaps = f.read()
    except OSError:
        return 0
    inside = False
    for line in smaps.splitlines():
        if area := _AREA.match(line):
            inside = int(area[1], 16) <= address < int(area[2], 16)
        elif inside and line.startswith("FilePmdMapped:"):
            return int(line.split()[1]) * 1024
    return 0


@cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except (OSError, TypeError):  # no C library by that name (Windows)
        return None


def prefault(data: np.ndarray) -> None:
    """Map the pages of contiguous data in a file's mapping now (from the page cache, reading
    the file if it is not there), so that its first use does not take page faults over all of
    them (the kernel maps 16 pages a fault there). Memory already resident costs a walk of its
    page table."""
    if not _populate(data):
        int(data.reshape(-1).view(np.uint8)[:: mmap.PAGESIZE].sum())  # touch a byte per page


def _populate(data: np.ndarray) -> bool:
    """madvise(MADV_POPULATE_READ) (Linux 5.14) over the pages of contiguous data: whether the
    kernel mapped them all (not where the file no longer holds them)."""
    start = native.data(data) // mmap.PAGESIZE * mmap.PAGESIZE
    return _madvise(start, native.data(data) + data.nbytes - start, MADV_POPULATE_READ)


def _madvise(address: int, size: int, advice: int) -> bool:
    """madvise(2) on pages of ours (MADV_POPULATE_READ: Linux 5.14): whether the kernel took it."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(size), advice) == 0)


def _logical(qtype: QType, stored: tuple[int, ...]) -> tuple[int, ...]:
    """The element shape of data stored as `qtype` (quantized rows are bytes)."""
    if qtype in _NUMPY:
        return stored
    block, size = GGML_QUANT_SIZES[qtype]
    return (*stored[:-1], stored[-1] // size * block)


class Allocator:
    """One compute buffer for the graphs of an engine, which never run at once (each is
    written, run and read in turn): ggml's graph allocator places each graph's inputs and
    intermediate tensors in it, once. A graph larger than all before grows the buffer, which
    moves it, and the graphs placed earlier are then stale (`Graph.placed`): rebuild them."""

    def __init__(self) -> None:
        self._alloc: int | None = ggml.ggml_gallocr_new(ggml.ggml_backend_cpu_buffer_type())
        self.size = 0
        self.generation = 0  # how many times the buffer moved

    def place(self, graph: ctypes.c_void_p | int) -> None:
        if not ggml.ggml_gallocr_alloc_graph(self._alloc, graph):
            raise MemoryError("ggml could not allocate a graph")
        size = ggml.ggml_gallocr_get_buffer_size(self._alloc, 0)
        if size > self.size:  # a new buffer (ggml's CPU buffers are one chunk: it grew)
            self.size = size
            self.generation += 1

    def close(self) -> None:
        if getattr(self, "_alloc", None):
            ggml.ggml_gallocr_free(self._alloc)
            self._alloc = None

    __del__ = close


class _Claims(ctypes.Structure):
    """How an operation's threads take its weight rows (`struct claims`, engine/ggml_op.h:
    MAX_SHARES shares), and the epsilon of the RMS norm it applies to x first, if it does."""

    _fields_ = [("done", ctypes.c_int), ("shares", ctypes.c_uint64 * 64), ("eps", ctypes.c_float)]


class Graph:
    """One graph: ops added in the order they run (each is expanded into the graph as it is
    made: a read of the KV cache through a view comes after the same layer's `set_rows`, which
    no dependency would order, and products with one weight run back to back while it is in
    cache), its inputs and intermediate tensors placed once in its engine's `Allocator`, then
    `compute` replays it."""

    def __init__(self, max_nodes: int) -> None:
        self._ctx: int | None = _context(max_nodes, graph_nodes=max_nodes)
        self.graph = ggml.ggml_new_graph_custom(self._ctx, max_nodes, False)
        self._allocator: Allocator | None = None
        self._generation = -1
        self._plans: dict[int, GGMLCPlan] = {}
        self._work = np.empty(0, np.uint8)
        self._userdata: list[ctypes.Structure] = []  # the custom operations' (`custom`)

    def _op(self, t: Tensor) -> Tensor:
        ggml.ggml_build_forward_expand(self.graph, t)
        return t

    def input(self, qtype: QType, shape: Sequence[int]) -> Tensor:
        """A tensor the caller writes before each replay (`view_of`, once allocated)."""
        t = _new(self._ctx, qtype, shape)  # type: ignore[arg-type]
        ggml.ggml_set_input(t)
        return t

    def output(self, t: Tensor) -> Tensor:
        """Mark `t` an output: its memory is not reused within the graph (`view_of` reads it)."""
        ggml.ggml_set_output(t)
        return t

    # the ops (ggml's own; shapes in ggml order, innermost first)
    def mul_mat(self, w: Tensor, x: Tensor) -> Tensor:
        return self._op(ggml.ggml_mul_mat(self._ctx, w, x))

    def mul_mat_id(self, stacked: Tensor, x: Tensor, ids: Tensor) -> Tensor:
        """Each column of x [K, 1, n] by the matrix of the 3-D `stacked` that `ids` (I32 [1, n])
        names: [M, 1, n]."""
        return self._op(ggml.ggml_mul_mat_id(self._ctx, stacked, x, ids))

    def custom(
        self,
        fn: int,
        ne: Sequence[int],
        args: Sequence[Tensor | None],
        userdata: ctypes.Structure | None = None,
    ) -> Tensor:
        """A float32 tensor of sizes `ne` that the C function at `fn` (a ggml_custom_op_t)
        computes from `args` (its src; None: no tensor there), on every thread of the call;
        `userdata`, a ctypes object the graph keeps while it lives, is passed to it by
        reference."""
        sizes = (*ne, 1, 1, 1)[:4]
        srcs = (ctypes.c_void_p * len(args))(*args)
        data = None
        if userdata is not None:
            self._userdata.append(userdata)
            data = ctypes.cast(ctypes.byref(userdata), ctypes.c_void_p)
        return self._op(ggml.ggml_custom_4d(self._ctx, QType.F32, *sizes, srcs, len(args), fn, -1, data))

    def product(
        self,
        fn: int,
        w: Tensor,
        x: Tensor,
        ids: Tensor | None = None,
        norm: tuple[Tensor, float] | None = None,
        residual: Tensor | None = None,
        more: Sequence[Tensor] = (),
    ) -> Tensor:
        """w @ x [out, n] for the float32 columns of x [in, n] (each contiguous), by the C
        function at `fn`: a ggml custom operation of ours whose threads claim chunks of w's
        rows (`struct claims`, engine/ggml_op.h); for a stack of matrices w, `ids` (int32, n in
        a row) names the one each column takes. `norm` (weight [in], epsilon): each column
        RMS-normed and times the weight first; `residual` [out, n]: added to the product (as
        ggml's rms_norm, mul and add compute them, in the same operation). `more`: matrices
        of w's type and width that x multiplies in the same operation (no stack, no
        residual), each product then a block [its out, n] after w's (`fused`)."""
        assert type_of(x) == QType.F32 and dims(x)[2:] == (1, 1)
        assert not more or (ids is None and residual is None), "a fused operation takes no stack nor residual"
        if strides(x)[0] != 4:
            x = self.cont(x)
        claims = _Claims()
        if norm is not None:
            claims.eps = norm[1]
        args = [w, x, ids, None if norm is None else norm[0], residual, *more]
        while args[-1] is None:
            args.pop()
        rows = sum(dims(m)[1] for m in (w, *more))
        return self.custom(fn, (rows, dims(x)[1]), args, claims)

    def fused(self, y: Tensor, ws: Sequence[Tensor]) -> list[Tensor]:
        """The products [out_i, n] of a `product` of ws[0] with `more` = ws[1:], as views of
        its blocks."""
        n, views, offset = dims(y)[1], [], 0
        for w in ws:
            out = dims(w)[1]
            views.append(self.view(y, (out, n), (4 * out,), offset))
            offset += 4 * out * n
        return views

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

    def soft_max(self, a: Tensor, mask: Tensor, scale: float) -> Tensor:
        return self._op(ggml.ggml_soft_max_ext(self._ctx, a, mask, scale, 0.0))

    def rope_neox(self, a: Tensor, positions: Tensor, theta: float) -> Tensor:
        """Rotary embedding over all of dim 0 (rotate-half pairs), no scaling."""
        n_dims = dims(a)[0]
        return self._op(
            ggml.ggml_rope_ext(
                self._ctx, a, positions, None, n_dims, GGML_ROPE_TYPE_NEOX, 0, theta, 1.0, 0.0, 1.0, 32.0, 1.0
            )
        )

    def set_rows(self, dst: Tensor, rows: Tensor, index: Tensor) -> Tensor:
        """Rows of `rows` written into `dst` at the rows `index` (I64) names."""
        return self._op(ggml.ggml_set_rows(self._ctx, dst, rows, index))

    def join(self, pieces: Sequence[Tensor]) -> Tensor:
        """Contiguous F32 pieces [M, n_i] (ggml order) as one [M, sum of n_i]: the first padded
        with columns, the others copied into them. (A tensor made for the purpose would be a
        leaf, which ggml's allocator keeps for the whole graph; the padded one is freed after its
        last use.)"""
        if len(pieces) == 1:
            return pieces[0]
        first, total = dims(pieces[0])[1], sum(dims(p)[1] for p in pieces)
        out = self._op(ggml.ggml_pad(self._ctx, pieces[0], 0, total - first, 0, 0))
        row, start = strides(out)[1], first
        for p in pieces[1:]:
            out = self._op(ggml.ggml_set_2d_inplace(self._ctx, out, p, row, start * row))
            start += dims(p)[1]
        return out

    def cont(self, a: Tensor) -> Tensor:
        return self._op(ggml.ggml_cont(self._ctx, a))

    def permute(self, a: Tensor, *axes: int) -> Tensor:
        return self._op(ggml.ggml_permute(self._ctx, a, *axes))

    def reshape(self, a: Tensor, *ne: int) -> Tensor:
        return self._op(getattr(ggml, f"ggml_reshape_{len(ne)}d")(self._ctx, a, *ne))

    def view(self, a: Tensor, ne: Sequence[int], nb: Sequence[int] = (), offset: int = 0) -> Tensor:
        """A view of `a`: sizes `ne` and byte strides `nb` of dims 1.. (ggml order)."""
        if len(ne) == 1:
            return self._op(ggml.ggml_view_1d(self._ctx, a, ne[0], offset))
        return self._op(getattr(ggml, f"ggml_view_{len(ne)}d")(self._ctx, a, *ne, *nb, offset))

    def allocate(self, allocator: Allocator) -> None:
        """Give the inputs and intermediate tensors memory in `allocator`'s buffer (once: a
        replay reuses it, while `placed`)."""
        allocator.place(self.graph)
        self._allocator, self._generation = allocator, allocator.generation

    @property
    def placed(self) -> bool:
        """Whether the tensors' memory is still where `allocate` put it."""
        return self._allocator is not None and self._allocator.generation == self._generation

    def plan(self, threads: int) -> GGMLCPlan:
        """The plan of a run on `threads` threads (ggml's OpenMP pool), made at its first use,
        with the graph's work memory."""
        if not self.placed:
            raise RuntimeError("the graph's memory has moved: build it again")
        plan = self._plans.get(threads)
        if plan is None:
            plan = ggml.ggml_graph_plan(self.graph, threads, None)
            if plan.work_size > self._work.nbytes:
                self._work = np.empty(plan.work_size, np.uint8)
            self._plans[threads] = plan
        plan.work_data = native.data(self._work)
        return plan

    def compute(self, threads: int) -> None:
        """Run the graph on `threads` threads (the GIL is released)."""
        status = ggml.ggml_graph_compute(self.graph, ctypes.byref(self.plan(threads)))
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed ({status})")

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            ggml.ggml_free(self._ctx)
            self._ctx = None

    __del__ = close


# The probe in `columns_agree`: the column counts it multiplies together (the several-column
# kernel's tiles and their remainders), each compared with the columns multiplied alone
_PROBE_COLUMNS = (2, 3, 5, 8)
_agree: dict[tuple[QType, tuple[int, ...]], bool] = {}


def columns_agree(w: Tensor) -> bool:
    """Whether ggml's product of weight `w` (a matrix, or a stack of them: the first) by
    several columns gives each column the numbers of its own one-column product: then the rows
    of several sequences can share a product and each sequence's numbers are still the same
    beside others as alone. Checked once per type and shape on this machine's kernels, with a
    random input: true of Q8_0 here, while at F32 and F16 the several-column kernel rounds
    otherwise."""
    key = (type_of(w), dims(w))
    if key not in _agree:
        n = max(_PROBE_COLUMNS)
        x = np.random.default_rng(0).standard_normal((n, dims(w)[0]), dtype=np.float32)
        allocator = Allocator()
        try:
            alone = np.concatenate([products(w, x[i : i + 1], allocator) for i in range(n)])
            _agree[key] = all(
                np.array_equal(products(w, x[:count], allocator), alone[:count]) for count in _PROBE_COLUMNS
            )
        finally:
            allocator.close()
    return _agree[key]


def products(
    w: Tensor,
    x: np.ndarray,
    allocator: Allocator,
    threads: int = 1,
    op: Callable[[Graph, Tensor, Tensor], Tensor] | None = None,
) -> np.ndarray:
    """w (a stack's first matrix) times the rows of x [n, in], on `threads` threads, by ggml's
    product or `op(graph, w, columns)` (a kernel of our own): [n, out]."""
    n, k = x.shape
    g = Graph(8)
    try:
        columns = g.input(QType.F32, (n, k))
        if dims(w)[2] > 1:
            index = g.input(QType.I32, (n, 1))
            y = g.output(g.mul_mat_id(w, g.reshape(columns, k, 1, n), index))
        else:
            index, y = None, g.output((op or Graph.mul_mat)(g, w, columns))
        g.allocate(allocator)
        view_of(columns, QType.F32, (n, k))[...] = x
        if index is not None:
            view_of(index, QType.I32, (n,))[...] = 0
        g.compute(threads)
        return view_of(y, QType.F32, (n, dims(w)[1])).copy()
    finally:
        g.close()
