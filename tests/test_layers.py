"""The layers point down: files below, numerics in the middle, sessions on top."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from kazeia_stream import UsageError
from kazeia_stream.engine.threads import Threads, available_cores

PACKAGE = Path(__file__).resolve().parent.parent / "kazeia_stream"
# Each layer and the layers it may import from within the package (beside itself).
BELOW = {
    "model": {"errors", "clib", "ggml_lib"},
    "engine": {"errors", "clib", "ggml_lib", "model"},
    "channels": {"errors", "engine"},
    "stages": {"errors", "pcm", "model", "engine", "channels", "scheduler"},
}


def package_imports(path: Path) -> set[str]:
    """The first component of every kazeia_stream module `path` imports."""
    parts = path.relative_to(PACKAGE).parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(parts[:-1])[: len(parts) - node.level]
            target = [*base, *(node.module or "").split(".")] if node.module else base
            if not target or not target[0]:
                found.update(alias.name for alias in node.names)
            else:
                found.add(target[0].removesuffix(".py"))
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("kazeia_stream."))
    return found


@pytest.mark.parametrize("layer", sorted(BELOW))
def test_each_layer_imports_only_from_below(layer):
    for path in sorted((PACKAGE / layer).glob("*.py")):
        imported = package_imports(path) - {layer, "__future__"}
        assert imported <= BELOW[layer], f"{path.name} imports {sorted(imported - BELOW[layer])}"


def test_the_scheduler_sits_on_the_engines():
    """It schedules the engines for the actors above it, and knows nothing of sessions."""
    assert package_imports(PACKAGE / "scheduler.py") - {"__future__"} <= {"errors", "engine", "model"}


@pytest.mark.subprocess
def test_importing_the_package_and_its_pure_modules_starts_no_libllama_nor_trio():
    code = (
        "import sys, kazeia_stream, kazeia_stream.model.segments, kazeia_stream.model.text_stream,"
        " kazeia_stream.model.prompt; print(sorted(m for m in sys.modules if m.startswith("
        "('llama_cpp', 'trio'))))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.subprocess
def test_the_command_line_imports_the_engines_and_trio_only_once_its_model_loads():
    """`kazeia-stream` starts libllama's load of the vocabulary (a thread) before it imports the
    engines, the stages and trio, which then import beside that load (cli.cmd_speak)."""
    code = (
        "import sys, kazeia_stream.cli; print(sorted(m for m in sys.modules if m.startswith("
        "('trio', 'kazeia_stream.engine', 'kazeia_stream.stages', 'kazeia_stream.runtime'))))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_thread_counts_are_checked():
    cores = available_cores()
    assert Threads.default() == Threads(cores, cores, 1)
    for bad in (0, -1, cores + 1):
        with pytest.raises(UsageError, match="threads must be between 1 and"):
            Threads.uniform(bad)


@pytest.mark.parametrize("value", ["0", "-1", "two", "100000"])
@pytest.mark.subprocess
def test_the_cli_refuses_bad_thread_counts_in_one_line(tiny_gguf, value):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kazeia_stream",
            "bench",
            "--model",
            str(tiny_gguf("custom_voice")[0]),
            "--threads",
            value,
            "--frames",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "threads" in r.stderr.strip().splitlines()[-1]
