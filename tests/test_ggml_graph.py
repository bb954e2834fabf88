"""Our graphs on the bundled libggml (`engine/ggml_graph.py`): what a caller may rely on."""

from __future__ import annotations

import ctypes
import gc
import mmap
import shutil
import sys
import weakref
from pathlib import Path

import gguf
import numpy as np
import pytest
from page_cache import cached_pages, in_memory

from kazeia_stream.engine import cache_files, ggml_graph
from kazeia_stream.engine.ggml_graph import Allocator, ArrayTensor, Weights, products
from kazeia_stream.errors import ModelFileError
from kazeia_stream.ggml_lib import ggml, widen
from kazeia_stream.model.gguf_file import GGUFFile, drop_from_page_cache


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
    """Weights on huge pages (in place or copied), or in the file's mapping (a kernel without them)."""
    monkeypatch.setattr(ggml_graph, "huge_pages", lambda: request.param)
    return request.param


def _mapping_field(address: int, field: str) -> list[str]:
    """A field of the mapping that holds `address` (/proc/self/smaps), e.g. VmFlags."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                first, last = (int(a, 16) for a in head.split("-"))
                inside = first <= address < last
            elif inside and head == f"{field}:":
                return line.split()[1:]
    raise AssertionError("no mapping holds the address")


def test_weights_hold_the_file_s_bytes_every_way(tiny_gguf, weights_way):
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
            assert in_mapping != weights.copied and (in_mapping or weights_way)
            if weights_way and sys.platform == "linux":  # in place or copied
                assert "hg" in _mapping_field(data, "VmFlags")  # madvise(MADV_HUGEPAGE)
    finally:
        weights.close()


BIG = np.arange(2048 * 4096, dtype=np.float32).reshape(2048, 4096)  # 32 MB: 16 huge pages


def _big_gguf(path: Path) -> Path:
    """A GGUF file of one 32 MB tensor, written and then out of the page cache."""
    writer = gguf.GGUFWriter(str(path), "test")
    writer.add_tensor("w", BIG)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    drop_from_page_cache(path)
    return path


def _pmd_mapped(address: int) -> int:
    """Bytes of the file's mapping that holds `address` mapped on huge pages."""
    return int(_mapping_field(address, "FilePmdMapped")[0]) * 1024


def _read_mapped(path: Path, advice: int, start: int = 0) -> int:
    """Read the pages of `path` from byte `start` on through a mapping of it given `advice`
    (madvise): the bytes that were then mapped on huge pages."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        m.madvise(advice)
        view = np.frombuffer(m, np.uint8)
        int(view[start :: mmap.PAGESIZE].sum())
        huge = _pmd_mapped(view.ctypes.data)
        del view  # before the mapping closes
    return huge


def _held(weights: Weights, f: GGUFFile) -> np.ndarray:
    """The bytes of `weights`' tensor "w", as float32."""
    size = f.span("w")[1]
    return np.frombuffer((ctypes.c_uint8 * size).from_address(ggml.ggml_get_data(weights["w"])), np.float32)


@pytest.fixture(scope="module")
def huge_file_pages(tmp_path_factory) -> None:
    """Skips where this kernel, or the file system the tests write to, maps no file on huge
    pages (without `Weights`: a mapping that asks for them, over a file out of the cache)."""
    if not ggml_graph.huge_pages():
        pytest.skip("no transparent huge pages")
    if not _read_mapped(_big_gguf(tmp_path_factory.mktemp("probe") / "probe.gguf"), mmap.MADV_HUGEPAGE):
        pytest.skip("no huge pages for a file's mapping here")


def test_weights_stay_in_place_where_the_page_cache_holds_them_on_huge_pages(tmp_path, huge_file_pages):
    f = GGUFFile(_big_gguf(tmp_path / "big.gguf"))
    weights = Weights(f, {"w": "w"})
    try:
        data, size = ggml.ggml_get_data(weights["w"]), f.span("w")[1]
        assert not weights.copied and data == f.mapping.ctypes.data + f.span("w")[0]
        assert _pmd_mapped(data) >= ggml_graph.IN_PLACE_HUGE_SHARE * size
        np.testing.assert_array_equal(_held(weights, f), BIG.reshape(-1))
    finally:
        weights.close()


@pytest.mark.skipif(not ggml_graph.huge_pages(), reason="no transparent huge pages")
def test_weights_cached_in_small_pieces_are_copied_and_not_held_twice(tmp_path):
    """Copied onto huge pages of our own; the file's pages this load mapped to look are
    unmapped again, and the page cache keeps them (no sign that this file system would read
    the file in huge pieces: dropped, it would be read again at every load)."""
    path = _big_gguf(tmp_path / "big.gguf")
    assert not _read_mapped(path, mmap.MADV_RANDOM)  # a page a fault: the cache in 4 KiB pieces
    f = GGUFFile(path)
    weights = Weights(f, {"w": "w"})
    try:
        size = f.span("w")[1]
        assert weights.copied and "hg" in _mapping_field(ggml.ggml_get_data(weights["w"]), "VmFlags")
        assert int(_mapping_field(f.mapping.ctypes.data, "Rss")[0]) * 1024 < size / 100
        assert cached_pages(path) >= size // mmap.PAGESIZE
        np.testing.assert_array_equal(_held(weights, f), BIG.reshape(-1))
    finally:
        weights.close()


