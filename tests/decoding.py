"""Reading audio that was streamed, as a client of the server receives it."""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf


class _Streamed(sf.SoundFile):
    """Reads a streamed file to its end. A streamed FLAC says its length is unknown (STREAMINFO
    total samples 0): libsndfile then reports 2**63 - 1 frames and soundfile's seek after each
    read of a seekable file fails; told the file is not seekable, soundfile just reads on."""

    def seekable(self) -> bool:
        return False


def decode(data: bytes, dtype: str = "float32") -> tuple[np.ndarray, int, int]:
    """The samples, rate and channels of a whole stream, read to its end."""
    with _Streamed(io.BytesIO(data)) as f:
        blocks = [np.zeros(0, dtype)]
        while len(block := f.read(8192, dtype=dtype)):
            blocks.append(block)
        return np.concatenate(blocks), f.samplerate, f.channels
