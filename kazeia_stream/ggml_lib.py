"""ctypes declarations for the few libggml functions we call directly.

The library is the one llama-cpp-python bundles (`llama_cpp._ggml.libggml`), so the process holds
one ggml. Signatures follow `include/gguf.h`, `include/ggml.h` and `include/ggml-backend.h` of
llama-cpp-python 0.3.36.
"""

from __future__ import annotations

import ctypes

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from llama_cpp._ggml import libggml as ggml

_c = ctypes
_ctx = _c.c_void_p


class GGUFInitParams(ctypes.Structure):
    """struct gguf_init_params, passed by value."""

    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


class GGMLTensor(ctypes.Structure):
    """struct ggml_tensor (ggml.h: GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10,
    GGML_MAX_NAME 64). Check a layout-dependent use against ggml_get_data / ggml_get_name."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


_SIGNATURES: dict[str, tuple[list, object]] = {
    "gguf_init_from_file": ([_c.c_char_p, GGUFInitParams], _ctx),
    "gguf_init_from_buffer": ([_c.c_void_p, _c.c_size_t, GGUFInitParams], _ctx),
    "gguf_free": ([_ctx], None),
    "gguf_get_data_offset": ([_ctx], _c.c_size_t),
    "gguf_find_key": ([_ctx, _c.c_char_p], _c.c_int64),
    "gguf_get_kv_type": ([_ctx, _c.c_int64], _c.c_int),
    "gguf_get_arr_type": ([_ctx, _c.c_int64], _c.c_int),
    "gguf_get_val_u8": ([_ctx, _c.c_int64], _c.c_uint8),
    "gguf_get_val_i8": ([_ctx, _c.c_int64], _c.c_int8),
    "gguf_get_val_u16": ([_ctx, _c.c_int64], _c.c_uint16),
    "gguf_get_val_i16": ([_ctx, _c.c_int64], _c.c_int16),
    "gguf_get_val_u32": ([_ctx, _c.c_int64], _c.c_uint32),
    "gguf_get_val_i32": ([_ctx, _c.c_int64], _c.c_int32),
    "gguf_get_val_f32": ([_ctx, _c.c_int64], _c.c_float),
    "gguf_get_val_u64": ([_ctx, _c.c_int64], _c.c_uint64),
    "gguf_get_val_i64": ([_ctx, _c.c_int64], _c.c_int64),
    "gguf_get_val_f64": ([_ctx, _c.c_int64], _c.c_double),
    "gguf_get_val_bool": ([_ctx, _c.c_int64], _c.c_bool),
    "gguf_get_val_str": ([_ctx, _c.c_int64], _c.c_char_p),
    "gguf_get_arr_n": ([_ctx, _c.c_int64], _c.c_size_t),
    "gguf_get_arr_data": ([_ctx, _c.c_int64], _c.c_void_p),
    "gguf_get_arr_str": ([_ctx, _c.c_int64, _c.c_size_t], _c.c_char_p),
    "gguf_get_n_tensors": ([_ctx], _c.c_int64),
    "gguf_find_tensor": ([_ctx, _c.c_char_p], _c.c_int64),
    "gguf_get_tensor_offset": ([_ctx, _c.c_int64], _c.c_size_t),
    "gguf_get_tensor_name": ([_ctx, _c.c_int64], _c.c_char_p),
    "gguf_get_tensor_ne": ([_ctx, _c.c_int64], _c.POINTER(_c.c_int64)),
    "gguf_get_tensor_type": ([_ctx, _c.c_int64], _c.c_int),
    "gguf_get_tensor_size": ([_ctx, _c.c_int64], _c.c_size_t),
    # ggml.h / ggml-backend.h: tensors handed to us by libllama
    "ggml_get_name": ([_c.c_void_p], _c.c_char_p),
    "ggml_get_data": ([_c.c_void_p], _c.c_void_p),
    "ggml_nbytes": ([_c.c_void_p], _c.c_size_t),
    "ggml_backend_tensor_set": ([_c.c_void_p, _c.c_void_p, _c.c_size_t, _c.c_size_t], None),
    # type, src, dst, start, nrows, n_per_row, imatrix
    "ggml_quantize_chunk": (
        [_c.c_int, _c.c_void_p, _c.c_void_p, _c.c_int64, _c.c_int64, _c.c_int64, _c.c_void_p],
        _c.c_size_t,
    ),
}

for _name, (_args, _ret) in _SIGNATURES.items():
    _fn = getattr(ggml, _name)
    _fn.argtypes = _args
    _fn.restype = _ret


def quantize(rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 rows [..., n] in `qtype`, by libggml's own quantizer (as llama.cpp's tools
    quantize): the bytes of each row, [..., n / block * type size]."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    *lead, n = rows.shape
    block, type_size = GGML_QUANT_SIZES[qtype]
    out = np.empty((*lead, n // block * type_size), np.uint8)
    nrows = rows.size // n
    ggml.ggml_quantize_chunk(int(qtype), rows.ctypes.data, out.ctypes.data, 0, nrows, n, None)
    return out
