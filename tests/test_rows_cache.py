"""A session's fixed rows saved at a first start and written into the talker's slot at later
ones (`engine/rows_cache.py`), or copied from the slot of another stream that keeps them: the
same cells and the same next steps, nothing computed again, and a saved file that no longer
fits passed over."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import kazeia_stream
from kazeia_stream.engine import cache_files, qwen3, rows_cache
from kazeia_stream.engine.talker import Talker, TalkerState


@pytest.fixture
def model(tiny_gguf, tmp_path, monkeypatch):
    """The tiny Q8_0 CustomVoice model on copies of its files, with a cache folder of its own."""
    monkeypatch.setenv(cache_files.CACHE_ENV, str(tmp_path / "cache"))
    talker, mmproj = tiny_gguf("custom_voice", "q8_0")
    for path in (talker, mmproj):
        shutil.copy(path, tmp_path / path.name)
    return kazeia_stream.load_model(tmp_path / talker.name)


def _talker(model, n_ctx: int = 64, slots: int = 1) -> tuple[Talker, list[int]]:
    """A talker of its own on the model's file, and the row count of each forward call it makes."""
    talker = Talker(model.talker_file, model.config.talker, 1, slots=slots, n_ctx=n_ctx)
    rows: list[int] = []
    forward = talker.lm.forward
    talker.lm.forward = lambda embeds, *a, **kw: rows.append(len(embeds)) or forward(embeds, *a, **kw)
    return talker, rows


def _fixed(model, voice: str = "ryan") -> np.ndarray:
    prompt = model.prompt("Saved rows.", voice=voice)
    return prompt.prefill[: prompt.n_fixed]


def _steps(talker: Talker, fixed: np.ndarray, model, seq: int = 0) -> list[np.ndarray]:
    """The logits of a few steps after the fixed rows kept in slot `seq`."""
    state = TalkerState(pos=len(fixed), seq=seq)
    return [talker.step(state, model.pad_embedding)[1] for _ in range(3)]


def _saved(tmp_path) -> list:
    return sorted((tmp_path / "cache").glob("rows-*.gguf"))


def test_a_later_talker_writes_the_saved_cells_and_steps_the_same(model, tmp_path, monkeypatch):
    fixed = _fixed(model)
    first, rows = _talker(model)
    first.keep(0, fixed)
    assert rows == [len(fixed)] and len(_saved(tmp_path)) == 1
    later, later_rows = _talker(model)
    later.keep(0, fixed)
    assert later_rows == [] and later.holds(0, fixed)
    for a, b in zip(first.lm.cells(0, len(fixed)), later.lm.cells(0, len(fixed))):
        assert a.dtype == np.float16 and np.array_equal(a, b)  # the Q8_0 talker's F16 cache
    assert all(np.array_equal(a, b) for a, b in zip(_steps(first, fixed, model), _steps(later, fixed, model)))
    monkeypatch.setenv(cache_files.CACHE_ENV, "0")
    computing, computed = _talker(model)
    computing.keep(0, fixed)
    assert computed == [len(fixed)]
    assert all(
        np.array_equal(a, b) for a, b in zip(_steps(computing, fixed, model), _steps(later, fixed, model))
    )


def test_a_second_slot_takes_the_cells_another_keeps_or_saved_ones(model, tmp_path, monkeypatch):
    """An utterance that starts in a slot without its fixed rows (another stream holds the
    session's slot) computes only the rows after them."""
    monkeypatch.setenv(cache_files.CACHE_ENV, "0")  # no saved cells: from the other slot
    prompt = model.prompt("Saved rows.", voice="ryan")
    fixed, n = prompt.prefill[: prompt.n_fixed], prompt.n_fixed
    two = _talker(model, slots=2)[0]
    two.keep(0, fixed)
    pieces = two.begin(TalkerState(seq=1), prompt.prefill, n)
    assert [pos for pos, _ in pieces] == [n] and two.holds(1, fixed)
    for a, b in zip(two.lm.cells(0, n), two.lm.cells(1, n)):
        assert np.array_equal(a, b)
    computing = _talker(model, slots=2)[0]
    assert [pos for pos, _ in computing.begin(TalkerState(seq=1), fixed, n)] == [0]
    computing.lm.forward(fixed, 0, slot=1)
    assert all(
        np.array_equal(a, b) for a, b in zip(_steps(two, fixed, model, 1), _steps(computing, fixed, model, 1))
    )
    monkeypatch.setenv(cache_files.CACHE_ENV, str(tmp_path / "cache"))  # saved by a first keep
    _talker(model)[0].keep(0, fixed)
    later = _talker(model, slots=2)[0]
    assert [pos for pos, _ in later.begin(TalkerState(seq=1), prompt.prefill, n)] == [n]
    assert all(np.array_equal(a, b) for a, b in zip(later.lm.cells(1, n), two.lm.cells(1, n)))


