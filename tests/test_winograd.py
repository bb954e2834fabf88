"""Winograd's F(4, 7) and F(6, 7) for the decoder's dilated convolutions: the algorithm, the
tilings, and our transforms' kernel against the direct convolution."""

from __future__ import annotations

import numpy as np
import pytest

from kazeia_stream.engine import f32_product, winograd

needs_kernel = pytest.mark.skipif(not winograd.available(), reason="our kernels are not built here")
tilings = pytest.mark.parametrize("m", winograd.OUTPUTS)


@tilings
def test_the_algorithm_is_the_correlation_of_seven_taps(m):
    a_t, g, b_t = winograd.matrices(m)
    rng = np.random.default_rng(0)
    taps, x = rng.standard_normal(7), rng.standard_normal(m + 6)
    y = a_t @ ((g @ taps) * (b_t @ x))
    np.testing.assert_allclose(y, [taps @ x[i : i + 7] for i in range(m)], rtol=1e-12)
    assert a_t.shape == (m, m + 6) and g.shape == (m + 6, 7) and b_t.shape == (m + 6, m + 6)


@tilings
def test_the_matrices_have_the_symmetry_the_kernel_uses(m):
    """winograd.c takes B^T's row 0 on the even inputs only, its last row (P - 1, P = m + 6) on
    the odd ones, rows 1 to P - 2 in pairs E + O and E - O (E on the even inputs 2 to P - 2, O
    on the odd ones 1 to P - 3), A^T's even rows on the sum and its odd rows on the difference
    of each pair of products, point 0 (column 0) in output 0 only and infinity (column P - 1)
    in the last output only: the points come in pairs +p and -p."""
    a_t, _, b_t = winograd.matrices(m)
    last = m + 5
    assert not b_t[0, 1::2].any() and not b_t[last, ::2].any()
    for k in range(1, last, 2):
        assert not b_t[k : k + 2, [0, last]].any()
        np.testing.assert_array_equal(b_t[k + 1, ::2], b_t[k, ::2])
        np.testing.assert_array_equal(b_t[k + 1, 1::2], -b_t[k, 1::2])
        np.testing.assert_array_equal(a_t[:, k + 1], a_t[:, k] * (-1.0) ** np.arange(m))
    assert not a_t[1:, 0].any() and not a_t[:-1, last].any()


@tilings
@pytest.mark.parametrize("cols", [1, 2, 3, 5, 17, 32, 33, 160])
@pytest.mark.parametrize("d", [1, 2, 3, 9, 18, 27])
def test_the_tiles_cover_every_output_once(m, cols, d):
    outputs = []
    for col, count, step, n in winograd.plan(cols, d, m):
        outputs += [col + i * step + j * d for i in range(count) for j in range(n)]
        assert 1 <= n <= m
    assert sorted(outputs) == list(range(cols))
    # d tiles in every block of m d columns, then one for each of the next d columns at most
    assert winograd.tiles(cols, d, m) == cols // (m * d) * d + min(d, cols % (m * d))
    if cols % (m * d) == 0:
        assert set(winograd.plan(cols, d, m)[:, 3]) == {m}


@pytest.mark.parametrize(("cols", "d"), [(32, 1), (32, 3), (32, 9), (160, 9), (640, 3), (1920, 9), (5, 2)])
def test_a_convolution_takes_the_tiling_of_fewest_multiply_adds(cols, d):
    """F(6, 7) makes 6 outputs in 12 products, F(4, 7) 4 in 10; a frame of 32 columns with a
    dilation of 9 (the 0.6B's first block) fills no tile of 6 and as many tiles of 4, so it
    takes F(4, 7)."""
    cost = {m: winograd.tiles(cols, d, m) * winograd.size(m) for m in winograd.OUTPUTS}
    chosen = winograd.fewest(cols, d)
    assert cost[chosen] == min(cost.values())
    assert chosen == (4 if (cols, d) in [(32, 9), (5, 2)] else 6)


@tilings
@pytest.mark.parametrize(("cols", "d"), [(1920, 1), (1920, 3), (640, 9), (600, 27), (257, 1), (33, 2)])
def test_chunks_take_the_plan_s_tiles_in_order(m, cols, d):
    parts = winograd.chunks(cols, d, m)
    tiles = [
        (c.start + col + i * step, outs) for c in parts for col, n, step, outs in c.runs for i in range(n)
    ]
    planned = [(col + i * step, outs) for col, n, step, outs in winograd.plan(cols, d, m) for i in range(n)]
    assert tiles == planned
    sizes = [c.tiles for c in parts]
    assert max(sizes) <= winograd.CHUNK_TILES and max(sizes) - min(sizes) <= len(sizes)
    for c in parts:  # the columns each chunk reads: its tiles' inputs, within the buffer
        reads = [
            c.start + col + i * step + u * d
            for col, n, step, outs in c.runs
            for i in range(n)
            for u in range(6 + outs)
        ]
        assert min(reads) == c.start and max(reads) == c.start + c.width - 1 <= 6 * d + cols - 1


def _direct(w: np.ndarray, bias: np.ndarray, buf: np.ndarray, cols: int, d: int) -> np.ndarray:
    """The causal convolution in float64: output t's taps are columns t + j d of buf."""
    w, buf = w.astype(np.float64), buf.astype(np.float64)
    return bias[:, None] + sum(w[:, :, j] @ buf[:, j * d : j * d + cols] for j in range(7))


