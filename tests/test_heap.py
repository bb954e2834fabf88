"""The decoder's buffers reuse the C heap's freed memory (`heap.keep_freed_memory`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHURN = """
import resource, sys
import numpy as np
from kazeia_stream.engine import heap

def churn():  # four 3 MB buffers at a time, freed together, as a frame's are
    for _ in range(10):
        buffers = [np.ones(3 << 18, np.float32) for _ in range(4)]
        del buffers

if sys.argv[1] != "default" and not heap.keep_freed_memory():
    sys.exit(3)
if sys.argv[1] == "reserve":
    heap.reserve(16 << 20)
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    churn()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES = 10 * 4 * 768  # the churn's pages of 4 KiB


def _page_faults(mode: str) -> tuple[int, int]:
    """Page faults of two rounds of the churn, in a process of its own (the setting is
    process-wide): with glibc's defaults, kept freed memory, or that and a reserve."""
    env = {"PATH": "/usr/bin:/bin"}  # no MALLOC_* or GLIBC_TUNABLES from the caller
    done = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, env=env)
    if done.returncode == 3:
        pytest.skip("not glibc")
    assert done.returncode == 0, done.stderr
    first, second = map(int, done.stdout.split())
    return first, second


def test_freed_buffers_come_back_without_page_faults():
    kept, default = _page_faults("keep"), _page_faults("default")
    assert kept[1] < 100 < PAGES // 2 < default[1]  # by default, at least half the pages again
    assert kept[0] > 1000  # the first round grows the heap


def test_a_reserve_is_resident_before_the_first_round():
    first, second = _page_faults("reserve")
    assert first < 100 and second < 100


def test_the_user_s_own_malloc_settings_are_left_alone(monkeypatch):
    from kazeia_stream.engine import heap

    heap.keep_freed_memory.cache_clear()
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    try:
        assert not heap.keep_freed_memory()
    finally:
        heap.keep_freed_memory.cache_clear()
