"""The codec decoder's weights in the layouts its products take, saved once per mmproj file and
mapped at later loads.

Packing the decoder's weights in panels, widening its float16 ones that run in place and
transforming its dilated convolutions for Winograd's algorithm took 0.4-1.2 s of each start on
Zen 1, much of it page faults in 0.35 GB of fresh memory; with the saved arrays mapped (from
the page cache) the decoder's load takes 0.07-0.17 s. Saving them costs the first load 0.3-0.6
s. A file per mmproj file and layout (`cache_files`), used only while the mmproj file keeps its
size and modification time, for the code that wrote it (a digest of the modules that make the
arrays) and the arrays the load asks for, in order, of the same shapes and types (`Stale`
otherwise: the load computes them and writes the file anew). The `KEEP` files used last are
kept (0.29 GB each for the 0.6B with a float16 decoder).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import cache_files

log = logging.getLogger(__name__)

Make = Callable[[], np.ndarray]  # an array's computation

KEEP = 4  # decoder files kept in the cache folder, the ones used last


class Stale(Exception):
    """The saved arrays are not the ones the load asks for."""


class WeightCache:
    """The arrays a decoder's load makes, in the order it makes them: the saved ones
    (`replaying`), else computed and kept, to be saved at `finish`."""

    def __init__(self, path: Path | None = None, key: str = "") -> None:
        """The arrays saved in `path` under `key`; with no path (`UNSAVED`), every array is
        computed and nothing is kept or saved."""
        self.path, self.key = path, key
        self._saved = cache_files.read(path, key) if path is not None else None
        self._next = 0
        self._made: list[np.ndarray] = []

    @classmethod
    def of(cls, source: Path, code: Sequence[Path], layout: str) -> WeightCache:
        """The cache of arrays made from the file `source` by the files of `code`, with the
        choices `layout` names (which the arrays' shapes may not tell apart), in the cache folder
        (none there with no folder: `UNSAVED`)."""
        folder = cache_files.folder()
        if folder is None:
            return UNSAVED
        path = folder / cache_files.name("decoder", str(source.resolve()), layout)
        return cls(path, cache_files.key(source, code, layout))

    @property
    def replaying(self) -> bool:
        """Whether the arrays come from a saved file."""
        return self._saved is not None

    def final(self, shape: tuple[int, ...], dtype: np.dtype[Any], compute: Make) -> np.ndarray:
        """An array the decoder keeps: the next saved one (which must be of this shape and
        type), else `compute()`, kept to be saved."""
        if self._saved is None:
            made = compute()
            if self.path is not None:
                self._made.append(made)
            return made
        if self._next == len(self._saved):
            raise Stale(f"more arrays than the {len(self._saved)} saved")
        saved = self._saved[self._next]
        if _dims(saved.shape) != _dims(shape) or saved.dtype != dtype:
            raise Stale(f"array {self._next}: {saved.shape} {saved.dtype} saved, {shape} {dtype} asked")
        self._next += 1
        return saved.reshape(shape)

    def interim(self, shape: tuple[int, ...], dtype: np.dtype[Any], compute: Make) -> np.ndarray:
        """An array that final ones are made from: `compute()`, or, replaying, memory of its
        shape never written (nothing reads it: the arrays made from it are saved)."""
        return np.empty(shape, dtype) if self._saved is not None else compute()

    def forget(self) -> None:
        """Compute every array from now on (after `Stale`: the load starts over)."""
        self._saved, self._next, self._made = None, 0, []

    def finish(self) -> None:
        """The load is done: replaying, every saved array must have been asked for; else the
        arrays made are saved (replacing the file at once, as a whole)."""
        if self._saved is not None:
            if self._next != len(self._saved):
                raise Stale(f"{self._next} arrays asked for, {len(self._saved)} saved")
            return
        if self.path is not None and cache_files.write(self.path, self.key, self._made):
            log.debug("%s: the decoder's weights saved (%d arrays)", self.path, len(self._made))
            cache_files.prune(self.path.parent, "decoder", KEEP)
        self._made = []


UNSAVED = WeightCache()  # arrays computed, never kept: a load with no cache


def _dims(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape as GGUF keeps it: leading axes of 1 dropped."""
    dims = list(shape)
    while len(dims) > 1 and dims[0] == 1:
        dims.pop(0)
    return tuple(dims)
