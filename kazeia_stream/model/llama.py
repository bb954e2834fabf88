"""libllama: loading the talker GGUF, with llama.cpp's log routed to Python logging."""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import llama_cpp

from ..errors import ModelFileError

# llama.cpp's log goes to this logger; the NullHandler keeps it silent unless the application
# configures logging (the CLI shows it with -vv).
log = logging.getLogger("llama.cpp")
log.addHandler(logging.NullHandler())

# enum ggml_log_level: NONE, DEBUG, INFO, WARN, ERROR, CONT (continues the previous line)
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}


@llama_cpp.llama_log_callback
def _log_callback(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    message = text.decode("utf-8", errors="replace").rstrip()
    if message:
        log.log(_LEVELS.get(level, logging.DEBUG), "%s", message)


_initialised = False


def init_backend() -> None:
    """Route llama.cpp's log to Python logging and initialise its backend, once, before the
    first model is made (not at import: the pure modules must not start libllama)."""
    global _initialised
    if not _initialised:
        # The callback object lives at module level: libllama keeps only its address.
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _initialised = True


MADV_DONTNEED = 4  # Linux


def release_pages(path: Path, offset: int, size: int) -> None:
    """Drop this process's resident pages of bytes [offset, offset + size) of `path`, in every
    read-only mapping of it (/proc/self/maps; elsewhere nothing happens). They come back from
    the page cache if touched again. libllama maps its model file populated, whole."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    target = os.path.realpath(path)
    for line in maps:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[5] != target or "w" in fields[1]:
            continue
        start, end = (int(a, 16) for a in fields[0].split("-"))
        first = start + offset - int(fields[2], 16)  # the address of `offset` in this mapping
        lo, hi = max(start, -(-first // page) * page), min(end, (first + size) // page * page)
        if lo < hi:
            libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED)


class LlamaModel:
    """A libllama model (weights memory-mapped) and its vocabulary."""

    def __init__(self, path: Path) -> None:
        init_backend()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        self.path = path
        self.ptr = llama_cpp.llama_model_load_from_file(os.fsencode(path), params)
        if not self.ptr:
            raise ModelFileError(f"{path}: libllama could not load it (run with -v for llama.cpp's reason)")
        self.vocab = llama_cpp.llama_model_get_vocab(self.ptr)

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            llama_cpp.llama_model_free(self.ptr)
            self.ptr = None
