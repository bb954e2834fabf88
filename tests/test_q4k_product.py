"""Our Q4_K product kernel (each variant this CPU runs) against ggml's, and what the engines
need of it: a row's numbers whatever rows come with it, on any thread count."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from kernels import on_each_variant, replays

from kazeia_stream.engine import q4k_product, q8_product, qwen3
from kazeia_stream.engine.ggml_graph import Allocator, ArrayTensor, products
from kazeia_stream.ggml_lib import quantize

pytestmark, op = on_each_variant(q4k_product)


@pytest.fixture(scope="module", params=[(200, 256), (64, 1024), (40, 3072)], ids=lambda s: f"{s[0]}x{s[1]}")
def weight(request):
    """A Q4_K weight [m, k] (libggml's quantizer) as a ggml tensor over its bytes: 200 rows fill
    no tile of 16 and no chunk of 64; one block a row, four, twelve."""
    m, k = request.param
    rng = np.random.default_rng(m)
    tensor = ArrayTensor(
        quantize(rng.standard_normal((m, k), dtype=np.float32), QType.Q4_K), QType.Q4_K, (m, k)
    )
    yield tensor.tensor, (m, k)
    tensor.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_gives_ggml_s_products_to_float_rounding(weight, op, threads):
    w, shape = weight
    x = np.random.default_rng(1).standard_normal((9, shape[1]), dtype=np.float32)
    x[3] = 0.0  # a row whose blocks quantize to zeros
    ours, ggml = (products(w, x, Allocator(), threads, kernel) for kernel in (op, None))
    assert ours.shape == ggml.shape == (9, shape[0])
    assert np.abs(ours - ggml).max() <= 1e-6 * np.abs(ggml).max()
    assert not np.any(ours[3]) and np.all(np.any(ours, axis=1)[[0, 1, 2, 4]])


def test_a_row_s_numbers_do_not_depend_on_the_rows_beside_it_or_the_threads(weight, op):
    w, shape = weight
    x = np.random.default_rng(2).standard_normal((9, shape[1]), dtype=np.float32)
    alone = np.concatenate([products(w, x[i : i + 1], Allocator(), 1, op) for i in range(len(x))])
    for count in (2, 4, 5, 9):
        for threads in (1, 2):
            assert np.array_equal(products(w, x[:count], Allocator(), threads, op), alone[:count])


def test_the_variants_differ_by_float_rounding_only(weight):
    if len(q4k_product.variants()) < 2:
        pytest.skip("this CPU runs one variant")
    w, shape = weight
    x = np.random.default_rng(4).standard_normal((5, shape[1]), dtype=np.float32)
    a, b = (
        products(w, x, Allocator(), 1, partial(q4k_product.product, variant=v))
        for v in q4k_product.variants()
    )
    assert np.abs(a - b).max() <= 1e-6 * np.abs(a).max()


def test_every_replay_computes_every_row_on_any_thread_count(weight, op):
    w, shape = weight
    x = np.random.default_rng(5).standard_normal((3, shape[1]), dtype=np.float32)
    expected = products(w, x, Allocator(), 1, op)
    for replay in replays(w, shape, op, x, [1, 2, 2, 1, 2]):
        for y in replay:
            assert np.array_equal(y, expected)


def test_the_engines_multiply_each_type_on_its_kernel(monkeypatch):
    """A Q4_K weight goes to this kernel, a Q8_0 one to q8_product's, others to ggml's; none
    to this one when it is turned off."""
    rng = np.random.default_rng(8)
    rows = rng.standard_normal((32, 256), dtype=np.float32)
    q4k, q8 = (ArrayTensor(quantize(rows, t), t, (32, 256)) for t in (QType.Q4_K, QType.Q8_0))
    q6k = ArrayTensor(quantize(rows, QType.Q6_K), QType.Q6_K, (32, 256))
    assert qwen3._kernel(q4k.tensor) is q4k_product.KERNEL
    assert qwen3._kernel(q6k.tensor) is None
    if q8_product.available():
        assert qwen3._kernel(q8.tensor) is q8_product.KERNEL
    monkeypatch.setenv(q4k_product.ENV, "0")
    q4k_product.chosen.cache_clear()  # type: ignore[attr-defined]
    try:
        assert qwen3._kernel(q4k.tensor) is None
    finally:
        monkeypatch.undo()
        q4k_product.chosen.cache_clear()  # type: ignore[attr-defined]
