"""The arithmetic's side of `bench`'s floors: each weight type's one-row product with its
weight in the caches (`engine/product_rate.py`)."""

from __future__ import annotations

import math
import os
import threading

import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from kazeia_stream.engine import q8_product
from kazeia_stream.engine.product_rate import WEIGHT_BYTES, macs_per_s, rates, side

TYPES = (QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.F16, QType.F32)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_weight_timed_is_the_largest_square_of_whole_blocks_within_its_bytes(qtype):
    n = side(qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    assert n % 256 == 0 and n * n // block * size <= WEIGHT_BYTES
    assert (n + 256) ** 2 // block * size > WEIGHT_BYTES


@pytest.mark.parametrize("qtype", (QType.Q8_0, QType.F32), ids=lambda t: t.name)
def test_a_rate_is_timed_on_the_product_the_engines_use(qtype):
    if qtype == QType.Q8_0 and not q8_product.KERNEL.available():
        pytest.skip("our Q8_0 kernel does not run here")
    rate = macs_per_s(qtype, 1, repeat=2)
    assert math.isfinite(rate) and rate > 1e8  # any CPU multiplies faster than 0.1 G a second


def test_rates_are_measured_in_a_child_that_leaves_no_threads_behind_in_ours():
    """A graph on two threads from a thread of ours would leave libgomp's pool of that thread
    behind it (one more OS thread here), beside the generator's pool in a benchmark."""
    tasks = lambda: len(os.listdir("/proc/self/task"))
    seen = {}

    def measure():
        before = tasks()
        seen["rates"] = rates([QType.F32, QType.F16, QType.F32], 2)
        seen["threads"] = (before, tasks())

    worker = threading.Thread(target=measure)
    worker.start()
    worker.join()
    assert list(seen["rates"]) == [QType.F32, QType.F16]
    assert all(math.isfinite(r) and r > 1e8 for r in seen["rates"].values())
    before, after = seen["threads"]
    assert after == before
