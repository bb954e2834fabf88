"""libllama's C API: the calls we make (a talker file's vocabulary, its tokenizer, the log),
declared on the library llama-cpp-python bundles (`clib.bundled`: loaded without importing
that package, so that the vocabulary, the longest part of a start, 0.8-1 s in libllama on
Zen 1, begins loading first). Declarations follow `llama.h` of llama-cpp-python 0.3.36;
`tests/test_model.py` checks them against the package's own.
"""

from __future__ import annotations

import ctypes

from ..clib import bundled

c = ctypes
token = c.c_int32
log_callback = c.CFUNCTYPE(None, c.c_int, c.c_char_p, c.c_void_p)


class ModelParams(ctypes.Structure):
    """struct llama_model_params, passed by value (the pointers we never set as void pointers)."""

    _fields_ = [
        ("devices", c.c_void_p),
        ("tensor_buft_overrides", c.c_void_p),
        ("n_gpu_layers", c.c_int32),
        ("split_mode", c.c_int),
        ("load_mode", c.c_int),
        ("lazy_mode", c.c_int),
        ("main_gpu", c.c_int32),
        ("tensor_split", c.c_void_p),
        ("progress_callback", c.c_void_p),
        ("progress_callback_user_data", c.c_void_p),
        ("kv_overrides", c.c_void_p),
        ("vocab_only", c.c_bool),
        ("check_tensors", c.c_bool),
        ("use_extra_bufts", c.c_bool),
        ("no_host", c.c_bool),
        ("no_alloc", c.c_bool),
        ("load_mtp", c.c_bool),
    ]


lib = bundled("llama")

_SIGNATURES = {
    "llama_log_set": ([log_callback, c.c_void_p], None),
    "llama_backend_init": ([], None),
    "llama_model_default_params": ([], ModelParams),
    "llama_model_load_from_file": ([c.c_char_p, ModelParams], c.c_void_p),
    "llama_model_free": ([c.c_void_p], None),
    "llama_model_get_vocab": ([c.c_void_p], c.c_void_p),
    # vocab, text, its length, tokens, their room, add_special, parse_special
    "llama_tokenize": (
        [c.c_void_p, c.c_char_p, c.c_int32, c.POINTER(token), c.c_int32, c.c_bool, c.c_bool],
        c.c_int32,
    ),
    "llama_vocab_get_text": ([c.c_void_p, token], c.c_char_p),
}

for _name, (_args, _ret) in _SIGNATURES.items():
    _fn = getattr(lib, _name)
    _fn.argtypes, _fn.restype = _args, _ret
