"""kazeia-stream: live, streaming Qwen3-TTS speech on llama.cpp."""

import os

# llama.cpp's OpenMP threads spin after every graph by default; beside numpy's BLAS threads (the
# codec decoder) that oversubscription made synthesis 30-80x slower on 2 cores. Sleeping waits
# cost a few microseconds per graph. libgomp reads this once, when llama.cpp is first loaded.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from .errors import KazeiaError, ModelFileError, UsageError
from .model import Model, load_model

__all__ = ["KazeiaError", "Model", "ModelFileError", "UsageError", "load_model", "open"]


def __getattr__(name: str):
    """`open` and `Session` pull in trio and the engines; import them on first use."""
    if name in ("open", "Session", "Utterance"):
        from . import stream

        return getattr(stream, name)
    raise AttributeError(f"module 'kazeia_stream' has no attribute {name!r}")
__version__ = "0.1.0"
