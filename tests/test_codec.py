"""The codec decoder (code2wav): parity with the official decoder, streaming == one-shot."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from decoders import PRODUCTS, tiny_decoder

from kazeia_stream.engine import f32_product, matrix, snake, winograd
from kazeia_stream.engine.codec import PANEL_COLUMNS, SPLIT_COLUMNS, CodecDecoder
from kazeia_stream.engine.threads import available_cores
from kazeia_stream.model.gguf_file import GGUFFile

REFS = Path(__file__).parent / "data" / "refs"


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    with np.load(REFS / "codec_custom_voice.npz") as f:
        return {"codes": f["codes"], "audio": f["audio"]}


@pytest.fixture(scope="module", params=PRODUCTS)
def decoder(tiny_gguf, request) -> CodecDecoder:
    return tiny_decoder(tiny_gguf("custom_voice")[1], request.param)


@pytest.fixture(scope="module")
def one_shot(decoder, reference) -> np.ndarray:
    return decoder.decode(reference["codes"])


def test_matches_the_official_decoder(decoder, reference, one_shot):
    # 80 frames: more than the 72-frame attention window, positions 0..79
    assert one_shot.dtype == np.float32
    assert one_shot.shape == (80 * decoder.samples_per_frame,) == reference["audio"].shape
    assert decoder.samples_per_frame == 1920
    np.testing.assert_allclose(one_shot, reference["audio"], rtol=0, atol=1e-4)


def test_matches_the_official_decoder_on_numpy_s_snake_too(decoder, reference, monkeypatch):
    """Where our SnakeBeta kernel is not built, or the CPU lacks AVX2, numpy's runs."""
    monkeypatch.setattr(snake, "variants", lambda: ())
    audio = decoder.decode(reference["codes"])
    np.testing.assert_allclose(audio, reference["audio"], rtol=0, atol=1e-4)


def test_winograd_s_audio_is_the_direct_products_to_float_rounding(tiny_gguf, reference):
    """KAZEIA_WINOGRAD=0 (or no kernel for the transforms) keeps each tap's product, as the
    official decoder; Winograd's differs from it by float rounding."""
    mmproj = tiny_gguf("custom_voice")[1]
    direct = tiny_decoder(mmproj, "direct")
    assert {unit.conv1.method for block in direct.blocks for unit in block.units} == {"taps"}
    tiled = tiny_decoder(mmproj, "winograd")
    assert {unit.conv1.method for block in tiled.blocks for unit in block.units} == {"winograd"}
    difference = np.abs(direct.decode(reference["codes"]) - tiled.decode(reference["codes"])).max()
    assert 0 < difference < 2e-5


def _chunkings(total: int) -> dict[str, list[int]]:
    """Fixed chunkings around the 72-frame window, and random ones from a fixed seed."""
    rng = np.random.default_rng(1234)
    cases = {
        "frame-by-frame": [1] * total,
        "window-crossed-by-single-frames": [71, 1, 1, total - 73],
        "chunk-ending-on-frame-72": [2, 70, 5, total - 77],
        "whole": [total],
    }
    for high in (4, 16, 40):
        sizes: list[int] = []
        while sum(sizes) < total:
            sizes.append(int(rng.integers(1, high + 1)))
        sizes[-1] -= sum(sizes) - total
        cases[f"random-up-to-{high}"] = sizes
    return cases


CHUNKINGS = _chunkings(80)


@pytest.mark.parametrize("products", ["winograd", "direct"])
def test_a_float16_decoder_gives_its_widened_weights_audio_from_float16_panels(
    tiny_gguf, reference, monkeypatch, products
):
    """A file that stores the decoder's weights in float16 (`convert --decoder f16`; llama.cpp
    writes its conv kernels so): the products of few columns read float16 panels, and the
    audio is that of the same weights widened to float32, bit for bit. The weights' rounding
    shows against the official float32 decoder."""
    if f32_product.chosen() is None:
        pytest.skip("our float32 kernel is not built here")
    mmproj = tiny_gguf("custom_voice", "f32", decoder="f16")[1]
    decoder = tiny_decoder(mmproj, products)
    audio = decoder.decode(reference["codes"])
    assert any(m.panels and m.array.dtype == np.float16 for m, _ in decoder.products())
    # every weight widened at the load
    monkeypatch.setattr(GGUFFile, "weight", GGUFFile.tensor)
    monkeypatch.setattr(GGUFFile, "joined", lambda f, names: np.concatenate([f.tensor(n) for n in names]))
    widened = tiny_decoder(mmproj, products)
    assert all(m.array.dtype == np.float32 for m, _ in widened.products())
    np.testing.assert_array_equal(audio, widened.decode(reference["codes"]))
    assert 1e-4 < np.abs(audio - reference["audio"]).max() < 0.05


