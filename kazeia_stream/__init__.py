"""kazeia-stream: live, streaming Qwen3-TTS speech on llama.cpp."""

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
