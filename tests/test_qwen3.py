"""The Qwen3 stack on graphs of our own: its KV cache, its graphs and what they must not change."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from page_cache import in_memory

import kazeia_stream
from kazeia_stream.engine import ggml_graph
from kazeia_stream.engine.talker import Talker, TalkerState

MB = 1 << 20


def cache_resident(talker: Talker) -> int:
    """Resident bytes of the talker's KV cache."""
    memory = talker.lm.cache
    return int(in_memory(memory._bytes.ctypes.data, memory._bytes.nbytes).sum()) * mmap.PAGESIZE


@pytest.fixture(scope="module")
def model(tiny_gguf):
    return kazeia_stream.load_model(tiny_gguf("custom_voice")[0])


def rows(model, n: int, seed: int = 0) -> np.ndarray:
    width = model.config.talker.hidden_size
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


@pytest.fixture
def small_pages(monkeypatch) -> None:
    """The KV cache in 4 KiB pieces (not huge pages): fine enough to show which rows and blocks
    of a tiny model's cache are resident."""
    monkeypatch.setattr(ggml_graph, "huge_pages", lambda: False)


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="Linux")
def test_a_kv_cache_is_resident_only_where_it_is_written(model, small_pages):
    n_ctx = 65536
    cfg = model.config.talker
    kv_dim = cfg.num_kv_heads * cfg.head_dim
    kv_bytes = 2 * cfg.num_layers * kv_dim * n_ctx * 4  # F32: F32 weights
    assert kv_bytes >= 32 * MB
    talker = Talker(model.talker_file, cfg, 1, n_ctx=n_ctx)
    hidden, _ = talker.prefill(TalkerState(), rows(model, 5))
    # 5 positions: per layer, the K rows a step reads (its span) and V's first block, give or
    # take a page each (a page of every V channel, as whole transposed rows, would be more)
    page = mmap.PAGESIZE
    k_span = talker.lm.bucket * kv_dim * 4
    v_block = kv_dim * talker.lm.v_block * 4
    assert v_block + page < kv_dim * page
    assert cache_resident(talker) <= cfg.num_layers * (k_span + v_block + 2 * page)
    # nothing was cleared or filled: a prefill gives the hidden state of a small cache
    expected, _ = Talker(model.talker_file, cfg, 1, n_ctx=64).prefill(TalkerState(), rows(model, 5))
    assert np.array_equal(hidden, expected)


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="Linux")
def test_a_finished_utterance_gives_back_all_but_the_rows_its_slot_keeps(model, small_pages):
    cfg = model.config.talker
    kv_dim, page = cfg.num_kv_heads * cfg.head_dim, mmap.PAGESIZE
    talker = Talker(model.talker_file, cfg, 1, n_ctx=65536)  # F32 cache: F32 weights
    prompt, kept = rows(model, 700), 300
    first = talker.prefill(TalkerState(), prompt, n_fixed=kept)
    before = cache_resident(talker)
    talker.release(TalkerState())
    # per layer: the kept K rows and the V blocks they reach, give or take a page each
    v_blocks = -(-kept // talker.lm.v_block) * kv_dim * talker.lm.v_block * 4
    bound = cfg.num_layers * (kept * kv_dim * 4 + v_blocks + 4 * page)
    assert cache_resident(talker) <= bound < before
    # the kept rows are intact: the next utterance computes only the rows after them
    again = talker.prefill(TalkerState(), prompt, n_fixed=kept)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))


def slot_resident(talker: Talker, slot: int) -> int:
    """Resident bytes of slot `slot`'s K and V in every layer."""
    memory, total = talker.lm.cache, 0
    for bid in range(talker.lm.config.num_layers):
        for name, axis in ((f"{bid}.k", 2), (f"{bid}.v", 3)):
            tensor = memory[name]
            stride = ggml_graph.strides(tensor)[axis]
            at = ggml_graph.ggml.ggml_get_data(tensor) + slot * stride
            total += int(in_memory(at, stride).sum()) * mmap.PAGESIZE
    return total


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="Linux")
def test_a_slot_made_resident_ahead_holds_the_first_page_of_each_k_and_v(model, small_pages):
    """What a first utterance in the slot would fault in, made resident ahead (`populate`):
    in that slot only, and its numbers as they would be."""
    cfg = model.config.talker
    talker = Talker(model.talker_file, cfg, 1, slots=2)
    assert cache_resident(talker) == 0
    talker.populate(1)
    assert slot_resident(talker, 1) == cache_resident(talker) == 2 * cfg.num_layers * mmap.PAGESIZE
    state = TalkerState(seq=1)
    hidden, logits = talker.prefill(state, rows(model, 5))
    expected = Talker(model.talker_file, cfg, 1, slots=2).prefill(TalkerState(seq=1), rows(model, 5))
    assert np.array_equal(hidden, expected[0]) and np.array_equal(logits, expected[1])
    assert slot_resident(talker, 0) == 0


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="Linux")
def test_a_server_s_runtime_holds_every_stream_s_first_cells_before_it_listens(model, small_pages):
    from argparse import Namespace

    from kazeia_stream import cli

    runtime = cli._server_runtime(Namespace(threads=None, max_streams=3), model)
    cfg = model.config.talker
    assert runtime.max_streams == 3
    for slot in range(3):
        assert slot_resident(runtime.talker, slot) >= 2 * cfg.num_layers * mmap.PAGESIZE