@pytest.mark.parametrize("name", CHUNKINGS)
def test_streaming_equals_one_shot(decoder, reference, one_shot, name):
    codes, chunks = reference["codes"], CHUNKINGS[name]
    assert sum(chunks) == len(codes) and min(chunks) >= 1
    state = decoder.new_state()
    parts, start = [], 0
    for n in chunks:
        part = decoder.push(state, codes[start : start + n])
        assert part.shape == (n * decoder.samples_per_frame,)
        parts.append(part)
        start += n
    # bit for bit: a column's products never depend on the chunk
    np.testing.assert_array_equal(np.concatenate(parts), one_shot)


def test_utterances_interleaved_on_one_decoder_keep_their_own_state(decoder, reference, one_shot):
    codes = reference["codes"]
    a, b = decoder.new_state(), decoder.new_state()
    other = codes[::-1]  # another utterance, pushed between a's chunks: conv tails, K/V, positions
    parts = []
    for i in range(0, 40, 8):
        parts.append(decoder.push(a, codes[i : i + 8]))
        decoder.push(b, other[i : i + 5])
    np.testing.assert_array_equal(np.concatenate(parts), one_shot[: 40 * 1920])
    assert a.position == 40 and b.position == 25
    # decode() starts a fresh utterance, whatever the decoder did before
    np.testing.assert_array_equal(decoder.decode(codes[:10]), one_shot[: 10 * 1920])


def test_negative_codes_clamp_to_zero(decoder, reference):
    codes = reference["codes"][:12].copy()
    codes[3, :] = -1
    codes[7, 5] = -100
    clamped = np.maximum(codes, 0)
    np.testing.assert_array_equal(decoder.decode(codes), decoder.decode(clamped))


def test_output_is_clamped(decoder, reference):
    audio = decoder.decode(reference["codes"][:20])
    assert np.abs(audio).max() <= 1.0


def test_rejects_a_wrong_shape(decoder, reference):
    state = decoder.new_state()
    with pytest.raises(ValueError, match="codes must be"):
        decoder.push(state, reference["codes"][:4, :15])
    with pytest.raises(ValueError, match="codes must be"):
        decoder.push(state, reference["codes"][0])
    with pytest.raises(ValueError, match="codes must be <"):
        decoder.push(state, np.full((2, 16), 2048))


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores for 2 BLAS threads")
def _blas_threads() -> set[int]:
    """The thread counts numpy's BLAS libraries are set to now."""
    from threadpoolctl import threadpool_info

    return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}


def test_each_push_sets_its_own_blas_threads(decoder, reference, monkeypatch):
    from threadpoolctl import threadpool_limits

    seen, ggml, teams = [], [], []
    multiply, compute = matrix.Matrix.__call__, matrix.Graph.compute

    def spy(*args, **kwargs):  # every product, on whichever kernel (numpy's attention too)
        seen.append(_blas_threads())
        teams.append(getattr(f32_product._team.get(), "threads", 1))  # our kernel's
        return multiply(*args, **kwargs)

    monkeypatch.setattr(matrix.Matrix, "__call__", spy)
    monkeypatch.setattr(matrix.Graph, "compute", lambda graph, n: ggml.append(n) or compute(graph, n))
    graphs = not any(m.variant for m, _ in decoder.products())  # else all on our kernel
    with threadpool_limits(limits=2, user_api="blas"):
        state = decoder.new_state()
        decoder.push(state, reference["codes"][:2])
        assert seen and all(s == {1} for s in seen)  # whatever numpy's own setting
        assert bool(ggml) == graphs and set(ggml) <= {1}  # the products of few columns
        assert set(teams) == {1}
        seen.clear()
        ggml.clear()
        teams.clear()
        decoder.push(state, reference["codes"][2:4], threads=2)
        assert seen and all(s == {2} for s in seen)
        assert set(teams) == {1 if graphs else min(2, available_cores())}  # its helpers spin
        assert bool(ggml) == graphs and set(ggml) <= {1}  # one thread runs graphs on several: the generator's
        assert _blas_threads() == {2}


