"""Zeroed pages go back to the kernel: a context's KV cache is resident only where it is used."""

from __future__ import annotations

import mmap

import numpy as np

from kazeia_stream.engine.llm import LMOptions
from kazeia_stream.engine.pages import zeroed_pages_released
from kazeia_stream.engine.talker import Talker, TalkerState

MB = 1 << 20


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def test_a_zeroed_buffer_of_the_size_given_is_released_and_other_memory_kept():
    n = 64 * MB
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    before = rss_anon()
    with zeroed_pages_released(n):  # one fresh private mapping, as a large malloc makes
        # the buffer; someone's values between it and another thread's fresh memory, zero for
        # the moment (its writes are still to come), which must not be taken for the buffer;
        # and pages never touched
        memory = np.frombuffer(mmap.mmap(-1, 3 * n, flags=private), np.uint8)
        buffer, sevens, fresh = memory[:n], memory[n : 2 * n], memory[2 * n : 5 * n // 2]
        buffer.fill(0)  # resident, as libllama's memset leaves a KV cache
        sevens.fill(7)
        fresh.fill(0)
    grown = rss_anon() - before
    assert 1.4 * n < grown < 1.7 * n  # the sevens and the other zeros stayed, the buffer went
    assert not buffer.any() and not fresh.any() and (sevens == 7).all()
    buffer[::4096] = 1  # a released page is written as any other
    assert buffer.sum() == n // 4096
    assert rss_anon() - before > grown + 0.9 * n


def test_a_new_talker_context_holds_its_kv_cache_only_where_it_is_written(tiny_runtime):
    n_ctx = 65536
    model = tiny_runtime("custom_voice").model
    cfg = model.config.talker
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * n_ctx * 4  # F32: F32 weights
    assert kv_bytes >= 32 * MB
    before = rss_anon()
    talker = Talker(model.llama_model.ptr, cfg, LMOptions(1, n_ctx=n_ctx, n_batch=16))
    assert rss_anon() - before < kv_bytes / 4
    # the released cells read as the zeros libllama wrote: a prefill gives the same hidden state
    fresh = Talker(model.llama_model.ptr, cfg, LMOptions(1, n_ctx=64, n_batch=16))
    rows = np.tile(model.pad_embedding, (5, 1))
    hidden, _ = talker.prefill(TalkerState(), rows)
    expected, _ = fresh.prefill(TalkerState(), rows)
    assert np.array_equal(hidden, expected)
