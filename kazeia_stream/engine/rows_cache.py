"""The talker's KV cells of a session's fixed rows (instruction, role, voice, language), saved
per talker file and rows (`cache_files`), and written into a slot at later starts instead of
computed (`Talker.keep`, and an utterance's start in a slot without them, `Talker.begin`).

Every process's first utterance computed those rows before its text's: 8 rows for a
CustomVoice speaker, 0.29-0.36 s on one Zen 1 core (several rows at a time are bound by the
integer multiplies there), the longest step between the engines' load and the first frame of
`--pipe`. Written back from the file they take a millisecond, and they are the same numbers:
a file is used only for the same talker file (path, size, modification time), the same rows,
the same code (a digest of the modules and kernels that compute them, and the identity of the
bundled ggml's files) and the same kernel variants (a CPU's variants sum in other orders). The
64 files used last are kept (0.9 MB each for 8 rows at 0.6B).
"""

from __future__ import annotations

import hashlib
import logging
from functools import cache
from pathlib import Path

import numpy as np

from ..ggml_lib import ggml
from . import cache_files, kquant_product, kv_product, q8_product

log = logging.getLogger(__name__)

KEEP = 64  # rows files kept in the cache folder, the ones used last


class RowsCache:
    """The saved KV cells of rows fed to the talker of file `source` from position 0."""

    def __init__(self, source: Path) -> None:
        self.source = source

    def load(
        self, rows: np.ndarray, shape: tuple[int, ...], dtype: np.dtype
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """K and V saved for `rows`, each of `shape` and `dtype` (else None: none saved)."""
        where = self._where(rows)
        if where is None:
            return None
        saved = cache_files.read(*where)
        if saved is None or len(saved) != 2 or any(a.shape != shape or a.dtype != dtype for a in saved):
            return None
        return saved[0], saved[1]

    def save(self, rows: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Save K and V of `rows`, keeping the `KEEP` rows files used last."""
        where = self._where(rows)
        if where is not None and cache_files.write(*where, [k, v]):
            log.debug("%s: %d fixed rows' cells saved", where[0], len(rows))
            cache_files.prune(where[0].parent, "rows", KEEP)

    def _where(self, rows: np.ndarray) -> tuple[Path, str] | None:
        """The file and key for `rows`; None with no cache folder."""
        folder = cache_files.folder()
        if folder is None:
            return None
        fed = f"{rows.dtype} {rows.shape} {hashlib.sha256(rows.tobytes()).hexdigest()}"
        kernels = _kernels()
        path = folder / cache_files.name("rows", str(self.source.resolve()), fed, kernels)
        return path, cache_files.key(self.source, _code(), kernels, _bundled(), fed)


def _kernels() -> str:
    """The variants of our kernels the talker's products run on (None: ggml's; one choice for
    the three K-quant types)."""
    chosen = (q8_product.KERNEL.chosen(), kquant_product.Q4_K.chosen(), kv_product.chosen())
    return "q8_product={} kquant_product={} kv_product={}".format(*chosen)


@cache
def _code() -> tuple[Path, ...]:
    """Our files that compute the talker's numbers: its modules, and its kernels' libraries."""
    from . import ggml_graph, quantized_product, qwen3, talker

    modules = [talker, qwen3, ggml_graph, quantized_product, q8_product, kquant_product, kv_product]
    return cache_files.code(modules, ["q8_product", "kquant_product", "kv_product"])


@cache
def _bundled() -> str:
    """The bundled ggml's files (the norms, RoPE and attention of several rows run there): each
    one's name, size and modification time (a digest of them would take longer than the rows)."""
    folder = Path(ggml._name).resolve().parent
    files = sorted(p for p in folder.iterdir() if p.name.startswith("libggml"))
    return " ".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
