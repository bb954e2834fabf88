"""ctypes declarations for the few libggml functions we call directly.

The library is the one llama-cpp-python bundles (`llama_cpp._ggml.libggml`), so the process holds
one ggml. Signatures follow `include/gguf.h`, `include/ggml.h` and `include/ggml-backend.h` of
llama-cpp-python 0.3.36.
"""

from __future__ import annotations

import ctypes

from llama_cpp._ggml import libggml as ggml

_c = ctypes
_ctx = _c.c_void_p


class GGUFInitParams(ctypes.Structure):
    """struct gguf_init_params, passed by value."""

    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


class GGMLTensorHead(ctypes.Structure):
    """The leading fields of struct ggml_tensor (ggml.h): its type, buffer and shape."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4)]


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
    "ggml_nbytes": ([_c.c_void_p], _c.c_size_t),
    "ggml_backend_tensor_set": ([_c.c_void_p, _c.c_void_p, _c.c_size_t, _c.c_size_t], None),
}

for _name, (_args, _ret) in _SIGNATURES.items():
    _fn = getattr(ggml, _name)
    _fn.argtypes = _args
    _fn.restype = _ret
