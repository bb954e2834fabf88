"""Our kernel of the attention's products over the KV cache (`kv_product`): the exact products
to float32 rounding (ggml's mul_mat rounds the rows of b to float16 beside a float16 cache; ours
keeps them), on strided views as the attention takes them of the caches, each element in one
order whatever the threads and the matrices beside it."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from kazeia_stream.engine import kv_product
from kazeia_stream.engine.ggml_graph import Allocator, Graph, view_of

pytestmark = pytest.mark.skipif(
    kv_product.chosen() is None, reason="the kernel is not built, or this CPU lacks AVX2"
)

A = 2  # matrices of a (the caches' KV heads)


@pytest.fixture
def kv_kernel(monkeypatch: pytest.MonkeyPatch):
    """`kv_kernel(value)` sets `KAZEIA_KV_KERNEL` for the graphs built during the test."""

    def use(value: str) -> None:
        monkeypatch.setenv(kv_product.ENV, value)
        kv_product.chosen.cache_clear()

    yield use
    monkeypatch.delenv(kv_product.ENV, raising=False)
    kv_product.chosen.cache_clear()


def cache_and_view(rng, dtype, layout: str, k: int, m: int, count: int):
    """A cache with room around the numbers used (rows of k + 5, three batches more than used)
    and the view of them a product takes: "keys" has a's matrices side by side in each of its
    rows (a position's heads), "values" one after the other (a block's channels). Returns the
    cache, the view's sizes, strides and offset (ggml order), and its numbers [count, A, m, k]."""
    pad, item = k + 5, np.dtype(dtype).itemsize
    if layout == "keys":
        cache = rng.standard_normal((count + 3, m, A, pad)).astype(dtype)
        nb = (A * pad * item, pad * item, m * A * pad * item)
        numbers = cache[1 : count + 1, :, :, :k].transpose(0, 2, 1, 3)
    else:
        cache = rng.standard_normal((count + 3, A, m, pad)).astype(dtype)
        nb = (pad * item, m * pad * item, A * m * pad * item)
        numbers = cache[1 : count + 1, :, :, :k]
    return cache, ((k, m, A, count), nb, nb[2]), numbers.astype(np.float64)


def run(cache, view, b, ggml: bool = False, threads=(1,)) -> list[np.ndarray]:
    """`kv_product.product` (or ggml's mul_mat) of the view of `cache` and b [count, A g, n, k]
    (numpy order), on each entry of `threads`: dst [count, A g, n, m] each time."""
    qtype = QType.F16 if cache.dtype == np.float16 else QType.F32
    (k, m, heads, count), nb, offset = view
    allocator, g = Allocator(), Graph(8)
    try:
        whole, rows = g.input(qtype, cache.shape), g.input(QType.F32, b.shape)
        a = g.view(whole, (k, m, heads, count), nb, offset)
        y = g.output(g.mul_mat(a, rows) if ggml else kv_product.product(g, a, rows))
        g.allocate(allocator)
        view_of(whole, qtype, cache.shape)[...] = cache
        view_of(rows, QType.F32, b.shape)[...] = b
        results = []
        for n in threads:
            out = view_of(y, QType.F32, (*b.shape[:3], m))
            out[...] = np.nan
            g.compute(n)
            results.append(out.copy())
        return results
    finally:
        g.close()
        allocator.close()


def exact(numbers: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The products in float64 and the sums of their terms' magnitudes: [count, A g, n, m]."""
    a = np.repeat(numbers, b.shape[1] // A, axis=1)  # each matrix of a serves g of b's
    return np.einsum("chik,chnk->chni", a, b), np.einsum("chik,chnk->chni", np.abs(a), np.abs(b))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("layout", ["keys", "values"])
@pytest.mark.parametrize(
    ("k", "m", "g", "n"),
    [
        (128, 37, 2, 1),
        (100, 64, 1, 1),
        (13, 9, 4, 1),
        (64, 21, 2, 4),
        (40, 5, 8, 1),
        (24, 11, 3, 1),
        (16, 7, 7, 1),
    ],
)
def test_products_are_exact_to_float32_rounding(dtype, layout, k, m, g, n):
    """Rows of k not a multiple of 8, m rows not a multiple of the rows a pass takes (8 / g n,
    rounded down), g n of each count of registers the kernel keeps; batches of two."""
    rng = np.random.default_rng(k + m)
    cache, view, numbers = cache_and_view(rng, dtype, layout, k, m, 2)
    b = rng.standard_normal((2, A * g, n, k)).astype(np.float32)
    (got,) = run(cache, view, b)
    expected, magnitude = exact(numbers, b)
    assert np.all(np.abs(got - expected) <= 1e-6 * np.sqrt(k) * magnitude)


def test_a_float16_cache_s_products_are_closer_than_ggml_s():
    """ggml rounds the rows of b to float16 beside a float16 cache; the kernel does not."""
    rng = np.random.default_rng(5)
    cache, view, numbers = cache_and_view(rng, np.float16, "keys", 128, 64, 1)
    b = rng.standard_normal((1, 2 * A, 1, 128)).astype(np.float32)
    expected, _ = exact(numbers, b)
    (ours,), (ggml,) = run(cache, view, b), run(cache, view, b, ggml=True)
    assert np.abs(ours - expected).max() * 100 < np.abs(ggml - expected).max()


@pytest.mark.parametrize("layout", ["keys", "values"])
def test_an_element_s_numbers_do_not_depend_on_the_threads_or_the_matrices_beside_it(layout):
    rng = np.random.default_rng(9)
    cache, ((k, m, heads, count), nb, offset), _ = cache_and_view(rng, np.float16, layout, 96, 45, 3)
    b = rng.standard_normal((count, 2 * A, 1, k)).astype(np.float32)
    results = run(cache, ((k, m, heads, count), nb, offset), b, threads=(1, 2, 3))
    assert all(np.array_equal(results[0], r) for r in results[1:])
    for c in range(count):  # each batch alone: its own view and rows
        (alone,) = run(cache, ((k, m, heads, 1), nb, offset + c * nb[2]), b[c : c + 1], threads=(2,))
        assert np.array_equal(alone[0], results[0][c])


def test_it_can_be_turned_off(kv_kernel):
    """`KAZEIA_KV_KERNEL=0`: ggml's mul_mat, bit for bit."""
    rng = np.random.default_rng(2)
    cache, view, _ = cache_and_view(rng, np.float16, "values", 64, 32, 1)
    b = rng.standard_normal((1, 2 * A, 1, 64)).astype(np.float32)
    (ggml,) = run(cache, view, b, ggml=True)
    assert not np.array_equal(run(cache, view, b)[0], ggml)
    kv_kernel("0")
    assert kv_product.chosen() is None
    assert np.array_equal(run(cache, view, b)[0], ggml)
