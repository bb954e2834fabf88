"""libllama's C API: the calls we make (a talker file's vocabulary, its tokenizer, the log),
declared on the library llama-cpp-python bundles (`clib.bundled`: loaded without importing
that package, so that the vocabulary, the longest part of a start, 0.8-1 s in libllama on
Zen 1, begins loading first). Declarations follow `llama.h` of llama-cpp-python 0.3.36;
`tests/test_model.py` checks them against the package's own.
"""

from __future__ import annotations

import ctypes

from ..clib import bundled

_c = ctypes
token = _c.c_int32
log_callback = _c.CFUNCTYPE(None, _c.c_int, _c.c_char_p, _c.c_void_p)


class ModelParams(ctypes.Structure):
    """struct llama_model_params, passed by value (the pointers we never set as void pointers)."""

    _fields_ = [
        ("devices", _c.c_void_p),
        ("tensor_buft_overrides", _c.c_void_p),
        ("n_gpu_layers", _c.c_int32),
        ("split_mode", _c.c_int),
        ("load_mode", _c.c_int),
        ("lazy_mode", _c.c_int),
        ("main_gpu", _c.c_int32),
        ("tensor_split", _c.c_void_p),
        ("progress_callback", _c.c_void_p),
        ("progress_callback_user_data", _c.c_void_p),
        ("kv_overrides", _c.c_void_p),
        ("vocab_only", _c.c_bool),
        ("check_tensors", _c.c_bool),
        ("use_extra_bufts", _c.c_bool),
        ("no_host", _c.c_bool),
        ("no_alloc", _c.c_bool),
        ("load_mtp", _c.c_bool),
    ]


lib = bundled("llama")

_SIGNATURES = {
    "llama_log_set": ([log_callback, _c.c_void_p], None),
    "llama_backend_init": ([], None),
    "llama_model_default_params": ([], ModelParams),
    "llama_model_load_from_file": ([_c.c_char_p, ModelParams], _c.c_void_p),
    "llama_model_free": ([_c.c_void_p], None),
    "llama_model_get_vocab": ([_c.c_void_p], _c.c_void_p),
    # vocab, text, its length, tokens, their room, add_special, parse_special
    "llama_tokenize": (
        [_c.c_void_p, _c.c_char_p, _c.c_int32, _c.POINTER(token), _c.c_int32, _c.c_bool, _c.c_bool],
        _c.c_int32,
    ),
    "llama_vocab_get_text": ([_c.c_void_p, token], _c.c_char_p),
}

for _name, (_args, _ret) in _SIGNATURES.items():
    _fn = getattr(lib, _name)
    _fn.argtypes, _fn.restype = _args, _ret
