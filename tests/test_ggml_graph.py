"""Our graphs on the bundled libggml (`engine/ggml_graph.py`): what a caller may rely on."""

from __future__ import annotations

import gc
import weakref

import numpy as np

from kazeia_stream.engine.ggml_graph import Allocator, ArrayTensor, products


def test_a_tensor_over_an_array_keeps_the_array_alive():
    """A tensor made over a temporary must not read freed memory once the caller drops it."""
    w = np.random.default_rng(0).standard_normal((8, 64), dtype=np.float32)
    array = w.copy()
    alive = weakref.ref(array)
    tensor = ArrayTensor(array)
    del array
    gc.collect()
    assert alive() is not None
    x = np.ones((1, 64), np.float32)
    np.testing.assert_allclose(products(tensor.tensor, x, Allocator()), x @ w.T, rtol=1e-5)
    tensor.close()
