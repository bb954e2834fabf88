"""kazeia-stream: live, streaming Qwen3-TTS speech on llama.cpp."""

import os

# llama.cpp's OpenMP threads spin after every graph by default; beside numpy's BLAS threads (the
# codec decoder) that oversubscription made synthesis 30-80x slower on 2 cores. Sleeping waits
# cost a few microseconds per graph. libgomp reads this once, when llama.cpp is first loaded.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
# The codec decoder's many small GEMMs gain nothing from a second BLAS thread that has to wait
# for a core the talker is using (measured: 1 thread 126 ms/frame, 2 threads 107-800 ms).
# Effective when kazeia_stream is imported before numpy, as the CLI does.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

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
