"""Read GGUF metadata and tensors with the gguf parser of llama.cpp's own libggml.

Using the C parser that libllama and mtmd use means a file we accept is a file they accept, and
opening a large vocabulary costs milliseconds. Tensor data is memory-mapped with numpy.
"""

from __future__ import annotations

import ctypes
import io
import itertools
import os
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from ..errors import ModelFileError
from ..ggml_lib import GGUFInitParams, ggml

GGUF_MAGIC = b"GGUF"

# enum gguf_type
(
    _UINT8,
    _INT8,
    _UINT16,
    _INT16,
    _UINT32,
    _INT32,
    _FLOAT32,
    _BOOL,
    _STRING,
    _ARRAY,
    _UINT64,
    _INT64,
    _FLOAT64,
) = range(13)
_SCALAR_GETTERS = {
    _UINT8: "gguf_get_val_u8",
    _INT8: "gguf_get_val_i8",
    _UINT16: "gguf_get_val_u16",
    _INT16: "gguf_get_val_i16",
    _UINT32: "gguf_get_val_u32",
    _INT32: "gguf_get_val_i32",
    _FLOAT32: "gguf_get_val_f32",
    _BOOL: "gguf_get_val_bool",
    _UINT64: "gguf_get_val_u64",
    _INT64: "gguf_get_val_i64",
    _FLOAT64: "gguf_get_val_f64",
}
_ARRAY_DTYPES = {
    _UINT8: np.uint8,
    _INT8: np.int8,
    _UINT16: np.uint16,
    _INT16: np.int16,
    _UINT32: np.uint32,
    _INT32: np.int32,
    _FLOAT32: np.float32,
    _BOOL: np.bool_,
    _UINT64: np.uint64,
    _INT64: np.int64,
    _FLOAT64: np.float64,
}
_PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I32: np.int32,
}


