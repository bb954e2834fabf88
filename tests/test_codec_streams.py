"""The codec decoder's `push_many`: several streams decoded together give each stream's own
decode to the bit, and leave each state as pushing that stream alone would."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np
import pytest
from decoders import PRODUCTS, tiny_decoder

from kazeia_stream.engine.codec import CodecDecoder, DecoderState
from kazeia_stream.engine.codec_layers import ContextBuffer


@pytest.fixture(scope="module", params=PRODUCTS)
def decoder(tiny_gguf, request) -> CodecDecoder:
    return tiny_decoder(tiny_gguf("custom_voice")[1], request.param)


@pytest.fixture(scope="module")
def utterances(decoder) -> list[np.ndarray]:
    """Five utterances' codes, 200 frames each."""
    rng = np.random.default_rng(7)
    return [rng.integers(0, decoder.quantizer.codebook_size, (200, decoder.num_groups)) for _ in range(5)]


def _arrays(state: DecoderState) -> Iterator[np.ndarray]:
    """Every array of a state: the convolutions' contexts and tails, the transformer's."""

    def walk(x: object) -> Iterator[np.ndarray]:
        if isinstance(x, ContextBuffer):
            yield x.buf[:, : x.width]
        elif isinstance(x, np.ndarray):
            yield x
        elif isinstance(x, (list, tuple)):
            for y in x:
                yield from walk(y)

    yield from walk([state.pre_conv, state.upsample, state.entry, state.blocks, state.post_conv])
    yield state.transformer.slot_pos
    for kv in state.transformer.layers:
        yield kv.keys
        yield kv.values


def _assert_same_state(batched: DecoderState, solo: DecoderState) -> None:
    assert batched.position == solo.position
    for b, s in zip(_arrays(batched), _arrays(solo), strict=True):
        assert b.shape == s.shape
        np.testing.assert_array_equal(b, s)


def test_streams_at_different_positions_decode_as_each_alone(decoder, utterances):
    """Streams started at different times, with different chunk histories, one primed; they
    join and leave between rounds, with rounds of 1 frame up to more than a pass's 16."""
    spf = decoder.samples_per_frame
    solo = [decoder.new_state() for _ in utterances]
    pos = [0] * len(utterances)
    for n in (7, 16, 9):  # stream 1 is 32 frames in
        decoder.push(solo[1], utterances[1][pos[1] : pos[1] + n])
        pos[1] += n
    decoder.prime(solo[2], utterances[2][:75])  # an in-context voice's reference
    pos[2] = 75
    decoder.push(solo[3], utterances[3][:3])
    pos[3] = 3
    batched = copy.deepcopy(solo)
    rounds = [  # (streams, frames each)
        ([0, 1, 2], 1),
        ([0, 1, 2], 3),
        ([1, 2], 1),
        ([0, 1, 2, 3], 17),
        ([3, 0], 1),
        ([2], 2),
        ([4, 2, 0, 1], 5),
        ([0, 1, 2, 3, 4], 50),
        ([4, 1], 1),
    ]
    for streams, n in rounds:
        codes = [utterances[s][pos[s] : pos[s] + n] for s in streams]
        audio = decoder.push_many([batched[s] for s in streams], codes)
        assert len(audio) == len(streams)
        for s, a, c in zip(streams, audio, codes):
            assert a.dtype == np.float32 and a.shape == (n * spf,)
            np.testing.assert_array_equal(a, decoder.push(solo[s], c))
            _assert_same_state(batched[s], solo[s])
            pos[s] += n
    assert [state.position for state in batched] == pos
    assert pos[0] > 72 and pos[2] > 75 + 72  # past the attention window


def test_one_stream_is_the_one_shot_decode(decoder, utterances):
    codes = utterances[0][:80]
    state = decoder.new_state()
    parts = [decoder.push_many([state], [codes[i : i + n]])[0] for i, n in ((0, 1), (1, 20), (21, 59))]
    np.testing.assert_array_equal(np.concatenate(parts), decoder.decode(codes))
    assert decoder.push_many([], []) == []


def test_zero_frames_leave_the_states_alone(decoder, utterances):
    states = [decoder.new_state(), decoder.new_state()]
    decoder.push(states[1], utterances[1][:4])
    before = copy.deepcopy(states)
    audio = decoder.push_many(states, [utterances[0][:0], utterances[1][4:4]])
    assert [a.shape for a in audio] == [(0,), (0,)]
    for state, old in zip(states, before):
        _assert_same_state(state, old)


def test_rejects_bad_arguments_before_decoding(decoder, utterances):
    a, b = decoder.new_state(), decoder.new_state()
    codes = utterances[0]
    cases = [
        ([a, b], [codes[:2], codes[:3]], "same number of frames"),
        ([a, b], [codes[:2], codes[:2, :15]], "codes must be"),
        ([a, b], [codes[:2], codes[0]], "codes must be"),
        ([a, b], [codes[:2], np.full((2, 16), 2048)], "codes must be <"),
        ([a, b], [codes[:2]], "2 states for 1 code arrays"),
        ([a, a], [codes[:2], codes[:2]], "pushed twice"),
    ]
    for states, arrays, message in cases:
        with pytest.raises(ValueError, match=message):
            decoder.push_many(states, arrays)
    assert a.position == b.position == 0


@pytest.mark.parametrize("columns", [1, 2, 7, 32, 33])
def test_matmul_in_row_blocks_is_the_product(monkeypatch, columns):
    """The few columns of several streams go through `_matmul`'s row blocks where OpenBLAS
    has its small-matrix kernel (forced on here; the tiny model's products are too small)."""
    from kazeia_stream.engine import matrix

    monkeypatch.setattr(matrix, "_small_gemm", lambda: True)
    rng = np.random.default_rng(columns)
    w = rng.standard_normal((1000, 512), dtype=np.float32)
    buf = rng.standard_normal((512, columns + 3), dtype=np.float32)
    x = buf[:, 3:]  # a tap: a column view of a context buffer
    expected = w.astype(np.float64) @ x.astype(np.float64)
    np.testing.assert_allclose(matrix.matmul(w, x), expected, rtol=1e-4, atol=1e-4)
    out = np.empty((1000, columns), np.float32)
    assert matrix.matmul(w, x, out=out) is out
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
