"""Our float32 product kernel (each variant this CPU runs) against float64 and ggml's, and what
the codec decoder needs of it: a column's numbers whatever columns come with it, on any thread
count."""

from __future__ import annotations

import numpy as np
import pytest
from kernels import on_each_variant

from kazeia_stream.engine import f32_product, native
from kazeia_stream.engine.codec import Matrix
from kazeia_stream.engine.ggml_graph import Allocator, ArrayTensor, products

pytestmark, op = on_each_variant(f32_product)


@pytest.fixture(scope="module", params=[(37, 100), (130, 768)], ids=lambda s: f"{s[0]}x{s[1]}")
def weight(request):
    """A float32 weight [m, k] as a ggml tensor over its array: 37 x 100 has rows that fill no
    tile of 4 and an inner size that fills no vector of 16 or 8; 130 x 768 fills them but its
    last two rows."""
    m, k = request.param
    array = np.random.default_rng(m).standard_normal((m, k), dtype=np.float32)
    tensor = ArrayTensor(array)
    yield tensor.tensor, array
    tensor.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_gives_the_product_to_float_rounding(weight, op, threads):
    w, array = weight
    x = np.random.default_rng(1).standard_normal((11, array.shape[1]), dtype=np.float32)
    ours, ggml = (products(w, x, Allocator(), threads, kernel) for kernel in (op, None))
    exact = x.astype(np.float64) @ array.T.astype(np.float64)
    assert ours.shape == exact.shape == (11, array.shape[0])
    scale = np.abs(exact).max()
    assert np.abs(ours - exact).max() <= 2e-6 * scale
    assert np.abs(ggml - exact).max() <= 2e-6 * scale


def test_a_column_s_numbers_do_not_depend_on_the_columns_beside_it_or_the_threads(weight, op):
    """Bit for bit: alone, among 2 to 13 columns, at any place among them, on 1 or 2 threads
    (ggml's own kernels round a lone column otherwise)."""
    w, array = weight
    x = np.random.default_rng(2).standard_normal((13, array.shape[1]), dtype=np.float32)
    alone = np.concatenate([products(w, x[i : i + 1], Allocator(), 1, op) for i in range(13)])
    for count in (2, 3, 5, 6, 13):
        assert np.array_equal(products(w, x[:count], Allocator(), 1, op), alone[:count])
    assert np.array_equal(products(w, x[::-1], Allocator(), 2, op), alone[::-1])


def test_the_decoder_s_products_of_few_columns_run_on_it(weight):
    """`codec.Matrix` on ggml's graphs multiplies on the kernel where it runs, one column as
    several (the padded one-column path is ggml's only)."""
    _, array = weight
    matrix = Matrix(array)
    matrix.allocator, matrix.by_column, matrix.variant = Allocator(), True, f32_product.chosen()
    x = np.random.default_rng(3).standard_normal((array.shape[1], 4), dtype=np.float32)
    together = matrix(x)
    assert np.array_equal(together[:, :1], matrix(np.ascontiguousarray(x[:, :1])))
    tensor = ArrayTensor(array)
    expected = products(tensor.tensor, x.T.copy(), Allocator(), 1, f32_product.product)
    tensor.close()
    assert np.array_equal(together, expected.T)


@pytest.fixture(params=native.VARIANTS)
def variant(request):
    if request.param not in f32_product.variants():
        pytest.skip(f"this CPU does not run the {request.param} variant")
    return request.param


def _direct(array: np.ndarray, variant: str, column_major: bool) -> Matrix:
    matrix = Matrix(array, column_major)
    matrix.multiply_directly(variant)
    return matrix


def test_called_directly_it_gives_the_product_to_float_rounding_and_a_column_its_numbers_alone(
    weight, variant
):
    """W packed in panels for columns of contiguous numbers (tiles of up to 4 panels by 6
    columns, the rows padded to whole panels), or in place for rows of contiguous numbers
    (tiles of up to 6 rows by 4 vectors of columns, the last masked): bit for bit alone, among
    2 to 70 columns, at any place among them; the same numbers either way."""
    _, array = weight
    x = np.random.default_rng(4).standard_normal((array.shape[1], 70), dtype=np.float32)
    exact = array.astype(np.float64) @ x.astype(np.float64)
    results = []
    for column_major in (True, False):
        matrix = _direct(array, variant, column_major)
        order = "F" if column_major else "C"
        ours = matrix(np.asarray(x, order=order))
        assert ours.shape == exact.shape and np.abs(ours - exact).max() <= 2e-6 * np.abs(exact).max()
        alone = np.concatenate([matrix(np.asarray(x[:, i : i + 1], order=order)) for i in range(70)], axis=1)
        for count in (2, 5, 6, 7, 17, 70):
            assert np.array_equal(matrix(np.asarray(x[:, -count:], order=order)), alone[:, -count:])
        out = np.full((array.shape[0] + 3, 70), np.nan, np.float32, order=order)[1:-2]
        assert matrix(x, out=out) is out and np.array_equal(out, alone)  # a view of a buffer, either layout
        results.append(alone)
    assert np.array_equal(*results)


def test_both_variants_give_the_same_numbers_called_directly(weight):
    """Each element is one chain of fmadds over the inner index, in order, on either variant."""
    if len(f32_product.variants()) < 2:
        pytest.skip("this CPU runs one variant")
    _, array = weight
    x = np.random.default_rng(5).standard_normal((array.shape[1], 9), dtype=np.float32)
    a, b = (_direct(array, variant, False)(x) for variant in f32_product.variants())
    assert np.array_equal(a, b)


def test_it_can_be_turned_off_or_held_to_avx2(monkeypatch):
    try:
        monkeypatch.setenv(f32_product.ENV, "0")
        f32_product.chosen.cache_clear()
        assert f32_product.chosen() is None
        monkeypatch.setenv(f32_product.ENV, "avx2")
        f32_product.chosen.cache_clear()
        assert f32_product.chosen() == "avx2"
    finally:
        monkeypatch.undo()
        f32_product.chosen.cache_clear()
