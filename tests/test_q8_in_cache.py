"""`tools/q8_in_cache.c` builds against the Q8_0 kernel's source as it is and reports both
cases for one row of x and for four, each rate the bytes of a block (34, its 32 weights) over
the time of its 32 multiply-adds with every row."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kazeia_stream.engine import q8_product

ROOT = Path(__file__).resolve().parents[1]
FIGURES = re.compile(r"^(L2 cache|memory) .*: ([\d.]+) ns per 32 multiply-adds, ([\d.]+) GB/s$", re.M)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.skipif(not q8_product.KERNEL.variants(), reason="the kernel does not run here")
def test_the_tool_reports_the_kernel_from_the_cache_and_from_memory(tmp_path):
    exe = tmp_path / "q8_in_cache"
    source, include = ROOT / "tools" / "q8_in_cache.c", ROOT / "kazeia_stream" / "engine"
    subprocess.run(["cc", "-O3", "-I", str(include), str(source), "-o", str(exe), "-lm"], check=True)
    for args, rows in (([], 1), (["4"], 4)):
        out = subprocess.run([str(exe), *args], capture_output=True, text=True, check=True).stdout
        assert f", {rows} row(s) of x" in out, out
        figures = FIGURES.findall(out)
        assert [where for where, *_ in figures] == ["L2 cache", "memory"], out
        for _, ns, gb_s in figures:
            assert float(ns) > 0 and float(gb_s) == pytest.approx(34 / float(ns) / rows, rel=0.05, abs=0.1)
    refused = subprocess.run([str(exe), "5"], capture_output=True, text=True)
    assert refused.returncode == 1 and "rows of x: 1 to 4" in refused.stdout