def drop_from_page_cache(path: Path) -> None:
    """Write back the file's pages and have the page cache drop them (posix_fadvise
    POSIX_FADV_DONTNEED; it keeps the pages a mapping holds), so that its next reader reads it
    afresh: through a mapping that asks for huge pages, in huge pieces (`ggml_graph.Weights`),
    where a file written, or read in small reads, stays cached in small ones."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages leave
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class GGUFFile:
    """One GGUF file: typed metadata by key, tensors as numpy arrays in numpy axis order."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(f"{self.path}: no such file")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ModelFileError(f"{self.path}: not a GGUF file (bad magic)")
        self._ctx = ggml.gguf_init_from_file(os.fsencode(self.path), GGUFInitParams(True, None))
        if not self._ctx:
            raise ModelFileError(f"{self.path}: the GGUF header is damaged or truncated")
        data_offset = ggml.gguf_get_data_offset(self._ctx)
        for i in range(ggml.gguf_get_n_tensors(self._ctx)):
            end = (
                data_offset
                + ggml.gguf_get_tensor_offset(self._ctx, i)
                + ggml.gguf_get_tensor_size(self._ctx, i)
            )
            if end > size:
                name = ggml.gguf_get_tensor_name(self._ctx, i).decode()
                raise ModelFileError(
                    f"{self.path}: truncated ({size} bytes, tensor {name} ends at byte {end})"
                )
        self._data_offset = data_offset

    def __del__(self) -> None:
        if getattr(self, "_ctx", None):
            ggml.gguf_free(self._ctx)
            self._ctx = None

    def __contains__(self, key: str) -> bool:
        return ggml.gguf_find_key(self._ctx, key.encode()) >= 0

    def get(self, key: str, default: Any = None) -> Any:
        """The value of a metadata key: a Python scalar, str, list of str, or numpy array."""
        kid = ggml.gguf_find_key(self._ctx, key.encode())
        if kid < 0:
            return default
        kind = ggml.gguf_get_kv_type(self._ctx, kid)
        if kind == _STRING:
            return ggml.gguf_get_val_str(self._ctx, kid).decode("utf-8")
        if kind != _ARRAY:
            return getattr(ggml, _SCALAR_GETTERS[kind])(self._ctx, kid)
        n = ggml.gguf_get_arr_n(self._ctx, kid)
        item = ggml.gguf_get_arr_type(self._ctx, kid)
        if item == _STRING:
            return self.strings(key, range(n))
        dtype = np.dtype(_ARRAY_DTYPES[item])
        buf = ctypes.string_at(ggml.gguf_get_arr_data(self._ctx, kid), n * dtype.itemsize)
        return np.frombuffer(buf, dtype=dtype).copy()

    def strings(self, key: str, ids: Iterable[int]) -> list[str]:
        """Items `ids` of a string array (a few of a vocabulary's 150k: all take ~0.1 s)."""
        kid = ggml.gguf_find_key(self._ctx, key.encode())
        if kid < 0 or ggml.gguf_get_kv_type(self._ctx, kid) != _ARRAY:
            raise ModelFileError(f"{self.path}: metadata key {key!r} is missing")
        n, wanted = ggml.gguf_get_arr_n(self._ctx, kid), list(ids)
        if ggml.gguf_get_arr_type(self._ctx, kid) != _STRING or not all(0 <= i < n for i in wanted):
            raise ModelFileError(f"{self.path}: metadata key {key!r} does not hold those strings")
        return [ggml.gguf_get_arr_str(self._ctx, kid, i).decode("utf-8") for i in wanted]

    def require(self, key: str) -> Any:
        """Like `get`, but a missing key is an error naming the file."""
        value = self.get(key)
        if value is None:
            raise ModelFileError(f"{self.path}: metadata key {key!r} is missing")
        return value

    @cached_property
    def tensor_names(self) -> list[str]:
        return [
            ggml.gguf_get_tensor_name(self._ctx, i).decode()
            for i in range(ggml.gguf_get_n_tensors(self._ctx))
        ]

    def has_tensor(self, name: str) -> bool:
        return ggml.gguf_find_tensor(self._ctx, name.encode()) >= 0

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        return GGMLQuantizationType(ggml.gguf_get_tensor_type(self._ctx, self._tensor_id(name)))

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape in numpy order (GGUF stores ne[0] = the innermost, contiguous axis). Like
        ggml_n_dims, leading size-1 axes are dropped: a [1, 96, 7] kernel reads as (96, 7)."""
        tid = self._tensor_id(name)
        ne = ggml.gguf_get_tensor_ne(self._ctx, tid)
        dims = [ne[i] for i in range(4)]
        while len(dims) > 1 and dims[-1] == 1:
            dims.pop()
        return tuple(reversed(dims))

    def span(self, name: str) -> tuple[int, int]:
        """Where the tensor's data lies in the file: (offset, bytes)."""
        tid = self._tensor_id(name)
        offset = self._data_offset + ggml.gguf_get_tensor_offset(self._ctx, tid)
        return offset, ggml.gguf_get_tensor_size(self._ctx, tid)

    def _layout(self, name: str) -> tuple[np.dtype[Any], tuple[int, ...]]:
        """The numpy dtype and shape of the stored data: plain types as they are, quantized
        rows as bytes."""
        qtype, shape = self.tensor_type(name), self.tensor_shape(name)
        if qtype in _PLAIN_DTYPES:
            return np.dtype(_PLAIN_DTYPES[qtype]), shape
        block, type_size = GGML_QUANT_SIZES[qtype]
        return np.dtype(np.uint8), (*shape[:-1], shape[-1] // block * type_size)

    @cached_property
    def mapping(self) -> np.ndarray:
        """The whole file, memory-mapped read-only (bytes); `span` says where a tensor lies."""
        return np.memmap(self.path, dtype=np.uint8, mode="r")

    def raw(self, name: str) -> np.ndarray:
        """The stored data, memory-mapped (a mapping of its own, gone with the array)."""
        dtype, shape = self._layout(name)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self.span(name)[0], shape=shape)

    def view(self, name: str) -> np.ndarray:
        """The stored data as `raw` gives it, but a view of the whole file's one mapping
        (`mapping`): for many tensors of a file, one mapping rather than one each (187 of them
        took 40-50 ms to map on Zen 1)."""
        dtype, shape = self._layout(name)
        offset, size = self.span(name)
        return self.mapping[offset : offset + size].view(dtype).reshape(shape)

    def load(self, name: str) -> np.ndarray:
        """The stored data (as `raw`) read into memory the process owns (`read_into`), on huge
        pages for large arrays (numpy's)."""
        dtype, shape = self._layout(name)
        data = np.empty(shape, dtype)
        self.read_into(name, data.view(np.uint8).reshape(-1))
        return data

    def read_into(self, name: str, out: np.ndarray) -> None:
        """The stored bytes of tensor `name` into `out` (bytes, as many): one read, no page
        faults, nothing left mapped (a mapping's pages would count as the process's memory
        too), and memory of the caller's choosing (huge pages stream faster than a mapping's
        4 KiB ones, which the kernel may drop)."""
        offset, size = self.span(name)
        if len(out) != size:
            raise ModelFileError(f"{self.path}: tensor {name!r} could not be read whole")
        with open(self.path, "rb", buffering=0) as f:
            self._read_at(f, offset, out, name)

    def _read_at(self, f: io.FileIO, offset: int, out: np.ndarray, name: str) -> None:
        """`out`'s bytes from `offset` of tensor `name`'s open file, whole."""
        f.seek(offset)
        if f.readinto(out.data) != len(out):
            raise ModelFileError(f"{self.path}: tensor {name!r} could not be read whole")

    def rows(self, name: str, ids: np.ndarray | list[int], table: int | None = None) -> np.ndarray:
        """Rows of a 2-D tensor (or of table `table` of a 3-D one) as float32, dequantized if
        needed. They are read, each asked of the page cache first (posix_fadvise WILLNEED), so
        that those it does not hold come from the disk together rather than one page fault
        after another: 16 random rows of a 0.6B talker's text embedding took 142-280 ms so
        through a mapping, 1-22 ms read (a Zen 1 VM; a prompt's text rows are read so, on the
        way to its first audio)."""
        dtype, shape = self._layout(name)
        offset, size = self.span(name)
        if table is not None:
            if not 0 <= table < shape[0]:
                raise IndexError(f"table {table} of {name!r} is out of range")
            shape, size = shape[1:], size // shape[0]
            offset += table * size
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and not (ids.min() >= 0 and ids.max() < shape[0]):
            raise IndexError(f"rows of {name!r} out of range: {ids.min()}..{ids.max()} of {shape[0]}")
        step = size // shape[0]
        out = np.empty((len(ids), step), np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            if hasattr(os, "posix_fadvise"):
                for i in np.unique(ids).tolist():
                    os.posix_fadvise(f.fileno(), offset + i * step, step, os.POSIX_FADV_WILLNEED)
            for row, i in zip(out, ids.tolist()):
                self._read_at(f, offset + i * step, row, name)
        return self._float32(name, out.view(dtype).reshape(len(ids), *shape[1:]))

    def tensor(self, name: str) -> np.ndarray:
        """A whole tensor as float32 (mapped, when stored as float32)."""
        return self._float32(name, self.raw(name))

    def weight(self, name: str) -> np.ndarray:
        """A whole tensor as `tensor` gives it, but as float16 where the file stores it so,
        mapped: an engine that widens it gets the same numbers, and one that need not reads
        half the bytes."""
        if self.tensor_type(name) == GGMLQuantizationType.F16:
            return self.raw(name)
        return self.tensor(name)

    def joined(self, names: Sequence[str]) -> np.ndarray:
        """Tensors of equal trailing shape joined on their first axis, as `weight` gives each:
        mapped in place where the file holds them back to back in that order as float32 or
        float16 alike (llama.cpp's converter writes a layer's q, k, v so), else a
        concatenation in memory."""
        spans = [self.span(name) for name in names]
        shapes = [self.tensor_shape(name) for name in names]
        adjacent = all(a + n == b for (a, n), (b, _) in itertools.pairwise(spans))
        types = {self.tensor_type(name) for name in names}
        plain = types in ({GGMLQuantizationType.F32}, {GGMLQuantizationType.F16})
        if not (adjacent and plain and len({shape[1:] for shape in shapes}) == 1):
            return np.concatenate([self.weight(name) for name in names])
        shape = (sum(shape[0] for shape in shapes), *shapes[0][1:])
        dtype = _PLAIN_DTYPES[types.pop()]
        return np.memmap(self.path, dtype=dtype, mode="r", offset=spans[0][0], shape=shape)

    def read(self, name: str) -> np.ndarray:
        """A whole tensor as float32 in memory the process owns (`load`, dequantized if
        needed)."""
        return self._float32(name, self.load(name))

    def _float32(self, name: str, data: np.ndarray) -> np.ndarray:
        """Stored data of tensor `name` (or rows of it) as float32: a view when it is float32."""
        qtype = self.tensor_type(name)
        if qtype in _PLAIN_DTYPES:
            return np.asarray(data, dtype=np.float32)
        return dequantize(np.asarray(data), qtype).astype(np.float32, copy=False)

    def _tensor_id(self, name: str) -> int:
        tid = ggml.gguf_find_tensor(self._ctx, name.encode())
        if tid < 0:
            raise ModelFileError(f"{self.path}: tensor {name!r} is missing")
        return tid
