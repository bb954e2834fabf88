"""Our float32 product kernel (each variant this CPU runs), called directly as the codec decoder
calls it, against float64, and what the decoder needs of it: a column's numbers whatever columns
come with it, the same on either layout and variant."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kazeia_stream.engine import f32_product, native
from kazeia_stream.engine.matrix import Matrix

pytestmark = pytest.mark.skipif(
    not f32_product.variants(), reason="the kernel is not built, or this CPU lacks AVX2"
)


@pytest.fixture(scope="module", params=[(37, 100), (130, 768), (5, 96)], ids=lambda s: f"{s[0]}x{s[1]}")
def weight(request) -> np.ndarray:
    """A float32 weight [m, k]: 37 x 100 has rows that fill no panel of 16 and no tile of 6;
    130 x 768 fills them but its last rows; 5 x 96 has fewer rows than a tile (the decoder's
    last convolution has one)."""
    m, k = request.param
    return np.random.default_rng(m).standard_normal((m, k), dtype=np.float32)


@pytest.fixture(params=native.VARIANTS)
def variant(request) -> str:
    if request.param not in f32_product.variants():
        pytest.skip(f"this CPU does not run the {request.param} variant")
    return request.param


def _direct(array: np.ndarray, variant: str, panels: bool) -> Matrix:
    matrix = Matrix(array)
    matrix.multiply_directly(variant, panels)
    return matrix


def test_it_gives_the_product_to_float_rounding_and_a_column_its_numbers_alone(weight, variant):
    """W packed in panels, for columns of contiguous numbers (tiles of up to 4 panels by 6
    columns, the rows padded to whole panels), or in place, for rows of contiguous numbers
    (tiles of up to 6 rows by 4 vectors of columns on AVX-512, by 16 columns copied together
    on AVX2, fewer rows than 6 by 3 vectors; the last columns masked where they are partial):
    bit for bit alone, among 2 to 70 columns, at any place among them; the same numbers
    either way."""
    x = np.random.default_rng(4).standard_normal((weight.shape[1], 70), dtype=np.float32)
    exact = weight.astype(np.float64) @ x.astype(np.float64)
    results = []
    for panels in (True, False):
        matrix = _direct(weight, variant, panels)
        assert matrix.array.ndim == (3 if panels else 2)
        order = "F" if panels else "C"
        ours = matrix(np.asarray(x, order=order))
        assert ours.shape == exact.shape and np.abs(ours - exact).max() <= 2e-6 * np.abs(exact).max()
        alone = np.concatenate([matrix(np.asarray(x[:, i : i + 1], order=order)) for i in range(70)], axis=1)
        for count in (2, 5, 6, 7, 8, 16, 17, 24, 48, 70):
            assert np.array_equal(matrix(np.asarray(x[:, -count:], order=order)), alone[:, -count:])
        for layout in ("C", "F"):  # a view of a buffer either way (copied where it must be)
            out = np.full((weight.shape[0] + 3, 70), np.nan, np.float32, order=layout)[1:-2]
            assert matrix(x, out=out) is out and np.array_equal(out, alone)
        assert matrix(np.asarray(x, order="F" if panels else "C")).flags.c_contiguous
        results.append(alone)
    assert np.array_equal(*results)


@pytest.mark.parametrize("shape", [(37, 100), (300, 257)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_panels_hold_16_rows_each_column_by_column_the_last_padded_with_zeros(shape, dtype):
    """`pack`'s layout, for either layout of W; 300 x 257 crosses its tiles of 8 panels by 128
    columns (a tile's last panel and columns cut short)."""
    m, k = shape
    weight = np.random.default_rng(m).standard_normal(shape).astype(dtype)
    padded = np.zeros((-(-m // 16) * 16, k), dtype)
    padded[:m] = weight
    expected = padded.reshape(-1, 16, k).transpose(0, 2, 1)
    for w in (weight, np.ascontiguousarray(weight.T).T):
        packed = f32_product.pack(w)
        assert packed.dtype == dtype and np.array_equal(packed, expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_transposed_view_packs_as_its_copy(weight, dtype):
    """The transposed convs' weights are packed from the file's layout seen transposed."""
    weight = weight.astype(dtype)
    view = np.ascontiguousarray(weight.T).T
    assert not view.flags.c_contiguous
    assert np.array_equal(f32_product.pack(view), f32_product.pack(weight))
    assert np.array_equal(Matrix(view).array, weight)  # widened, C-ordered


def test_float16_weights_give_their_float32_s_numbers_from_half_the_bytes(weight, variant):
    """A weight stored in float16 (as a file may hold the decoder's) is packed in float16
    panels, widened in the registers: the numbers of the same weight widened to float32, from
    half the bytes. In place (rows of contiguous numbers) it is widened once, at the load."""
    half = weight.astype(np.float16)
    x = np.random.default_rng(6).standard_normal((weight.shape[1], 13), dtype=np.float32)
    wide, narrow = _direct(half.astype(np.float32), variant, True), _direct(half, variant, True)
    assert narrow.array.dtype == np.float16 and 2 * narrow.array.nbytes == wide.array.nbytes
    assert np.array_equal(narrow(np.asarray(x, order="F")), wide(np.asarray(x, order="F")))
    in_place = _direct(half, variant, False)
    assert in_place.array.dtype == np.float32 and np.array_equal(in_place(x), wide(x))


@pytest.mark.parametrize("threads", [2, 3, 12])
def test_a_team_shares_a_product_by_rows_and_gives_its_numbers_alone(variant, threads):
    """In a `Team`, a product of enough multiply-adds is shared by rows among its threads, whole
    panels each (12 threads for 9 panels: some take none), the caller's and its helpers': every
    element as alone, for W in panels of either type and in place, 130 rows filling no last
    panel. A small product runs on its caller alone. The helpers end with the block."""
    rng = np.random.default_rng(threads)
    weight = rng.standard_normal((130, 768), dtype=np.float32)
    x = rng.standard_normal((768, 70), dtype=np.float32)
    matrices = [_direct(weight, variant, True), _direct(weight.astype(np.float16), variant, True)]
    matrices.append(_direct(weight, variant, False))
    for matrix in matrices:
        order = "F" if matrix.panels else "C"
        columns, column = np.asarray(x, order=order), np.asarray(x[:, :1], order=order)
        alone, one = matrix(columns), matrix(column)
        with f32_product.threads(threads) as team:
            assert team is not None
            for shared, (x_in, expected) in enumerate([(columns, alone), (column, one), (columns, alone)]):
                out = np.full(expected.shape, np.nan, np.float32, order=order)
                assert matrix(x_in, out=out) is out and np.array_equal(out, expected)
                assert team.shared == (1 if shared < 2 else 2)  # a column: 0.1 M multiply-adds
        assert not [t for t in threading.enumerate() if t.name == "kazeia-product"]
    with f32_product.threads(1) as team:
        assert team is None


def test_both_variants_give_the_same_numbers(weight):
    """Each element is one chain of fmadds over the inner index, in order, on either variant."""
    if len(f32_product.variants()) < 2:
        pytest.skip("this CPU runs one variant")
    x = np.random.default_rng(5).standard_normal((weight.shape[1], 9), dtype=np.float32)
    for panels in (True, False):
        a, b = (_direct(weight, variant, panels)(x) for variant in f32_product.variants())
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
