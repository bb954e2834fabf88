"""Helpers for tests that run other processes: a CLI signalled (a hang shows where each
thread waits), a process busy beside the tests."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

FAULTHANDLER = {"PYTHONFAULTHANDLER": "1"}  # SIGABRT dumps every thread's stack to stderr


def signalled(proc: subprocess.Popen, sig: signal.Signals) -> tuple[int, bytes, bytes]:
    """Send `sig` to a process started with `FAULTHANDLER` in its env: its exit status and what
    it wrote from then on (stdout and stderr, where piped), within a minute; else the test
    fails with where its threads wait (stderr piped)."""
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"still running 60 s after {sig.name}:\n{err.decode(errors='replace')[-8000:]}")
    return proc.returncode, out or b"", err or b""


@contextmanager
def spinning(*prefix: str) -> Iterator[None]:
    """Another process busy on one core while the block runs (`prefix`: a command it runs
    under, e.g. `nice`)."""
    proc = subprocess.Popen([*prefix, sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()
