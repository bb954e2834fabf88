"""Writing audio files so that an interrupted run never leaves a corrupt one.

Samples go to a temporary file beside the target, which replaces the target only once closed: a
finished run gives the whole clip, an interrupted one (Ctrl-C, an error) what was produced so far.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

import numpy as np
import soundfile as sf

from .errors import UsageError


class AudioFileWriter:
    """`with AudioFileWriter(path, rate) as w: w.write(samples)`; the format follows the suffix."""

    def __init__(self, path: str | os.PathLike[str], sample_rate: int) -> None:
        self.path = Path(path)
        fmt = self.path.suffix.lstrip(".").upper() or "WAV"
        if fmt not in sf.available_formats():
            raise UsageError(f"{self.path}: unknown audio format {fmt!r} (try .wav or .flac)")
        self._tmp = self.path.with_name(f".{self.path.name}.part")
        self._file = sf.SoundFile(self._tmp, "w", samplerate=sample_rate, channels=1, format=fmt)
        self.frames = 0

    def write(self, samples: np.ndarray) -> None:
        self._file.write(samples)
        self.frames += len(samples)

    def __enter__(self) -> AudioFileWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._file.close()
        if self.frames or exc_type is None:
            os.replace(self._tmp, self.path)
        else:
            self._tmp.unlink(missing_ok=True)
