"""Model files: the GGUF pair, its config, tokenizer, prompt building and the converter.

Pure: nothing here computes speech, and nothing imports the engines. `Model` and `load_model`
resolve on first use, so the text-only modules import without libllama.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .model import Model, find_pair, load_model

__all__ = ["Model", "find_pair", "load_model"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module 'kazeia_stream.model' has no attribute {name!r}")