def test_cells_across_v_blocks_are_written_back_in_place(model, monkeypatch):
    """Rows beyond one block of the transposed V cache (`qwen3.V_BLOCK`)."""
    monkeypatch.setattr(qwen3, "V_BLOCK", 8)
    fixed = np.random.default_rng(1).standard_normal((19, model.config.talker.hidden_size)).astype(np.float32)
    first, _ = _talker(model)
    first.keep(0, fixed)
    later, rows = _talker(model)
    later.keep(0, fixed)
    assert later.lm.v_blocks == 8 and rows == []
    assert all(np.array_equal(a, b) for a, b in zip(first.lm.cells(0, 19), later.lm.cells(0, 19)))
    assert all(np.array_equal(a, b) for a, b in zip(_steps(first, fixed, model), _steps(later, fixed, model)))


def test_other_rows_files_or_kernels_or_a_damaged_file_are_computed_anew(model, tmp_path, monkeypatch):
    fixed = _fixed(model)
    _talker(model)[0].keep(0, fixed)
    (saved,) = _saved(tmp_path)
    talker, rows = _talker(model)
    eric = _fixed(model, "eric")  # another voice's rows
    talker.keep(0, eric)
    assert rows == [len(eric)] and len(_saved(tmp_path)) == 2
    os.truncate(saved, saved.stat().st_size // 2)
    talker, rows = _talker(model)
    talker.keep(0, fixed)
    assert rows == [len(fixed)]
    talker, rows = _talker(model)
    talker.keep(0, fixed)
    assert rows == []  # made and written whole again
    stat = os.stat(model.talker_file.path)
    os.utime(model.talker_file.path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # a new file
    talker, rows = _talker(model)
    talker.keep(0, fixed)
    assert rows == [len(fixed)]
    monkeypatch.setenv("KAZEIA_Q8_KERNEL", "0")  # ggml's kernels: other sums
    monkeypatch.setattr(rows_cache.q8_product.KERNEL, "chosen", rows_cache.q8_product.KERNEL._chosen)
    talker, rows = _talker(model)
    talker.keep(0, fixed)
    assert rows == [len(fixed)]


def test_only_the_files_used_last_are_kept(model, tmp_path, monkeypatch):
    monkeypatch.setattr(rows_cache, "KEEP", 2)
    width = model.config.talker.hidden_size
    a, b, c = (np.full((2, width), i, np.float32) for i in range(3))
    talker, computed = _talker(model)

    def keep(rows: np.ndarray) -> set:
        """The rows files after `rows` are kept in a slot that held others."""
        talker.keep(0, rows)
        return set(_saved(tmp_path))

    (file_a,) = keep(a)
    (file_b,) = keep(b) - {file_a}
    os.utime(file_a, ns=(0, 0))  # used long ago
    (file_c,) = keep(c) - {file_a, file_b}
    assert set(_saved(tmp_path)) == {file_b, file_c}
    os.utime(file_b, ns=(0, 0))
    computed.clear()
    keep(b)  # read: used last now
    assert computed == [] and keep(a) == {file_a, file_b}


def test_no_file_where_the_cache_is_turned_off(model, tmp_path, monkeypatch):
    monkeypatch.setenv(cache_files.CACHE_ENV, "0")
    talker, rows = _talker(model)
    talker.keep(0, _fixed(model))
    assert rows and not (tmp_path / "cache").exists()
