"""A transposed convolution's overlap-add (`engine/overlap_add.py`): the C loop gives numpy's
bits, both follow the rule, and calls over chunks of the input give one call's output."""

from __future__ import annotations

import numpy as np
import pytest

from kazeia_stream.engine import overlap_add

F32 = np.float32
# (C_out, k, stride): the decoder's blocks (k = 2 s), its upsampling (k = s), and one between
SHAPES = [(5, 6, 3), (3, 16, 8), (4, 2, 2), (6, 4, 3)]


def _numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(overlap_add, "_function", lambda: None)


def _random(
    rng: np.random.Generator, c_out: int, k: int, stride: int, n: int, streams: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    z = rng.standard_normal((c_out, k, n, streams), dtype=F32)
    bias = rng.standard_normal((c_out, 1, 1), dtype=F32)
    tail = rng.standard_normal((k - stride, c_out, streams), dtype=F32)
    return z, bias, tail


@pytest.mark.skipif(not overlap_add.built(), reason="the C loop is not built")
@pytest.mark.parametrize("streams", [1, 3])
@pytest.mark.parametrize("n", [1, 7])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_c_loop_gives_numpy_s_bits(monkeypatch, shape, n, streams):
    z, bias, tail = _random(np.random.default_rng(n * streams), *shape, n, streams)
    c_tail = tail.copy()
    c = overlap_add.overlap_add(z, bias, c_tail, shape[2])
    _numpy(monkeypatch)
    expected = overlap_add.overlap_add(z, bias, tail, shape[2])
    assert np.array_equal(c, expected) and np.array_equal(c_tail, tail)


@pytest.mark.parametrize("on_numpy", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_chunks_give_the_transposed_convolution_of_the_whole_input(monkeypatch, shape, on_numpy):
    """Each input time step t adds tap m to output t * stride + m (the taps beyond the last
    step's outputs carried to the next call), for three streams, over chunks of 1, 3 and 2
    steps: the outputs of one call over all six steps, bit for bit, and the formula's in
    float64."""
    if on_numpy:
        _numpy(monkeypatch)
    c_out, k, stride = shape
    streams, steps = 3, 6
    z, bias, _ = _random(np.random.default_rng(7), c_out, k, stride, steps, streams)
    whole = overlap_add.overlap_add(z, bias, np.zeros((k - stride, c_out, streams), F32), stride)
    tail, pieces, start = np.zeros((k - stride, c_out, streams), F32), [], 0
    for size in (1, 3, 2):
        chunk = np.ascontiguousarray(z[:, :, start : start + size])
        pieces.append(overlap_add.overlap_add(chunk, bias, tail, stride))
        start += size
    assert np.array_equal(np.concatenate(pieces, axis=1), whole)
    expected = np.zeros((c_out, steps * stride + k, streams))
    expected[:, : steps * stride] += bias
    for t in range(steps):
        expected[:, t * stride : t * stride + k] += z[:, :, t]
    expected = expected[:, : steps * stride].reshape(c_out, -1)
    np.testing.assert_allclose(whole, expected, rtol=1e-6, atol=1e-6)
    assert np.array_equal(tail, z[:, stride:, -1].transpose(1, 0, 2))
