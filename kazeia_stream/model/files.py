"""Where a model's GGUF pair is on disk. Pure pathlib: the command line finds the files before
it imports the modules that read them, to begin libllama's load of the vocabulary sooner."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelFileError


def find_pair(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(talker, mmproj) from a folder holding the pair, or from the talker file with the mmproj
    beside it. mmproj files are recognised by name (`mmproj*.gguf`), as llama.cpp names them."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file or folder")
    folder = path if path.is_dir() else path.parent
    mmprojs = sorted(p for p in folder.glob("*.gguf") if p.name.startswith("mmproj"))
    if path.is_dir():
        talkers = sorted(p for p in folder.glob("*.gguf") if not p.name.startswith("mmproj"))
        if len(talkers) != 1:
            found = ", ".join(p.name for p in talkers) or "none"
            raise ModelFileError(f"{folder}: expected one talker .gguf beside the mmproj, found {found}")
        path = talkers[0]
    if len(mmprojs) != 1:
        found = ", ".join(p.name for p in mmprojs) or "none"
        raise ModelFileError(f"{folder}: expected one mmproj*.gguf beside {path.name}, found {found}")
    return path, mmprojs[0]
