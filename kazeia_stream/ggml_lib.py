"""ctypes declarations for the libggml functions we call directly: GGUF reading, quantization
and the graph API our own engines are built on.

The library is the one llama-cpp-python bundles (libggml, which reaches libggml-base and
libggml-cpu; `clib.bundled`), so the process holds one ggml. Signatures follow `include/gguf.h`,
`ggml.h`, `ggml-alloc.h`, `ggml-backend.h` and `ggml-cpu.h` of llama-cpp-python 0.3.36.
"""

from __future__ import annotations

import ctypes

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .clib import bundled

ggml = bundled("ggml")
_c = ctypes
_ctx = _c.c_void_p
_t = _c.c_void_p  # struct ggml_tensor *
_i64, _f = _c.c_int64, _c.c_float


class GGUFInitParams(ctypes.Structure):
    """struct gguf_init_params, passed by value."""

    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


class GGMLInitParams(ctypes.Structure):
    """struct ggml_init_params, passed by value."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class GGMLCPlan(ctypes.Structure):
    """struct ggml_cplan (ggml-cpu.h), returned by value by ggml_graph_plan."""

    _fields_ = [
        ("work_size", ctypes.c_size_t),
        ("work_data", ctypes.c_void_p),
        ("n_threads", ctypes.c_int),
        ("threadpool", ctypes.c_void_p),
        ("abort_callback", ctypes.c_void_p),
        ("abort_callback_data", ctypes.c_void_p),
        ("use_ref", ctypes.c_bool),
    ]


class GGMLTensor(ctypes.Structure):
    """struct ggml_tensor (ggml.h: GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10,
    GGML_MAX_NAME 64): we read its sizes ne and strides nb."""

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
    "ggml_get_data": ([_c.c_void_p], _c.c_void_p),
    "ggml_nbytes": ([_c.c_void_p], _c.c_size_t),
    # ggml.h, ggml-alloc.h, ggml-backend.h: graphs of our own (engine/ggml_graph.py), computed
    # by ggml-cpu.h's functions
    "ggml_init": ([GGMLInitParams], _ctx),
    "ggml_free": ([_ctx], None),
    "ggml_tensor_overhead": ([], _c.c_size_t),
    "ggml_graph_overhead_custom": ([_c.c_size_t, _c.c_bool], _c.c_size_t),
    "ggml_new_tensor_1d": ([_ctx, _c.c_int, _i64], _t),
    "ggml_new_tensor_2d": ([_ctx, _c.c_int, _i64, _i64], _t),
    "ggml_new_tensor_3d": ([_ctx, _c.c_int, _i64, _i64, _i64], _t),
    "ggml_new_tensor_4d": ([_ctx, _c.c_int, _i64, _i64, _i64, _i64], _t),
    "ggml_view_1d": ([_ctx, _t, _i64, _c.c_size_t], _t),
    "ggml_view_2d": ([_ctx, _t, _i64, _i64, _c.c_size_t, _c.c_size_t], _t),
    "ggml_view_3d": ([_ctx, _t, _i64, _i64, _i64, _c.c_size_t, _c.c_size_t, _c.c_size_t], _t),
    "ggml_view_4d": (
        [_ctx, _t, _i64, _i64, _i64, _i64, _c.c_size_t, _c.c_size_t, _c.c_size_t, _c.c_size_t],
        _t,
    ),
    "ggml_reshape_2d": ([_ctx, _t, _i64, _i64], _t),
    "ggml_reshape_3d": ([_ctx, _t, _i64, _i64, _i64], _t),
    "ggml_mul_mat": ([_ctx, _t, _t], _t),
    "ggml_mul_mat_id": ([_ctx, _t, _t, _t], _t),
    # type, ne0..ne3, args, n_args, fun (ggml_custom_op_t), n_tasks, userdata
    "ggml_custom_4d": (
        [_ctx, _c.c_int, *[_i64] * 4, _c.POINTER(_t), _c.c_int, _c.c_void_p, _c.c_int, _c.c_void_p],
        _t,
    ),
    "ggml_mul": ([_ctx, _t, _t], _t),
    "ggml_add": ([_ctx, _t, _t], _t),
    "ggml_scale": ([_ctx, _t, _f], _t),
    "ggml_rms_norm": ([_ctx, _t, _f], _t),
    "ggml_swiglu_split": ([_ctx, _t, _t], _t),
    "ggml_set_2d_inplace": ([_ctx, _t, _t, _c.c_size_t, _c.c_size_t], _t),
    "ggml_pad": ([_ctx, _t, _c.c_int, _c.c_int, _c.c_int, _c.c_int], _t),
    "ggml_soft_max_ext": ([_ctx, _t, _t, _f, _f], _t),
    # ctx, a, positions, freq factors, n_dims, mode, n_ctx_orig, freq_base, freq_scale,
    # ext_factor, attn_factor, beta_fast, beta_slow
    "ggml_rope_ext": ([_ctx, _t, _t, _t, _c.c_int, _c.c_int, _c.c_int, _f, _f, _f, _f, _f, _f], _t),
    "ggml_set_rows": ([_ctx, _t, _t, _t], _t),
    "ggml_cont": ([_ctx, _t], _t),
    "ggml_permute": ([_ctx, _t, _c.c_int, _c.c_int, _c.c_int, _c.c_int], _t),
    "ggml_set_input": ([_t], None),
    "ggml_set_output": ([_t], None),
    "ggml_new_graph_custom": ([_ctx, _c.c_size_t, _c.c_bool], _c.c_void_p),
    "ggml_build_forward_expand": ([_c.c_void_p, _t], None),
    "ggml_graph_n_nodes": ([_c.c_void_p], _c.c_int),
    "ggml_graph_plan": ([_c.c_void_p, _c.c_int, _c.c_void_p], GGMLCPlan),
    "ggml_graph_compute": ([_c.c_void_p, _c.POINTER(GGMLCPlan)], _c.c_int),
    "ggml_backend_cpu_buffer_type": ([], _c.c_void_p),
    "ggml_backend_cpu_buffer_from_ptr": ([_c.c_void_p, _c.c_size_t], _c.c_void_p),
    "ggml_backend_buffer_free": ([_c.c_void_p], None),
    "ggml_backend_tensor_alloc": ([_c.c_void_p, _t, _c.c_void_p], _c.c_int),
    "ggml_gallocr_new": ([_c.c_void_p], _c.c_void_p),
    "ggml_gallocr_free": ([_c.c_void_p], None),
    "ggml_gallocr_alloc_graph": ([_c.c_void_p, _c.c_void_p], _c.c_bool),
    "ggml_gallocr_get_buffer_size": ([_c.c_void_p, _c.c_int], _c.c_size_t),
    "ggml_cpu_init": ([], None),
    "ggml_cpu_fp16_to_fp32": ([_c.c_void_p, _c.c_void_p, _c.c_int64], None),
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


def widen(half: np.ndarray) -> np.ndarray:
    """A float16 array (C- or Fortran-contiguous) as float32 in the same order, by ggml-cpu's
    conversion: F16C where the CPU has it, 3-6x numpy's cast on Zen 1, which widened a number
    at a time there (numpy 2.4; the same numbers: the conversion is exact)."""
    assert half.dtype == np.float16 and (half.flags.c_contiguous or half.flags.f_contiguous)
    out = np.empty(half.shape, np.float32, order="C" if half.flags.c_contiguous else "F")
    ggml.ggml_cpu_init()  # its tables, where the CPU lacks F16C (once; a no-op after)
    ggml.ggml_cpu_fp16_to_fp32(half.ctypes.data, out.ctypes.data, half.size)
    return out


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