def test_a_fresh_decoder_s_first_frames_build_no_graph(tiny_gguf, reference, monkeypatch):
    """The load builds a frame's graphs on ggml's kernels, placed in the compute buffer at its
    full size: the first frames neither build one nor rebuild one that the buffer's growth
    left stale (which the second frame did, 10 ms on the 0.6B)."""

    decoder = tiny_decoder(tiny_gguf("custom_voice")[1], "ggml")  # where our kernel does not run
    built = []
    init = matrix.Graph.__init__
    monkeypatch.setattr(matrix.Graph, "__init__", lambda graph, n: built.append(n) or init(graph, n))
    state = decoder.new_state()
    for frame in reference["codes"][:3]:
        decoder.push(state, frame[None])
    assert not built
    decoder.push(state, reference["codes"][3:5])  # two frames a push: graphs of their own
    assert built


def test_the_load_s_products_run_on_the_decoder_s_blas_threads(tiny_gguf, monkeypatch):
    """Two threads would leave OpenBLAS's second spinning after them, beside the talker."""
    from threadpoolctl import threadpool_limits

    seen = []
    kernel_weights = winograd.kernel_weights

    def spy(w, outputs):
        seen.append(_blas_threads())
        return kernel_weights(w, outputs)

    monkeypatch.setattr(winograd, "kernel_weights", spy)
    monkeypatch.setenv("KAZEIA_CACHE", "0")  # a load that makes its arrays
    with threadpool_limits(limits=2, user_api="blas"):
        tiny_decoder(tiny_gguf("custom_voice")[1], "winograd")
    assert seen and all(s == {1} for s in seen)


@pytest.mark.parametrize("n_ref", [3, 50, 75])
def test_priming_with_a_reference_gives_the_joint_decode_after_it(decoder, reference, one_shot, n_ref):
    """An in-context voice: the audio after `prime(reference)` is the one-shot decode of
    [reference + rest] with the reference's samples cut, as the official code does it."""
    codes, spf = reference["codes"], decoder.samples_per_frame
    assert decoder.lookback_frames == 11  # the official layer sizes: 11 frames after the transformer
    state = decoder.new_state()
    decoder.prime(state, codes[:n_ref])
    assert state.position == n_ref
    rest = decoder.push(state, codes[n_ref:])
    np.testing.assert_allclose(rest, one_shot[n_ref * spf :], atol=1e-5)


@pytest.mark.parametrize("frames", [1, 5])
def test_products_hold_every_multiply_add_of_a_decode(decoder, reference, monkeypatch, frames):

    counted = []
    product = matrix.Matrix.__call__

    def counting(m, x, out=None):
        counted.append(m.shape[0] * m.shape[1] * x.shape[1])
        return product(m, x, out)

    convolve = winograd.convolve

    def convolving(buf, cols, d, frame, products, bias, y):  # m + 6 products a chunk, in one call
        m = products.outputs
        for chunk in winograd.chunks(cols, d, m, frame):
            counted.extend([products.c_out * products.c_in * chunk.tiles] * winograd.size(m))
        convolve(buf, cols, d, frame, products, bias, y)

    monkeypatch.setattr(matrix.Matrix, "__call__", counting)
    monkeypatch.setattr(winograd, "convolve", convolving)
    decoder.decode(reference["codes"][:frames])
    assert sum(counted) == decoder.macs_per_frame * frames
    if frames == 1:  # one product per weight
        assert len(counted) == len(list(decoder.products()))


@pytest.mark.parametrize("in_order", [False, True])
def test_the_products_floor_runs_a_decode_s_products(decoder, monkeypatch, in_order):
    """`products_time` multiplies each weight by the columns a decode of 2 frames a push gives
    it (the later blocks' layers one frame's columns at a time, the others the push's), each
    product `repeat` times in a row, or `in_order` all of them one after another, `repeat`
    times."""

    calls = []
    product = matrix.Matrix.__call__

    def counting(m, x, out=None):
        calls.append((id(m), x.shape[1]))
        return product(m, x, out)

    monkeypatch.setattr(matrix.Matrix, "__call__", counting)
    assert decoder.products_time(2, repeat=3, in_order=in_order) > 0
    per_frame = decoder._per_stream_matrices()
    each = [
        [(id(m), columns)] * 2 if id(m) in per_frame else [(id(m), 2 * columns)]
        for m, columns in decoder.products()
    ]
    expected = (
        [c for calls_of in each for c in calls_of] * 3 if in_order else [c for e in each for c in e * 3]
    )
    assert calls == expected


