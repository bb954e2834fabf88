"""kazeia-stream: live, streaming Qwen3-TTS speech on llama.cpp."""

import os

# One BLAS thread for numpy (the codec decoder). llama.cpp's OpenMP threads spin while they wait;
# beside OpenBLAS's own spinning threads that oversubscription made synthesis 30-80x slower on 2
# cores, and the decoder's many small GEMMs gain little from a second thread that must wait for a
# core the talker is using (measured: 1 thread 126 ms/frame, 2 threads 107-800 ms). Effective when
# kazeia_stream is imported before numpy, as the CLI does. (OMP_WAIT_POLICY=passive is no cure:
# ggml's barriers are OpenMP barriers, and sleeping in them made every engine 30% slower.)
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