def _tiled(
    w: np.ndarray, bias: np.ndarray, buf: np.ndarray, cols: int, d: int, m: int, frame: int = 0
) -> np.ndarray:
    """The convolution as the decoder runs it in F(m, 7): our kernels' transforms and products,
    in one call."""
    packed = [f32_product.pack(u_k) for u_k in winograd.kernel_weights(w, m)]
    products = winograd.Products.of(packed, w.shape[:2], f32_product.chosen(), m)
    y = np.full((len(w), cols), np.nan, np.float32)
    winograd.convolve(buf, cols, d, frame, products, bias, y)
    return y


@needs_kernel
@tilings
@pytest.mark.parametrize(
    ("c_in", "c_out", "cols", "d"),
    [(16, 8, 32, 9), (5, 12, 33, 2), (96, 32, 640, 1), (8, 8, 1920, 3), (24, 4, 7, 3), (9, 9, 1, 1)],
)
def test_the_transforms_and_products_are_the_direct_convolution(m, c_in, c_out, cols, d):
    rng = np.random.default_rng(cols + d)
    w = rng.standard_normal((c_out, c_in, 7)).astype(np.float32)
    bias = rng.standard_normal(c_out).astype(np.float32)
    buf = rng.standard_normal((c_in, 6 * d + cols + 3)).astype(np.float32)[:, : 6 * d + cols]  # rows apart
    expected = _direct(w, bias, buf, cols, d)
    y = _tiled(w, bias, buf, cols, d, m)
    assert y.dtype == np.float32 and y.shape == (c_out, cols) and not np.isnan(y).any()
    # float32's rounding, amplified by the transforms, of the largest output here: 2.0e-6 to
    # 6.7e-6 in F(4, 7), 4.9e-6 to 8.9e-6 in F(6, 7), against 3e-7 for the direct products
    assert np.abs(y - expected).max() < {4: 1e-5, 6: 1.5e-5}[m] * np.abs(expected).max()


@needs_kernel
@tilings
def test_a_tile_s_numbers_do_not_depend_on_the_tiles_beside_it(m):
    """A frame of the first block for one stream, and for three streams side by side (stream
    index fastest, so d and the columns scale by 3): the same bits for each stream."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((16, 16, 7)).astype(np.float32)
    bias = rng.standard_normal(16).astype(np.float32)
    bufs = [rng.standard_normal((16, 6 * 9 + 32)).astype(np.float32) for _ in range(3)]
    joint = np.stack(bufs, axis=2).reshape(16, -1)
    together = _tiled(w, bias, joint, 32 * 3, 9 * 3, m).reshape(16, 32, 3)
    for s, buf in enumerate(bufs):
        alone = _tiled(w, bias, buf, 32, 9, m)
        np.testing.assert_array_equal(together[:, :, s], alone)


@tilings
@pytest.mark.parametrize(("cols", "d"), [(32, 1), (32, 3), (32, 9), (160, 27), (5, 2)])
def test_a_call_of_several_frames_tiles_each_as_a_call_of_it_alone(m, cols, d):
    frames = [winograd.plan(cols, d, m) + np.array([i * cols, 0, 0, 0]) for i in range(3)]
    np.testing.assert_array_equal(winograd.plan(3 * cols, d, m, cols), np.concatenate(frames))
    assert winograd.tiles(3 * cols, d, m, cols) == 3 * winograd.tiles(cols, d, m)
    with pytest.raises(ValueError, match="whole frames"):
        winograd.plan(3 * cols + 1, d, m, cols)


@needs_kernel
@tilings
def test_a_push_of_several_frames_gives_each_frame_s_bits_alone(m):
    """The first block's conv of dilation 9 (tiles of fewer outputs at each frame's end): three
    frames in one call, and each frame in a call of its own, its context the frames before."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((16, 16, 7)).astype(np.float32)
    bias = rng.standard_normal(16).astype(np.float32)
    buf = rng.standard_normal((16, 6 * 9 + 3 * 32)).astype(np.float32)
    together = _tiled(w, bias, buf, 3 * 32, 9, m, frame=32)
    for i in range(3):
        alone = _tiled(w, bias, np.ascontiguousarray(buf[:, 32 * i :]), 32, 9, m)
        np.testing.assert_array_equal(together[:, 32 * i : 32 * (i + 1)], alone)
    assert not np.array_equal(_tiled(w, bias, buf, 3 * 32, 9, m), together)  # tiled as one frame: other bits


def test_kazeia_winograd_0_asks_for_the_direct_products(monkeypatch):
    monkeypatch.setenv(winograd.ENV, "0")
    assert not winograd.available()


@needs_kernel
@tilings
def test_products_shared_by_a_team_give_the_same_bits(m):
    """The decoder's first frames share each product's rows with a helper thread."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((48, 40, 7)).astype(np.float32)
    bias = rng.standard_normal(48).astype(np.float32)
    buf = rng.standard_normal((40, 6 * 3 + 1920)).astype(np.float32)
    alone = _tiled(w, bias, buf, 1920, 3, m)
    with f32_product.Team(2) as team:
        shared = _tiled(w, bias, buf, 1920, 3, m)
    assert team.shared == winograd.size(m) * len(winograd.chunks(1920, 3, m))
    np.testing.assert_array_equal(shared, alone)
