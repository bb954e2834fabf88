"""kazeia-stream: live, streaming Qwen3-TTS speech on llama.cpp."""

from .errors import KazeiaError, ModelFileError, UsageError
from .model import Model, load_model

__all__ = ["KazeiaError", "Model", "ModelFileError", "UsageError", "load_model"]
__version__ = "0.1.0"
