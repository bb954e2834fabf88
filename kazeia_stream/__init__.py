"""kazeia-stream: live, streaming Qwen3-TTS speech on llama.cpp.

Importing the package loads nothing heavy (no libllama, no trio): the names below resolve on
first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import EmptyTextError, KazeiaError, ModelFileError, OutputError, UsageError
from .openmp import spin_openmp_briefly

spin_openmp_briefly()  # before anything loads libllama (and libgomp with it)

if TYPE_CHECKING:
    from .cloning import voice_from_audio
    from .engine.threads import Threads
    from .model import Model, load_model
    from .model.voice import Voice, VoiceLibrary
    from .runtime import Runtime
    from .session import Session, Utterance

__version__ = "0.2.0"

_LAZY = {
    "Model": ".model",
    "load_model": ".model",
    "Runtime": ".runtime",
    "Threads": ".engine.threads",
    "Session": ".session",
    "Utterance": ".session",
    "Voice": ".model.voice",
    "VoiceLibrary": ".model.voice",
    "voice_from_audio": ".cloning",
}

__all__ = [
    "EmptyTextError",
    "KazeiaError",
    "Model",
    "ModelFileError",
    "OutputError",
    "Runtime",
    "Session",
    "Threads",
    "UsageError",
    "Utterance",
    "Voice",
    "VoiceLibrary",
    "load_model",
    "voice_from_audio",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'kazeia_stream' has no attribute {name!r}")
