"""`tools/streams_bound.py` times each engine alone and prints, each round and as medians, the
bound W = G_all + D (1 - G_all / G_beside) and the audio it allows: N stream-frames of audio
over W."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kazeia_stream

ROOT = Path(__file__).resolve().parents[1]
ROUND = re.compile(r"G_beside (\S+), G_all (\d+), D (\d+), W (\d+) ms.*?at most ([\d.]+) audio s per s", re.M)


@pytest.mark.serial  # times the engines
@pytest.mark.subprocess
def test_the_tool_prints_the_bound_of_the_engines_rates(tiny_gguf):
    talker, _ = tiny_gguf("custom_voice", "q8_0")
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "streams_bound.py"), "--model", str(talker),
         "--streams", "2", "--repeat", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3 and lines[-1].startswith("medians: ") and lines[-1].endswith(" 2 streams)")
    model = kazeia_stream.load_model(str(talker))
    audio_s = 2 * model.config.codec.samples_per_frame / model.sample_rate
    no_core_beside = kazeia_stream.Threads.default().cores < 2  # beside the decoder's one
    matches = [ROUND.search(line) for line in lines]
    figures = [tuple(float(v) for v in match.groups()) for match in matches if match]
    assert len(figures) == len(lines), lines
    for beside, g_all, d, w, bound in figures:
        assert beside > 0 and g_all > 0 and d > 0
        assert math.isinf(beside) == no_core_beside
        # the audio over W, which is printed rounded to the ms
        assert audio_s / (w + 0.5) * 1e3 - 1e-3 <= bound <= audio_s / (w - 0.5) * 1e3 + 1e-3
    # a round's W from its times (the medians' are each a column's)
    for beside, g_all, d, w, _ in figures[:-1]:
        rounding = 0.5 * (1 + abs(1 - d / beside) + abs(1 - g_all / beside) + d * g_all / beside**2)
        assert w == pytest.approx(g_all + d * (1 - g_all / beside), abs=rounding + 1e-9)
