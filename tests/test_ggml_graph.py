"""Our graphs on the bundled libggml (`engine/ggml_graph.py`): what a caller may rely on."""

from __future__ import annotations

import ctypes
import gc
import shutil
import sys
import weakref

import numpy as np
import pytest

from kazeia_stream.engine import ggml_graph
from kazeia_stream.engine.ggml_graph import Allocator, ArrayTensor, Weights, products
from kazeia_stream.errors import ModelFileError
from kazeia_stream.ggml_lib import ggml
from kazeia_stream.model.gguf_file import GGUFFile


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


@pytest.fixture(params=[True, False], ids=["huge pages", "mapped"])
def weights_way(request, monkeypatch):
    """Weights read onto huge pages, or left in the file's mapping (a kernel without them)."""
    monkeypatch.setattr(ggml_graph, "huge_pages", lambda: request.param)
    return request.param


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                first, last = (int(a, 16) for a in head.split("-"))
                inside = first <= address < last
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError("no mapping holds the address")


def test_weights_hold_the_file_s_bytes_either_way(tiny_gguf, weights_way):
    talker = GGUFFile(tiny_gguf("custom_voice", "q8_0")[0])
    names = [n for n in talker.tensor_names if n.endswith(("ffn_up.weight", "attn_norm.weight"))]
    weights = Weights(talker, {n: n for n in names})
    try:
        for name in names:
            data = ggml.ggml_get_data(weights[name])
            size = talker.span(name)[1]
            held = np.frombuffer((ctypes.c_uint8 * size).from_address(data), np.uint8)
            np.testing.assert_array_equal(held, np.asarray(talker.raw(name)).view(np.uint8).reshape(-1))
            in_mapping = talker.mapping.ctypes.data <= data < talker.mapping.ctypes.data + len(talker.mapping)
            assert in_mapping != weights_way
            if weights_way and sys.platform == "linux":
                assert "hg" in _vm_flags(data)  # madvise(MADV_HUGEPAGE)
    finally:
        weights.close()


def test_a_file_cut_short_after_it_was_checked_is_a_model_file_error(tiny_gguf, tmp_path, monkeypatch):
    """Read onto huge pages, a tensor the file no longer holds whole is an error; from a
    mapping it would be a SIGBUS at its first use."""
    monkeypatch.setattr(ggml_graph, "huge_pages", lambda: True)
    path = tmp_path / "talker.gguf"
    shutil.copy(tiny_gguf("custom_voice", "q8_0")[0], path)
    talker = GGUFFile(path)
    last = max(talker.tensor_names, key=lambda n: talker.span(n)[0])
    with open(path, "r+b") as f:
        f.truncate(talker.span(last)[0] + 1)
    with pytest.raises(ModelFileError, match="could not be read whole"):
        Weights(talker, {last: last})
