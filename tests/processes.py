"""Helpers for tests that signal a CLI process: a hang shows where each thread waits."""

from __future__ import annotations

import signal
import subprocess

import pytest

FAULTHANDLER = {"PYTHONFAULTHANDLER": "1"}  # SIGABRT dumps every thread's stack to stderr


def exit_status(proc: subprocess.Popen, sig: signal.Signals) -> int:
    """The exit status of a process started with `FAULTHANDLER` in its env that was sent
    `sig`, within a minute; else the test fails with where its threads wait (stderr piped)."""
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"still running 60 s after {sig.name}:\n{err.decode(errors='replace')[-8000:]}")
