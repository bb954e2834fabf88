"""libllama: the talker file's vocabulary, with llama.cpp's log routed to Python logging."""

from __future__ import annotations

import ctypes
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .. import clib
from ..errors import ModelFileError
from .libllama import lib, log_callback

# llama.cpp's log goes to this logger; the NullHandler keeps it silent unless the application
# configures logging (the CLI shows it with -vv).
log = logging.getLogger("llama.cpp")
log.addHandler(logging.NullHandler())

# enum ggml_log_level: NONE, DEBUG, INFO, WARN, ERROR, CONT (continues the previous line)
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_CONT = 5


@log_callback
def _log_callback(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    message = text.decode("utf-8", errors="replace").rstrip()
    if message:
        log.log(_LEVELS.get(level, logging.DEBUG), "%s", message)


# llama_log.c: libllama's callback, passing on to `_log_callback` only the levels `log` wants
# (see there why); None where it was not built. Module-level, as libllama keeps only addresses.
_filter = clib.load(__file__, "llama_log")
_callback = _log_callback if _filter is None else ctypes.cast(_filter.kz_log, log_callback)
_initialised = False


def init_backend() -> None:
    """Route llama.cpp's log to Python logging and initialise its backend before a model is
    made (not at import: the pure modules must not start libllama). At every call the levels
    passed on become those that `log` shows now, and the callback is ours again: llama-cpp-python
    sets its own when imported (by `convert`'s quantizer, or an application)."""
    global _initialised
    if _filter is not None:
        wanted = [level for level, py_level in _LEVELS.items() if log.isEnabledFor(py_level)]
        _filter.kz_log_set(_log_callback, min(wanted, default=_CONT))
    lib.llama_log_set(_callback, ctypes.c_void_p(0))
    if not _initialised:
        lib.llama_backend_init()
        _initialised = True


class LlamaVocab:
    """libllama's tokenizer of a talker file: the model loaded with its vocabulary only (no
    weights: the talker runs on graphs of our own)."""

    def __init__(self, path: Path) -> None:
        init_backend()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.vocab_only = True
        self.path = path
        self.ptr = lib.llama_model_load_from_file(os.fsencode(path), params)
        if not self.ptr:
            raise ModelFileError(f"{path}: libllama could not load it (run with -v for llama.cpp's reason)")
        self.vocab = lib.llama_model_get_vocab(self.ptr)

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            lib.llama_model_free(self.ptr)
            self.ptr = None


def start_vocab(path: Path) -> Future[LlamaVocab]:
    """libllama's load of a talker file's vocabulary, begun in a thread of its own (it takes
    0.25-0.6 s, in libllama, which lets other threads run)."""
    init_backend()
    pool = ThreadPoolExecutor(1, thread_name_prefix="kazeia-load")
    try:
        return pool.submit(LlamaVocab, path)
    finally:
        pool.shutdown(wait=False)  # the thread ends with the load
