"""Our SnakeBeta kernel (each variant this CPU runs) against the formula in float64, and what the
decoder needs of it: rows of any length, in place, the same numbers alone or among streams."""

from __future__ import annotations

import numpy as np
import pytest

from kazeia_stream.engine import native, snake
from kazeia_stream.engine.codec_layers import SnakeBeta

pytestmark = pytest.mark.skipif(
    not snake.variants(), reason="the kernel is not built, or this CPU lacks AVX2"
)


@pytest.fixture(params=native.VARIANTS)
def variant(request) -> str:
    if request.param not in snake.variants():
        pytest.skip(f"this CPU does not run the {request.param} variant")
    return request.param


def formula(x: np.ndarray, alpha: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """The formula in float64 from alpha * x in float32 (as the official float32 code has it:
    for alpha * x ~ 1e5, its rounding alone moves sin by 4e-3)."""
    t = (x * alpha[:, None]).astype(np.float64)
    return x.astype(np.float64) + beta[:, None].astype(np.float64) * np.sin(t) ** 2


def weights(rows: int, scale: float = 3.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.random(rows) * scale + 0.1).astype(np.float32), (rng.random(rows) + 0.5).astype(np.float32)


def run(x: np.ndarray, alpha: np.ndarray, beta: np.ndarray, variant: str) -> np.ndarray:
    return snake.snake(x, alpha, beta, np.empty_like(x), variant)


@pytest.mark.parametrize("cols", [*range(1, 34), 160, 1920])
def test_rows_of_any_length_match_the_formula(variant, cols):
    """Every tail of a row (masked or through a copy) and whole registers."""
    x = (np.random.default_rng(cols).standard_normal((5, cols)) * 5).astype(np.float32)
    alpha, beta = weights(5)
    np.testing.assert_allclose(run(x, alpha, beta, variant), formula(x, alpha, beta), rtol=3e-7, atol=3e-7)


def test_the_variants_give_the_same_bits():
    if len(snake.variants()) < 2:
        pytest.skip("this CPU runs one variant")
    x = (np.random.default_rng(1).standard_normal((7, 333)) * 5).astype(np.float32)
    alpha, beta = weights(7)
    a, b = (run(x, alpha, beta, v) for v in snake.variants())
    assert np.array_equal(a, b)


def test_arguments_beyond_the_reduction_take_libm_s_sin(variant):
    """sin(alpha x) for alpha x from 1e3 to 1e7 (the fast reduction stops at 8192): x near 1, so
    that an error in sin^2 shows."""
    x = (1 + np.random.default_rng(2).random((1, 64)) * 1e-3).astype(np.float32)
    alpha = np.array([1.0], np.float32)
    beta = np.array([0.75], np.float32)
    for scale in (1e3, 1e4, 1e5, 1e7):
        a = alpha * np.float32(scale)
        np.testing.assert_allclose(run(x, a, beta, variant), formula(x, a, beta), rtol=3e-7, atol=3e-7)


def test_one_argument_beyond_the_reduction_within_a_long_row(variant):
    """Registers taken several at a time up to it, and one at a time from there (AVX2)."""
    x = (np.random.default_rng(3).standard_normal((2, 200)) * 3).astype(np.float32)
    x[0, 77] = 5e4
    alpha, beta = weights(2)
    np.testing.assert_allclose(run(x, alpha, beta, variant), formula(x, alpha, beta), rtol=3e-7, atol=3e-7)


def test_nan_and_infinity_propagate_as_in_the_formula(variant):
    x = np.array([[np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30]], np.float32)
    alpha, beta = np.ones(1, np.float32), np.ones(1, np.float32)
    got = run(x, alpha, beta, variant)
    with np.errstate(invalid="ignore"):  # sin(inf)
        want = formula(x, alpha, beta)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)].astype(np.float32))


def test_in_place_and_in_a_wider_buffer(variant):
    """The decoder writes a layer's output into the next one's context buffer: rows with a stride
    longer than the row, and out may be x (whichever way an element is computed); nothing
    outside the view is touched."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 45)) * 5).astype(np.float32)
    alpha, beta = weights(6)
    alpha[0] = 5e4  # most of the first row beyond the fast reduction: libm's sin in place too
    buf = np.full((6, 70), 7.0, np.float32)
    view = buf[:, 10:55]
    view[...] = x
    snake.snake(view, alpha, beta, view, variant)
    assert np.array_equal(buf[:, 10:55], run(x, alpha, beta, variant))
    np.testing.assert_allclose(buf[:, 10:55], formula(x, alpha, beta), rtol=3e-7, atol=3e-7)
    assert (buf[:, :10] == 7).all() and (buf[:, 55:] == 7).all()


def test_a_stream_s_columns_among_others_give_its_numbers_alone():
    """One stream's columns out of several (every fourth) are copied, not sent elsewhere."""
    rng = np.random.default_rng(4)
    alpha, beta = weights(8)
    layer = SnakeBeta(alpha, beta)
    joint = (rng.standard_normal((8, 4 * 30)) * 5).astype(np.float32)
    one = joint.reshape(8, 30, 4)[:, :, 2]
    assert one.strides[1] != 4
    assert np.array_equal(layer(one), layer(np.ascontiguousarray(one)))