def test_v_in_blocks_gives_the_results_of_one_block_beyond_rounding(model, monkeypatch):
    """Past its first V block a step sums one product per block: the hidden states and logits
    of V in one block, to the sum's rounding."""
    from kazeia_stream.engine import qwen3

    def steps(talker: Talker) -> list[tuple[np.ndarray, np.ndarray]]:
        state = TalkerState()
        talker.prefill(state, rows(model, 5))
        return [talker.step(state, row) for row in rows(model, 40, 2)]

    whole = steps(Talker(model.talker_file, model.config.talker, 1))
    monkeypatch.setattr(qwen3, "V_BLOCK", 8)
    talker = Talker(model.talker_file, model.config.talker, 1)
    talker.lm.bucket = 8
    assert talker.lm.v_block == 8
    blocks = steps(talker)
    assert any(span > 8 for layout, *_ in talker.lm._graphs for _, _, span, _ in layout)
    for (h0, l0), (h1, l1) in zip(whole, blocks):
        assert np.abs(h1 - h0).max() <= 1e-5 * np.abs(h0).max()
        assert np.abs(l1 - l0).max() <= 1e-5 * np.abs(l0).max()


def test_steps_within_a_span_bucket_replay_one_graph(model):
    talker = Talker(model.talker_file, model.config.talker, 1)
    state = TalkerState()
    talker.prefill(state, rows(model, 3))
    built = len(talker.lm._graphs)
    bucket = talker.lm.bucket
    while state.pos < bucket:  # every step attends over the first bucket's positions
        talker.step(state, rows(model, 1, state.pos)[0])
    assert len(talker.lm._graphs) == built + 1
    talker.step(state, rows(model, 1, 99)[0])  # the next bucket: one graph more
    assert len(talker.lm._graphs) == built + 2


def test_the_span_does_not_change_the_results_beyond_rounding(model):
    """A step attends over its slot's positions rounded up to a bucket, the later ones masked:
    any bucket gives the same hidden states and logits, to the sum's rounding."""
    cfg = model.config.talker
    outs = []
    for bucket in (1, 8, 64):
        talker = Talker(model.talker_file, cfg, 1)
        talker.lm.bucket = bucket
        state = TalkerState()
        talker.prefill(state, rows(model, 5))
        outs.append([talker.step(state, row) for row in rows(model, 12, 1)])
    for other in outs[1:]:
        for (h0, l0), (h1, l1) in zip(outs[0], other):
            assert np.abs(h1 - h0).max() <= 1e-5 * np.abs(h0).max()
            assert np.abs(l1 - l0).max() <= 1e-5 * np.abs(l0).max()


def test_a_reused_slot_ignores_the_cells_a_longer_utterance_left(model):
    talker = Talker(model.talker_file, model.config.talker, 1)
    talker.prefill(TalkerState(), rows(model, 40, seed=5))  # leaves 40 cells behind
    state = TalkerState()
    again = talker.prefill(state, rows(model, 7))
    fresh = Talker(model.talker_file, model.config.talker, 1).prefill(TalkerState(), rows(model, 7))
    assert all(np.array_equal(a, b) for a, b in zip(again, fresh))


def test_a_prefill_longer_than_a_graph_runs_in_parts(model, monkeypatch):
    from kazeia_stream.engine import qwen3

    whole = Talker(model.talker_file, model.config.talker, 1).prefill(TalkerState(), rows(model, 30))
    monkeypatch.setattr(qwen3, "MAX_PART", 8)
    talker = Talker(model.talker_file, model.config.talker, 1)
    parts = talker.prefill(TalkerState(), rows(model, 30))
    assert {layout[0][1] for layout, *_ in talker.lm._graphs} == {8, 6}  # rows of the one part
    for a, b in zip(whole, parts):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()


