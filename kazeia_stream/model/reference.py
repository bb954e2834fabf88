"""Reference recordings for voice cloning: read, made mono and 24 kHz as the official code does,
and checked.

The official `create_voice_clone_prompt` loads a file with librosa (soundfile underneath,
float32, channels averaged) and resamples with `librosa.resample` (soxr, quality "soxr_hq",
then padded or trimmed to ceil(n * ratio) samples); both encoders see those samples. This does
the same with soundfile and soxr directly.

Limits (ours; the official code has none): at least 1 s, at most 30 s (3-10 s of clean speech
clone best; the ICL prompt grows by 12.5 talker rows per second of reference), and not silent.
A longer recording is refused rather than cut: its transcript would no longer match it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

from ..errors import UsageError

MIN_SECONDS = 1.0
MAX_SECONDS = 30.0
SILENT_PEAK = 1e-3  # -60 dBFS: nothing the speaker encoder could hear
RESAMPLE_QUALITY = "soxr_hq"  # librosa.resample's default res_type


@dataclass(frozen=True)
class Reference:
    """A reference recording at the encoders' rate, and its length in seconds."""

    samples: np.ndarray  # float32 [n], mono, `rate` Hz
    rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.rate


def read_reference(
    source: str | os.PathLike[str] | np.ndarray, sample_rate: int | None, rate: int
) -> Reference:
    """The recording in `source` (an audio file, or samples [n] or [n, channels] at
    `sample_rate`) as mono float32 at `rate` Hz; a UsageError for anything unusable."""
    if isinstance(source, np.ndarray):
        if sample_rate is None or sample_rate <= 0:
            raise UsageError("reference samples need their sample rate (sample_rate=...)")
        samples, name = np.asarray(source, dtype=np.float32), "the reference"
        if samples.ndim == 2:
            samples = samples.mean(axis=-1, dtype=np.float32)
        elif samples.ndim != 1:
            raise UsageError(f"reference samples must be [n] or [n, channels], got shape {samples.shape}")
    else:
        samples, sample_rate, name = *_read_file(Path(source)), str(source)
    seconds = len(samples) / sample_rate
    if seconds < MIN_SECONDS:
        raise UsageError(f"{name}: {seconds:.2f} s of audio; a reference needs at least {MIN_SECONDS:g} s")
    if seconds > MAX_SECONDS:
        raise UsageError(
            f"{name}: {seconds:.1f} s of audio; a reference may be at most {MAX_SECONDS:g} s "
            "(3-10 s of clean speech is best): cut it, e.g. `sox in.wav out.wav trim 0 10`"
        )
    if not np.isfinite(samples).all():
        raise UsageError(f"{name}: the audio holds NaN or infinite samples")
    if float(np.abs(samples).max()) < SILENT_PEAK:
        raise UsageError(f"{name}: the audio is silent (peak below -60 dBFS)")
    return Reference(_resample(samples, sample_rate, rate), rate)


def _read_file(path: Path) -> tuple[np.ndarray, int]:
    """Mono float32 samples and their rate, as librosa.load(path, sr=None, mono=True)."""
    if not path.exists():
        raise UsageError(f"{path}: no such file")
    if path.is_dir():
        raise UsageError(f"{path}: a folder, not an audio file")
    try:
        samples, rate = sf.read(path, dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise UsageError(f"{path}: not an audio file soundfile can read ({e})") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot read ({e.strerror or e})") from None
    mono = samples[:, 0] if samples.shape[1] == 1 else samples.mean(axis=1, dtype=np.float32)
    return np.ascontiguousarray(mono), int(rate)


def _resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """librosa.resample(samples, orig_sr=rate, target_sr=target) with its default soxr_hq."""
    if rate == target:
        return samples
    n = math.ceil(len(samples) * target / rate)
    out = soxr.resample(samples, rate, target, quality=RESAMPLE_QUALITY).astype(np.float32, copy=False)
    if len(out) < n:
        out = np.pad(out, (0, n - len(out)))
    return np.ascontiguousarray(out[:n])
