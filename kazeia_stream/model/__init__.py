"""Model files: the GGUF pair, its config, tokenizer, prompt building and the converter.

Pure: nothing here computes speech, and nothing imports the engines. `Model` resolves on first
use and `load_model` imports what it needs when called, so the text-only modules import
without libllama.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .files import find_pair

if TYPE_CHECKING:
    from .model import Model

__all__ = ["Model", "find_pair", "load_model"]


def load_model(path: str | os.PathLike[str]) -> Model:
    """Load a model from a folder holding the GGUF pair, or from the talker file. libllama's
    load of the talker's vocabulary begins first, before the modules that read the files
    import, and goes on in the background while they check the files and a `Runtime` made next
    builds its engines (`Model.ready` waits for it)."""
    from .llama import start_vocab

    talker, mmproj = find_pair(path)
    vocab = start_vocab(talker)  # libllama reads it while the modules below import
    from .model import Model

    return Model(talker, mmproj, vocab)


def __getattr__(name: str) -> Any:
    if name == "Model":
        from .model import Model

        return Model
    raise AttributeError(f"module 'kazeia_stream.model' has no attribute {name!r}")
