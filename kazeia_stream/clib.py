"""Our C code's shared libraries. setuptools builds each at install as an optional extension
(pyproject.toml): a plain shared library that ctypes loads. Where one was not built (no C
compiler), the code it stands in for runs."""

from __future__ import annotations

import ctypes
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path


def load(module_file: str, name: str) -> ctypes.CDLL | None:
    """The shared library `_{name}` in the folder of the module `module_file`, where it was built."""
    for suffix in EXTENSION_SUFFIXES:
        path = Path(module_file).with_name(f"_{name}{suffix}")
        if path.exists():
            return ctypes.CDLL(str(path))
    return None
