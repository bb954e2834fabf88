"""Raw PCM, 24 kHz mono, as `--pipe`, the server's `pcm` format and the file writer make it.

Apart from the sinks, and numpy imported at the first use, so that the command line names the
formats without importing either: a process starts loading its model's vocabulary sooner (see
`cli.cmd_speak`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

SAMPLE_BYTES = {"s16le": 2, "f32le": 4}
FORMATS = tuple(SAMPLE_BYTES)


def pcm_bytes(pcm: np.ndarray, fmt: str) -> bytes:
    """Raw little-endian PCM: 16-bit integers (clipped, rounded) or 32-bit floats."""
    import numpy as np

    if fmt == "f32le":
        return pcm.astype("<f4").tobytes()
    return np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
