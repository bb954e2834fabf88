"""An official Qwen3-TTS checkpoint directory (Hugging Face layout) read for conversion: its
configs parsed and checked, its weights indexed and read on demand as float32, without torch
or the safetensors package (which cannot give BF16 to numpy). Every problem is a
ModelFileError naming the file, and the key or tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..errors import ModelFileError

_FINGERPRINT_BYTES = 1 << 20


class JsonObject:
    """A JSON object from a file; a missing key is a ModelFileError naming the file and key."""

    def __init__(self, path: Path, data: dict[str, Any] | None = None, where: str = "") -> None:
        self.path, self.where = path, where
        if data is None:
            data = read_json(path)
        if not isinstance(data, dict):
            raise ModelFileError(f"{path}: {where or 'top level'} is not a JSON object")
        self.data = data

    def __getitem__(self, key: str) -> Any:
        if key not in self.data or self.data[key] is None:
            raise ModelFileError(f"{self.path}: missing key {self.where}{key}")
        return self.data[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def section(self, key: str) -> JsonObject:
        return JsonObject(self.path, self[key], f"{self.where}{key}.")


def read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ModelFileError(f"{path}: file not found") from None
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path}: not valid JSON ({e})") from None


class SafeTensors:
    """One .safetensors file, read as float32 by tensor, whole or by rows of the first axis.

    safetensors' numpy API cannot read BF16, so the header is parsed here and BF16 is widened
    by shifting the raw 16 bits into the top of a float32."""

    _DTYPES: ClassVar[dict[str, np.dtype]] = {
        "BF16": np.dtype(np.uint16),
        "F16": np.dtype(np.float16),
        "F32": np.dtype(np.float32),
    }

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if not 0 < n <= size - 8:
                    raise ValueError("bad header length")
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            self._entries = {name: self._entry_of(name, e, 8 + n, size) for name, e in header.items()}
        except FileNotFoundError:
            raise ModelFileError(f"{path}: file not found") from None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise ModelFileError(f"{path}: not a safetensors file ({e!r})") from None

    def _entry_of(
        self, name: str, entry: dict[str, Any], data_start: int, size: int
    ) -> tuple[np.dtype, tuple[int, ...], int]:
        dtype = self._DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ModelFileError(f"{self.path}: tensor {name} has unsupported dtype {entry['dtype']}")
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(o) for o in entry["data_offsets"])
        if end - begin != math.prod(shape) * dtype.itemsize or data_start + end > size:
            raise ModelFileError(f"{self.path}: tensor {name} lies outside the file (truncated?)")
        return dtype, shape, data_start + begin

    def has(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of the first axis (all by default), as float32."""
        dtype, shape, offset = self._entry(name)
        stop = shape[0] if stop is None else stop
        row = math.prod(shape[1:])
        with open(self.path, "rb") as f:
            f.seek(offset + start * row * dtype.itemsize)
            raw = np.fromfile(f, dtype=dtype, count=(stop - start) * row)
        raw = raw.reshape(stop - start, *shape[1:])
        if dtype == np.uint16:
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.astype(np.float32, copy=False)

    def _entry(self, name: str) -> tuple[np.dtype, tuple[int, ...], int]:
        if name not in self._entries:
            raise ModelFileError(f"{self.path}: missing tensor {name}")
        return self._entries[name]

    def expect(self, name: str, shape: tuple[int, ...]) -> None:
        if self.shape(name) != shape:
            raise ModelFileError(
                f"{self.path}: tensor {name} has shape {list(self.shape(name))}, "
                f"expected {list(shape)} from the config"
            )


class Checkpoint:
    """The files of an official checkpoint directory: configs parsed, weights indexed (their
    data is read on demand)."""

    def __init__(self, hf_dir: Path) -> None:
        if not hf_dir.is_dir():
            raise ModelFileError(f"{hf_dir}: not a checkpoint directory")
        self.dir = hf_dir
        self.config = JsonObject(hf_dir / "config.json")
        self.talker = self.config.section("talker_config")
        self.code_predictor = self.talker.section("code_predictor_config")
        self.generation = JsonObject(hf_dir / "generation_config.json")
        self.tokenizer_config = JsonObject(hf_dir / "tokenizer_config.json")
        self.codec_config = JsonObject(hf_dir / "speech_tokenizer" / "config.json")
        self.decoder = self.codec_config.section("decoder_config")
        self.kind = self.config["tts_model_type"]
        if self.kind not in ("custom_voice", "base", "voice_design"):
            raise ModelFileError(f"{self.config.path}: unknown tts_model_type {self.kind!r}")
        self.weights = SafeTensors(hf_dir / "model.safetensors")
        self.codec = SafeTensors(hf_dir / "speech_tokenizer" / "model.safetensors")

    @cached_property
    def encoder(self) -> JsonObject:
        """speech_tokenizer/config.json `encoder_config` (Mimi): read for Base models only."""
        return self.codec_config.section("encoder_config")

    @cached_property
    def fingerprint(self) -> str:
        """Which checkpoint this is, written into both files so that a talker and an mmproj of
        different checkpoints are refused together (any types of one checkpoint pair up): a
        hash of the configs and of the first and last MiB of each weights file."""
        h = hashlib.sha256()
        for path in (self.config.path, self.codec_config.path, self.weights.path, self.codec.path):
            with open(path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(0)
                h.update(f.read(_FINGERPRINT_BYTES))
                f.seek(max(0, size - _FINGERPRINT_BYTES))
                h.update(f.read(_FINGERPRINT_BYTES) + size.to_bytes(8, "little"))
        return h.hexdigest()[:32]
