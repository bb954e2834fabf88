"""The examples run as a user would run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

pytestmark = [pytest.mark.subprocess, pytest.mark.slow, pytest.mark.serial]  # it barges in on a clock

ROOT = Path(__file__).resolve().parent.parent


def test_conversation_example_speaks_and_barges_in(tiny_gguf, tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "conversation.py"),
            "--model",
            str(tiny_gguf("custom_voice")[0]),
            "--barge-in-after",
            "0.5",
            "--out-dir",
            str(tmp_path),
        ],
        capture_output=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode().splitlines()
    assert "cancelled" in lines[2] and "complete" in lines[0] and "complete" in lines[3]
    durations = [sf.info(str(tmp_path / f"turn{i}.wav")).duration for i in range(3)]
    assert 0.5 <= durations[1] < 0.8 and durations[0] > 1 and durations[2] > 1
    # two agents at once: both channels speak, and their speech overlapped in time
    duet, _ = sf.read(str(tmp_path / "duet.wav"))
    assert duet.shape[1] == 2 and np.abs(duet).max(axis=0).min() > 0.01
    together = float(lines[4].split("together for ")[1].split(" s")[0])
    assert lines[4].startswith("duet: aiden and dylan") and together > 0.5