def test_weights_cached_partly_in_small_pieces_are_copied_then_kept_in_place(tmp_path, huge_file_pages):
    """Some on huge pages, the rest in small pieces: copied, and the page cache lets go of the
    file, so that the next load reads it in huge pieces and keeps them in place."""
    path = _big_gguf(tmp_path / "big.gguf")
    half = _read_mapped(path, mmap.MADV_HUGEPAGE, start=BIG.nbytes // 2)
    assert half and _read_mapped(path, mmap.MADV_RANDOM) == half  # the first half in 4 KiB pieces
    f = GGUFFile(path)
    weights = Weights(f, {"w": "w"})
    try:
        assert weights.copied and cached_pages(path) < f.span("w")[1] / mmap.PAGESIZE / 100
        np.testing.assert_array_equal(_held(weights, f), BIG.reshape(-1))
    finally:
        weights.close()
    f = GGUFFile(path)
    again = Weights(f, {"w": "w"})
    try:
        assert not again.copied and _pmd_mapped(ggml.ggml_get_data(again["w"])) >= 0.9 * BIG.nbytes
        np.testing.assert_array_equal(_held(again, f), BIG.reshape(-1))
    finally:
        again.close()


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="Linux")
def test_memory_is_resident_where_written_or_populated_and_given_back_in_whole_pieces(weights_way):
    """Pieces of `page` bytes: huge pages where the kernel gives them (the mapping asks), else
    4 KiB, and 4 KiB where a tensor is smaller than a huge page. A release gives back the
    pieces wholly within its range, and keeps the rest; `populate` makes every piece its range
    touches resident, their contents unchanged."""
    small = ggml_graph.Memory(
        {"a": (gguf.GGMLQuantizationType.F32, (4 << 20,)), "b": (gguf.GGMLQuantizationType.F32, (8,))}
    )
    assert small.page == mmap.PAGESIZE
    small.close()
    memory = ggml_graph.Memory({"a": (gguf.GGMLQuantizationType.F32, (4 << 20,))})
    try:
        page = memory.page
        assert page == (2 << 20 if weights_way else mmap.PAGESIZE)
        data = ggml_graph.view_of(memory["a"], gguf.GGMLQuantizationType.F32, (4 << 20,)).view(np.uint8)
        assert data.ctypes.data % page == 0 and not in_memory(data.ctypes.data, data.nbytes).any()
        data[0] = 1  # the first piece
        assert in_memory(data.ctypes.data, data.nbytes).sum() * mmap.PAGESIZE == page
        assert ("hg" in _mapping_field(data.ctypes.data, "VmFlags")) == weights_way
        data[:] = 2
        memory.release("a", page // 2, 3 * page)  # half a piece, then two whole ones
        pieces = in_memory(data.ctypes.data, data.nbytes).reshape(-1, page // mmap.PAGESIZE).all(axis=1)
        assert list(pieces[:4]) == [True, False, False, True] and pieces[3:].all()
        assert data[page - 1] == 2 and data[page] == 0 and data[3 * page] == 2
        memory.populate("a", page + 1, page + 2)  # a byte of a piece: the whole piece, as it is
        pieces = in_memory(data.ctypes.data, data.nbytes).reshape(-1, page // mmap.PAGESIZE).all(axis=1)
        assert list(pieces[:4]) == [True, True, False, True] and not data[page : 2 * page].any()
    finally:
        memory.close()


def test_a_cache_file_leaves_the_page_cache_once_written_and_is_read_on_huge_pages(tmp_path, huge_file_pages):
    """Our cache files (`cache_files`): written, the page cache would hold them in small
    pieces; out of it, a load maps them on huge pages."""
    path = tmp_path / "cache.gguf"
    assert cache_files.write(path, "key", [BIG])
    assert cached_pages(path) < BIG.nbytes / mmap.PAGESIZE / 100
    saved = cache_files.read(path, "key")
    assert saved is not None and "hg" in _mapping_field(saved[0].ctypes.data, "VmFlags")
    np.testing.assert_array_equal(saved[0], BIG)
    assert _pmd_mapped(saved[0].ctypes.data) >= ggml_graph.IN_PLACE_HUGE_SHARE * BIG.nbytes


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


@pytest.mark.parametrize("order", ["C", "F"])
def test_widen_gives_numpy_s_float32_in_the_same_order(order):
    """Every float16 bit pattern (infinities, subnormals among them), 65536 of them and an odd
    count (the vector loop's tail), widened exactly in C or Fortran order; a NaN stays a NaN
    (F16C sets a signalling NaN's quiet bit, which numpy keeps as it was)."""
    bits = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    for half in (
        np.asarray(bits.reshape(256, 256), order=order),
        np.asarray(bits[:999].reshape(27, 37), order=order),
    ):
        wide, exact = widen(half), half.astype(np.float32)
        assert wide.dtype == np.float32 and wide.flags[f"{order}_CONTIGUOUS"]
        numbers = ~np.isnan(exact)
        assert np.array_equal(wide[numbers].view(np.uint32), exact[numbers].view(np.uint32))
        assert np.isnan(wide[~numbers]).all()
