"""Shared libraries: our C code's, and the llama.cpp ones llama-cpp-python bundles.

setuptools builds ours at install as optional extensions (pyproject.toml): plain shared
libraries that ctypes loads; where one was not built (no C compiler), the code it stands in for
runs."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path


def load(module_file: str, name: str) -> ctypes.CDLL | None:
    """The shared library `_{name}` in the folder of the module `module_file`, where it was built."""
    for suffix in EXTENSION_SUFFIXES:
        path = Path(module_file).with_name(f"_{name}{suffix}")
        if path.exists():
            return ctypes.CDLL(str(path))
    return None


def bundled(name: str) -> ctypes.CDLL:
    """llama-cpp-python's library `name` ("llama", "ggml"), from the file its import loads (its
    `lib` folder, or $LLAMA_CPP_LIB_PATH), without importing the package: that import (numpy,
    jinja2, diskcache, its high-level API) took 0.15-0.45 s on Zen 1, ahead of the vocabulary's
    load, the longest part of a start; and it sets llama.cpp's log callback to its own. Where
    its file names are not these (Windows), its own loader finds the file. A handle of our own
    to the one library: our declarations leave the package's, for an application using it
    too, as they were."""
    spec = importlib.util.find_spec("llama_cpp")
    folders = (spec and spec.submodule_search_locations) or []
    base = Path(os.environ.get("LLAMA_CPP_LIB_PATH") or (Path(folders[0]) / "lib" if folders else "."))
    so = [f"lib{name}.so"]
    names = {"linux": so, "freebsd": so, "darwin": [*so, f"lib{name}.dylib"]}
    for file in next((v for k, v in names.items() if sys.platform.startswith(k)), []):
        if (base / file).exists():
            return ctypes.CDLL(str(base / file))
    from llama_cpp._ctypes_extensions import load_shared_library

    return ctypes.CDLL(load_shared_library(name, base)._name)
