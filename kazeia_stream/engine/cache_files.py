"""Arrays that took long to make, saved once in a file of our own and mapped at later starts
(`weight_cache`: the codec decoder's weights in its layouts; `rows_cache`: the talker's KV
cells of a session's fixed rows).

A file is a GGUF file (gguf-py's writer, our `GGUFFile` reader) in $KAZEIA_CACHE, else
$XDG_CACHE_HOME/kazeia-stream, else ~/.cache/kazeia-stream (`KAZEIA_CACHE=0`: none). It holds a
key that says what the arrays were made from and by (`key`): read under another key it is
passed over, and made and written anew, whole (a temporary file renamed over it). A file that
cannot be read or written is passed over, logged at debug level. Of each kind, the files used
last are kept (`prune`).

A file is mapped on huge pages where the kernel gives them: the page cache holds a file just
written in small pieces, so a written file leaves it, and a later load reads it through a
mapping that asks for huge ones. The decoder's products read its 0.29 GB every push: with 60%
of them in 4 KiB pages a push of one frame took 69-79 ms in a slow phase of the Xeon with AMX,
on huge pages 62-65 (`python -m kazeia_stream.engine.codec MMPROJ 1 4`; docs/measurements.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from types import ModuleType

import numpy as np

from ..errors import ModelFileError
from ..model.gguf_file import GGUFFile, drop_from_page_cache
from . import native
from .ggml_graph import huge_pages, map_huge

log = logging.getLogger(__name__)

CACHE_ENV = "KAZEIA_CACHE"
_KEY = "kazeia.cache.key"  # what the arrays were made from and by (`key`)


def folder() -> Path | None:
    """$KAZEIA_CACHE, else $XDG_CACHE_HOME/kazeia-stream (~/.cache/...); None for
    `KAZEIA_CACHE=0`, or with no home folder."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen == "0":
        return None
    if chosen:
        return Path(chosen)
    try:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kazeia-stream"
    except RuntimeError:  # no home folder known
        return None


def key(source: Path, code: Sequence[Path], *choices: str) -> str:
    """A key for arrays made from the file `source` (as it is now: its path, size and
    modification time) by the files of `code` (a digest of them), with `choices` that neither
    tells apart."""
    stat = source.stat()
    parts = [str(source.resolve()), str(stat.st_size), str(stat.st_mtime_ns), _digest(tuple(code))]
    return "\n".join([*parts, *choices])


def code(modules: Sequence[ModuleType], libraries: Sequence[str]) -> tuple[Path, ...]:
    """The files of code that makes arrays (for `key`): Python `modules`, and our C
    `libraries` where they were built."""
    built = [native.library(name) for name in libraries]
    return tuple(Path(m.__file__ or "") for m in modules) + tuple(Path(lib._name) for lib in built if lib)


def name(kind: str, *parts: str) -> str:
    """A cache file's name for arrays of `kind` ("decoder", "rows") told apart by `parts`."""
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    return f"{kind}-{digest[:24]}.gguf"


@cache
def _digest(files: tuple[Path, ...]) -> str:
    """The code that makes the arrays, as a digest of its files."""
    h = hashlib.sha256()
    for file in files:
        h.update(file.read_bytes())
    return h.hexdigest()


def read(path: Path, key: str) -> list[np.ndarray] | None:
    """The arrays saved in `path` for `key`, mapped read-only, the file marked as used now
    (`prune` keeps the files used last); None where there are none."""
    if not path.is_file():
        return None
    try:
        f = GGUFFile(path)
        if f.get(_KEY) != key:
            log.debug("%s: made from other files or code, to be replaced", path)
            return None
        names = [str(i) for i in range(len(f.tensor_names))]
        if huge_pages() and names:  # mapped now, the arrays' bytes as one span (small ones
            start = f.span(names[0])[0]  # each on its own would be read in small pieces)
            map_huge(f.mapping, [(start, len(f.mapping) - start)])
        arrays = [f.view(n) for n in names]
    except (ModelFileError, OSError, KeyError) as e:
        log.debug("%s: passed over (%s)", path, e)
        return None
    with contextlib.suppress(OSError):
        os.utime(path)
    return arrays


def write(path: Path, key: str, arrays: Sequence[np.ndarray]) -> bool:
    """`arrays` saved under `key`: a temporary file beside `path`, then renamed to it, and out
    of the page cache (see the module's docstring). Whether it was."""
    import gguf  # the writer: only where a cache is written

    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".", suffix=".tmp", delete=False) as f:
            tmp = Path(f.name)
        writer = gguf.GGUFWriter(tmp, "kazeia-cache")
        writer.add_string(_KEY, key)
        for i, a in enumerate(arrays):
            writer.add_tensor(str(i), np.ascontiguousarray(a))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
        drop_from_page_cache(path)  # the next load reads it in huge pieces
        return True
    except OSError as e:
        log.debug("%s: not saved (%s)", path, e)
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        return False


def prune(folder: Path, kind: str, keep: int) -> None:
    """Remove the files of `kind` in `folder` beyond the `keep` used last."""
    try:
        files = sorted(folder.glob(f"{kind}-*.gguf"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in files[keep:]:
            old.unlink(missing_ok=True)
    except OSError as e:
        log.debug("%s: not pruned (%s)", folder, e)
