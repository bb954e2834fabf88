"""Cloned voices of Base models, and the folder they are saved in.

A `Voice` is what the official `create_voice_clone_prompt` returns, plus where it came from: the
x-vector (speaker encoder output, one talker row), for in-context (ICL) voices the reference
codes [R, 16] of the recording and its transcript, and the model it was made with. It is saved
as a safetensors file (tensors `x_vector` float32 [hidden] and, for ICL voices, `ref_codes`
int32 [R, groups]; string metadata `format`, `name`, `ref_text`, `model`, `model_kind`,
`hidden_size`, `num_code_groups`, `ref_seconds`), a few KiB, readable by any safetensors
library.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

from ..errors import UsageError

log = logging.getLogger(__name__)

FORMAT = "kazeia-voice/1"
SUFFIX = ".voice.safetensors"
VOICES_ENV = "KAZEIA_VOICES"
# A name is also a file name: letters, digits, and - _ . inside.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True, eq=False)
class Voice:
    """A cloned voice: x-vector only, or in-context (`ref_codes` and `ref_text` set)."""

    x_vector: np.ndarray
    ref_codes: np.ndarray | None = None
    ref_text: str | None = None
    name: str | None = None
    model: str = ""  # the checkpoint id (or name) of the model that made it
    model_kind: str = "base"
    ref_seconds: float = 0.0

    @property
    def icl(self) -> bool:
        """Whether the voice clones in context (reference codes and text), not by x-vector alone."""
        return self.ref_codes is not None

    @property
    def mode(self) -> str:
        return "icl" if self.icl else "x-vector"

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the voice file through a temporary file renamed at the end (a failed write
        leaves what was there)."""
        path = Path(path)
        tensors = {"x_vector": np.ascontiguousarray(self.x_vector, dtype=np.float32)}
        if self.ref_codes is not None:
            tensors["ref_codes"] = np.ascontiguousarray(self.ref_codes, dtype=np.int32)
        metadata = {
            "format": FORMAT,
            "name": self.name or "",
            "ref_text": self.ref_text or "",
            "model": self.model,
            "model_kind": self.model_kind,
            "hidden_size": str(len(self.x_vector)),
            "num_code_groups": str(0 if self.ref_codes is None else self.ref_codes.shape[1]),
            "ref_seconds": f"{self.ref_seconds:.3f}",
        }
        fd, tmp = tempfile.mkstemp(prefix=".voice-", dir=path.parent)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=metadata)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except OSError as e:
            raise UsageError(f"{path}: cannot write the voice file ({e.strerror or e})") from None
        finally:
            Path(tmp).unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Voice:
        """Read a voice file; anything else is a one-line UsageError naming the file."""
        path = Path(path)
        try:
            tensors = load_file(path)
            with safe_open(path, framework="numpy") as f:
                metadata = f.metadata() or {}
        except FileNotFoundError:
            raise UsageError(f"{path}: no such voice file") from None
        except (OSError, SafetensorError, ValueError) as e:
            raise UsageError(f"{path}: not a voice file ({e})") from None
        if metadata.get("format") != FORMAT or "x_vector" not in tensors:
            raise UsageError(f"{path}: not a kazeia-stream voice file")
        codes = tensors.get("ref_codes")
        x_vector = tensors["x_vector"].astype(np.float32)
        if x_vector.ndim != 1 or (codes is not None and codes.ndim != 2):
            raise UsageError(f"{path}: not a kazeia-stream voice file (bad tensor shapes)")
        return cls(
            x_vector=x_vector,
            ref_codes=None if codes is None else codes.astype(np.int64),
            ref_text=metadata.get("ref_text") or None,
            name=metadata.get("name") or None,
            model=metadata.get("model", ""),
            model_kind=metadata.get("model_kind", "base"),
            ref_seconds=float(metadata.get("ref_seconds") or 0.0),
        )


def default_voices_dir() -> Path:
    """$KAZEIA_VOICES, else $XDG_DATA_HOME/kazeia-stream/voices (~/.local/share/...)."""
    if os.environ.get(VOICES_ENV):
        return Path(os.environ[VOICES_ENV])
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "kazeia-stream" / "voices"


class VoiceLibrary:
    """Saved voices by name: `NAME.voice.safetensors` files in one folder."""

    def __init__(self, folder: str | os.PathLike[str] | None = None) -> None:
        self.folder = Path(folder) if folder is not None else default_voices_dir()

    def path(self, name: str) -> Path:
        if not _NAME.fullmatch(name):
            raise UsageError(
                f"bad voice name {name!r}: use letters, digits, '-', '_' and '.' (at most 64, "
                "starting with a letter or digit)"
            )
        return self.folder / f"{name}{SUFFIX}"

    def names(self) -> list[str]:
        if not self.folder.is_dir():
            return []
        return sorted(p.name[: -len(SUFFIX)] for p in self.folder.glob(f"*{SUFFIX}"))

    def has(self, name: str) -> bool:
        return _NAME.fullmatch(name) is not None and self.path(name).is_file()

    def load(self, name: str) -> Voice:
        if not self.has(name):
            saved = ", ".join(self.names()) or "none"
            raise UsageError(f"no saved voice {name!r} in {self.folder} (saved: {saved})")
        return Voice.load(self.path(name))

    def save(self, voice: Voice, name: str) -> Path:
        path = self.path(name)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"{self.folder}: cannot create the voices folder ({e.strerror or e})") from None
        return replace(voice, name=name).save(path)
