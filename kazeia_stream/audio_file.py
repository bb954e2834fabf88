"""Writing audio files so that an interrupted run never leaves a corrupt one, and a failed one
never replaces anything.

Samples go to a temporary file beside the target, which replaces the target only once closed: a
finished run gives the whole clip, an interrupted one (Ctrl-C, SIGTERM) what was produced so
far, a failed one (a write error, a bad input) leaves the target as it was. The target is checked
before any work: it must be a regular file or not exist yet, in a folder that can be written.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from types import TracebackType

import numpy as np
import soundfile as sf

from .errors import OutputError, UsageError
from .pcm import pcm_bytes


def _target(path: Path) -> Path:
    """The file to write: the target itself, or the file a symlink points to."""
    if path.exists() and not path.is_file():  # both follow a symlink to what it points to
        what = "a folder" if path.is_dir() else "not a regular file"
        raise UsageError(f"{path}: {what}; -o writes a new file or replaces one")
    real = path.resolve() if path.is_symlink() else path
    folder = real.parent
    if not folder.is_dir():
        raise UsageError(f"{path}: no such folder {str(folder)!r}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{path}: the folder {str(folder)!r} cannot be written")
    return real


class AudioFileWriter:
    """`with AudioFileWriter(path, rate) as w: w.write(samples)`; the format follows the suffix."""

    def __init__(self, path: str | os.PathLike[str], sample_rate: int) -> None:
        self.path = Path(path)
        fmt = self.path.suffix.lstrip(".").upper() or "WAV"
        if fmt not in sf.available_formats() or sf.default_subtype(fmt) is None:
            raise UsageError(f"{self.path}: unknown audio format {fmt!r} (try .wav, .flac or .ogg)")
        self._target = _target(self.path)
        try:
            fd, tmp = tempfile.mkstemp(
                prefix=f".{self._target.name}.", suffix=".part", dir=self._target.parent
            )
        except OSError as e:
            raise OutputError(f"cannot write {self.path}: {_reason(e)}") from None
        os.close(fd)
        self._tmp = Path(tmp)
        os.chmod(self._tmp, 0o666 & ~_umask())  # mkstemp makes it private; a new file would not be
        try:
            self._file = sf.SoundFile(self._tmp, "w", samplerate=sample_rate, channels=1, format=fmt)
        except (sf.LibsndfileError, OSError) as e:
            self._tmp.unlink(missing_ok=True)
            raise OutputError(f"cannot write {self.path}: {_reason(e)}") from None
        self.frames = 0

    def write(self, samples: np.ndarray) -> None:
        """16-bit files get the samples of `--pipe` and the server (`pcm_bytes`); libsndfile's
        own float conversion differs by up to 1 LSB (and between WAV and FLAC)."""
        if self._file.subtype == "PCM_16":
            samples = np.frombuffer(pcm_bytes(samples, "s16le"), dtype="<i2")
        try:
            self._file.write(samples)
        except (sf.LibsndfileError, OSError) as e:
            raise OutputError(f"cannot write {self.path}: {_reason(e)}") from None
        self.frames += len(samples)

    def __enter__(self) -> AudioFileWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # the audio so far, unless writing it is what failed
        keep = exc_type is None or (self.frames > 0 and not issubclass(exc_type, OutputError))
        try:
            self._file.close()
            if keep:
                os.replace(self._tmp, self._target)
        except (sf.LibsndfileError, OSError) as e:
            keep = False
            if exc_type is None:
                raise OutputError(f"cannot write {self.path}: {_reason(e)}") from None
        finally:
            if not keep:
                self._tmp.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _reason(e: BaseException) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e)