def _mapped(array: np.ndarray, path: Path | None = None) -> bool:
    """Whether the array's memory is a file's mapping (not memory of the process's own); with
    `path`, that file's."""
    while isinstance(array, np.ndarray) and array.base is not None:
        if path is not None and isinstance(array, np.memmap):
            return Path(array.filename or "").resolve() == Path(path).resolve()
        array = array.base
    return path is None and isinstance(array, mmap.mmap)


def test_weights_are_copied_only_into_a_layout_of_their_own(decoder, tiny_gguf):
    """Fresh memory is slow to fault in, so a weight is copied at load only where the decoder
    multiplies it in a layout of its own (or mapped from the weight cache, which saved that
    copy): on our kernel's panels (where it runs: Winograd's products, and those of few
    columns a frame), tap by tap (the convs of many columns a frame), the transposed convs,
    and the residual units' dilated convs in Winograd's F(m, 7); else it is used in place, as
    the file holds it."""
    mmproj = tiny_gguf("custom_voice")[1]
    in_file = lambda a: _mapped(a, mmproj)
    most = decoder.matrices()
    on_kernel = any(m.variant is not None for m, _ in most.values())
    for m, columns in most.values():
        assert m.panels == (on_kernel and (m.column_major or columns < PANEL_COLUMNS))
        assert m.array.ndim == (3 if m.panels else 2)
    tfm = decoder.transformer
    few = [m.w for layer in tfm.layers for m in (layer.qkv, layer.out, layer.gate_up, layer.down)]
    few += [m.w for _, convnext in decoder.upsample for m in (convnext.pw1, convnext.pw2)]
    few += decoder.pre_conv.products + decoder.entry.products
    assert all(m.panels if on_kernel else in_file(m.array) for m in few)
    assert len(decoder.entry.products) == 1  # one product over gathered columns
    for block in decoder.blocks:
        for unit in block.units:
            assert unit.conv2.k == 1 and unit.conv2.method == "gathered"
            conv = unit.conv1
            if conv.method == "winograd":
                assert conv.outputs == winograd.fewest(conv.frame_columns, conv.dilation)
                assert len(conv.products) == winograd.size(conv.outputs)
                assert all(m.column_major for m in conv.products)
            else:
                assert conv.method == "taps" and len(conv.products) == conv.k
                assert most[id(conv.products[0])][1] > SPLIT_COLUMNS
            assert not any(in_file(m.array) for m in conv.products)
    assert not any(in_file(block.up.w.array) for block in decoder.blocks)
    assert not on_kernel or any(m.variant and not m.panels for m, _ in most.values())  # some in place


def test_tensors_back_to_back_join_in_place(tiny_gguf):
    from kazeia_stream.model import gguf_layout as L

    f = GGUFFile(tiny_gguf("custom_voice")[1])
    names = [name.format(bid=0) for name in (L.WAV_TFM_ATTN_Q, L.WAV_TFM_ATTN_K, L.WAV_TFM_ATTN_V)]
    joined, concatenated = f.joined(names), np.concatenate([f.tensor(name) for name in names])
    assert _mapped(joined) and np.array_equal(joined, concatenated)
    backwards = f.joined(names[::-1])  # not the file's order: a copy
    assert not _mapped(backwards)
    assert np.array_equal(backwards, np.concatenate([f.tensor(name) for name in names[::-1]]))
    quantized = GGUFFile(tiny_gguf("custom_voice", "q8_0")[1])  # the code predictor's: Q8_0
    names = [name.format(bid=0) for name in (L.CP_ATTN_Q, L.CP_ATTN_K, L.CP_ATTN_V)]
    joined = quantized.joined(names)
    assert not _mapped(joined)
    assert np.array_equal(joined, np.concatenate([quantized.tensor(name) for name in names]))