def test_graphs_placed_before_a_larger_one_are_built_again(model):
    """An engine's graphs share one compute buffer; a larger graph grows (moves) it, and the
    graphs placed before are built again rather than run on the old one."""
    prompt, steps = rows(model, 2), rows(model, 3, 7)

    def steps_of(talker: Talker) -> list[np.ndarray]:
        state = TalkerState()
        talker.prefill(state, prompt)
        return [talker.step(state, row)[1] for row in steps]

    talker = Talker(model.talker_file, model.config.talker, 1)
    first = steps_of(talker)
    size = talker.lm._allocator.size
    talker.prefill(TalkerState(), rows(model, 300, 3))  # a much larger graph
    assert talker.lm._allocator.size > size
    again = steps_of(talker)  # the same shapes as before
    assert all(np.array_equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("kv_f32", [True, False], ids=["f32-cache", "f16-cache"])
def test_steps_attend_in_one_operation_to_the_numbers_of_ggmls_operations(model, monkeypatch, kv_f32):
    """Parts of one row each (steps) attend in one operation (`kv_product.attend`): several
    streams' steps, one past its first V block, and two parts of one slot in one call (the
    second reads what the first writes) give the hidden states, logits and KV cells of the
    graph of ggml's operations (norms, RoPE, cache writes, products, softmax), to rounding
    (a float16 cell to one unit in its last place)."""
    from kazeia_stream.engine import kv_product
    from kazeia_stream.engine.qwen3 import Qwen3LM

    cfg = model.config.talker
    if not kv_product.attends(QType.F32, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim):
        pytest.skip("the kernel is not built, or this CPU lacks AVX2")
    weights = Talker(model.talker_file, cfg, 1).weights  # float32: no rounding of its own

    def run(one_operation: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
        if not one_operation:
            monkeypatch.setattr(kv_product, "attends", lambda *_: False)
        lm = Qwen3LM(weights, cfg, input_width=cfg.hidden_size, slots=3, n_ctx=512, kv_f32=kv_f32, threads=2)
        lm.forward_many([(0, rows(model, 5), 0), (1, rows(model, 270, 1), 0)])  # past a V block
        outs = []
        for i in range(4):
            step = rows(model, 4, 10 + i)
            parts = [
                (0, step[:1], 5 + i),
                (1, step[1:2], 270 + i),
                (2, step[2:3], 2 * i),
                (2, step[3:], 2 * i + 1),
            ]
            assert lm._attends(lm._layout(parts, None)) == one_operation
            outs += lm.forward_many(parts)
        cells = [c.astype(np.float64) for slot, n in ((0, 9), (1, 274), (2, 8)) for c in lm.cells(slot, n)]
        monkeypatch.undo()
        lm.close()
        return outs, cells

    ours, ggmls = run(True), run(False)
    for a, b in zip(ours[0], ggmls[0]):
        assert np.abs(a - b).max() <= (1e-5 if kv_f32 else 1e-3) * np.abs(b).max()
    for a, b in zip(ours[1], ggmls[1]):  # float16: one unit in the last place of the larger
        last_place = 0.0 if kv_f32 else 2**-10 * np.maximum(np.abs(a), np.abs(b))
        assert np.all(np.abs(a - b) <= last_place + 1e-6 * np.abs(b).max())


def test_norms_and_residuals_in_our_products_operations_change_no_number(tiny_gguf, monkeypatch):
    """Where our kernels multiply (Q8_0 weights), a layer's RMS norms run inside its q, k, v,
    gate and up products' operations and its residual sums inside its o and down ones: the
    prefill's and the steps' hidden states and logits are those of ggml's operations, bit for
    bit."""
    from kazeia_stream.engine.qwen3 import Qwen3LM, product_kernel

    model = kazeia_stream.load_model(tiny_gguf("custom_voice", "q8_0")[0])
    cfg = model.config.talker

    def run() -> list[np.ndarray]:
        talker, state = Talker(model.talker_file, cfg, 1), TalkerState()
        assert product_kernel(talker.weights["0.q"]) is not None, "the Q8_0 kernel does not run here"
        outs = list(talker.prefill(state, rows(model, 6)))
        for row in rows(model, 5, 1):
            outs += talker.step(state, row)
        return outs

    inside = run()
    product = Qwen3LM._product

    def apart(self, g, name, x, parts, together, index=None, norm=None, residual=None):
        if norm is not None:
            x = g.mul(g.rms_norm(x, self.config.rms_norm_eps), self.weights[norm])
        y = product(self, g, name, x, parts, together, index)
        return y if residual is None else g.add(residual, y)

    monkeypatch.setattr(Qwen3LM, "_product", apart)
    assert all(np.array_equal(a, b) for a, b in zip(inside, run(), strict=True))
