"""The code predictor (graphs on the bundled libggml) against the official implementation's logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

import kazeia_stream
from kazeia_stream.engine import code_step, q8_product
from kazeia_stream.engine.code_predictor import CodePredictor
from kazeia_stream.engine.sampler import CodeSampler
from kazeia_stream.model import gguf_layout as L
from kazeia_stream.model.config import Sampling
from kazeia_stream.model.gguf_file import GGUFFile

REFS = Path(__file__).parent / "data" / "refs"
KINDS = ("custom_voice", "voice_design")  # voice_design: talker hidden 96 != 64, projection exists
MAX_ABS = 1e-3
MIN_ARGMAX = 0.99


@pytest.fixture(scope="module", params=KINDS)
def case(request, tiny_gguf):
    model = kazeia_stream.load_model(tiny_gguf(request.param)[0])
    cp = CodePredictor(model.mmproj_file, model.config.code_predictor, 2)
    yield model, cp, np.load(REFS / f"talker_{request.param}.npz")
    cp.close()


def _check(logits: np.ndarray, ref: np.ndarray) -> None:
    assert logits.shape == ref.shape
    assert np.abs(logits - ref).max() <= MAX_ABS
    assert (logits.argmax(-1) == ref.argmax(-1)).mean() >= MIN_ARGMAX


def test_teacher_forced_logits_match_the_official_code(case):
    _, cp, ref = case
    logits = np.stack([cp.teacher_forced_logits(h, c) for h, c in zip(ref["talker_hidden"], ref["codes"])])
    _check(logits, ref["cp_logits"])


def test_predict_step_by_step_matches_teacher_forcing(case):
    model, cp, ref = case
    f = model.mmproj_file
    for h, codes, ref_logits in zip(ref["talker_hidden"], ref["codes"], ref["cp_logits"]):
        seen: list[np.ndarray] = []
        forced = iter(codes[1:])

        def sample(logits: np.ndarray) -> int:
            seen.append(logits.copy())
            return int(next(forced))

        out, embedding = cp.predict(h, int(codes[0]), sample)
        assert out.tolist() == codes.tolist()
        steps = np.stack(seen)
        _check(steps, ref_logits)
        np.testing.assert_allclose(steps, cp.teacher_forced_logits(h, codes), atol=1e-6)
        # the talker's next input: its codec_embedding(c0) plus cp.embd[i-1](cb_i), codebook 15 included
        expected = f.rows(L.CP_OUT_EMBD, [codes[0]])[0].astype(np.float64)
        table = f.tensor(L.CP_EMBD)
        expected += sum(table[i - 1, codes[i]].astype(np.float64) for i in range(1, 16))
        assert embedding.dtype == np.float32 and embedding.shape == (model.config.talker.hidden_size,)
        np.testing.assert_allclose(embedding, expected, atol=1e-5, rtol=1e-5)


def test_greedy_predict_is_the_argmax_of_its_own_teacher_forcing(case):
    _, cp, ref = case
    # the reference codes were sampled, not greedy: check greedy decoding against itself
    for h, c0 in zip(ref["talker_hidden"][:4], ref["codes"][:4, 0]):
        out, _ = cp.predict(h, int(c0), lambda logits: int(np.argmax(logits)))
        assert out[0] == c0
        assert out[1:].tolist() == cp.teacher_forced_logits(h, out).argmax(-1).tolist()


def test_frames_are_independent_and_threads_can_change(case):
    _, cp, ref = case
    h, codes = ref["talker_hidden"][0], ref["codes"][0]
    first = cp.teacher_forced_logits(h, codes)
    cp.predict(ref["talker_hidden"][1], int(ref["codes"][1, 0]), lambda logits: int(np.argmax(logits)))
    cp.set_threads(1)
    try:
        again = cp.teacher_forced_logits(h, codes)
    finally:
        cp.set_threads(2)
    np.testing.assert_allclose(again, first, atol=1e-5)


def test_exact_mode_is_the_same_on_an_f32_file(case):
    model, cp, ref = case
    exact = CodePredictor(model.mmproj_file, model.config.code_predictor, 2, exact=True)
    try:
        h, codes = ref["talker_hidden"][2], ref["codes"][2]
        np.testing.assert_array_equal(
            exact.teacher_forced_logits(h, codes), cp.teacher_forced_logits(h, codes)
        )
    finally:
        exact.close()


@pytest.mark.parametrize("out_type, tol", [("f16", 0.01), ("q8_0", 0.25)])
def test_f16_and_q8_0_files_stay_close_in_both_modes(tiny_gguf, out_type, tol):
    """Quantized weights move the logits (max |logit| is about 5 here); the default mode's
    F16 ffn_down (F32 in an f16 file) must not move them much further."""
    ref = np.load(REFS / "talker_custom_voice.npz")
    model = kazeia_stream.load_model(tiny_gguf("custom_voice", out_type)[0])
    for exact in (True, False):
        cp = CodePredictor(model.mmproj_file, model.config.code_predictor, 1, exact=exact)
        logits = np.stack(
            [cp.teacher_forced_logits(h, c) for h, c in zip(ref["talker_hidden"], ref["codes"])]
        )
        codes = ref["codes"][0]
        forced = iter(codes[1:])
        _, embedding = cp.predict(ref["talker_hidden"][0], int(codes[0]), lambda logits: int(next(forced)))
        cp.close()
        f = model.mmproj_file
        table = f.tensor(L.CP_EMBD)  # dequantized by the gguf package
        expected = f.rows(L.CP_OUT_EMBD, [codes[0]])[0] + sum(table[i - 1, codes[i]] for i in range(1, 16))
        np.testing.assert_allclose(embedding, expected, atol=1e-5, rtol=1e-5)
        assert np.abs(logits - ref["cp_logits"]).max() <= tol, (out_type, exact)
        assert (logits.argmax(-1) == ref["cp_logits"].argmax(-1)).mean() >= 0.95, (out_type, exact)


def test_a_q8_0_file_with_llama_cpps_f32_ffn_down_gives_the_same_logits(
    tiny_gguf, tiny_checkpoint, tmp_path, monkeypatch
):
    """llama.cpp's converter keeps the code predictor's ffn_down F32 in a q8_0 mmproj, where ours
    writes it Q8_0: the engine quantizes that F32 one at load with libggml's quantizer, to the
    bytes our converter writes, so both files give the same logits (and the F32 one keeps its
    F32 ffn_down in exact mode)."""
    from kazeia_stream.model import convert as convert_module

    def llama_cpps_type(t, out_type):
        return QType.F32 if t.name.endswith(".ffn_down.weight") else rule(t, out_type)

    rule = convert_module._ggml_type
    monkeypatch.setattr(convert_module, "_ggml_type", llama_cpps_type)
    talker, published = convert_module.convert(tiny_checkpoint("custom_voice"), tmp_path, "q8_0")
    monkeypatch.undo()
    ours = tiny_gguf("custom_voice", "q8_0")[1]
    down = L.CP_FFN_DOWN.format(bid=0)
    model = kazeia_stream.load_model(talker)
    assert GGUFFile(published).tensor_type(down) == QType.F32
    assert GGUFFile(ours).tensor_type(down) == QType.Q8_0
    ref = np.load(REFS / "talker_custom_voice.npz")
    h, codes = ref["talker_hidden"][1], ref["codes"][1]
    logits = {}
    for path, exact in ((published, False), (ours, False), (published, True)):
        cp = CodePredictor(GGUFFile(path), model.config.code_predictor, 1, exact=exact)
        logits[path, exact] = cp.teacher_forced_logits(h, codes)
        cp.close()
    np.testing.assert_array_equal(logits[published, False], logits[ours, False])
    assert 0 < np.abs(logits[published, True] - logits[ours, False]).max() < 0.25


def test_f16_ffn_down_input_beyond_f16_range_stays_finite(tiny_gguf, monkeypatch, tmp_path):
    """The real model's ffn_down input peaks near 1.5e5, past F16's 65504: blow the tiny one's up
    likewise (ffn_norm x 300 scales gate and up, in a copy of the file) and compare with the
    exact F32 ffn_down."""
    from kazeia_stream.engine import code_predictor as cp_module
    from kazeia_stream.model.gguf_file import GGUFFile

    talker, mmproj = tiny_gguf("custom_voice", "f16")
    data = bytearray(mmproj.read_bytes())
    model = kazeia_stream.load_model(talker)
    for bid in range(model.config.code_predictor.num_layers):  # ffn_norm, F32 in every file
        offset, size = model.mmproj_file.span(L.CP_FFN_NORM.format(bid=bid))
        norm = np.frombuffer(data, np.float32, size // 4, offset) * np.float32(300.0)
        data[offset : offset + size] = norm.tobytes()
    louder = tmp_path / mmproj.name
    louder.write_bytes(bytes(data))
    ref = np.load(REFS / "talker_custom_voice.npz")
    h, codes = ref["talker_hidden"][0], ref["codes"][0]
    results = {}
    for exact, scale in ((True, None), (False, None), (False, 1.0)):
        if scale is not None:
            monkeypatch.setattr(cp_module, "_FFN_DOWN_INPUT_SCALE", scale)
        cp = CodePredictor(GGUFFile(louder), model.config.code_predictor, 1, exact=exact)
        results[exact, scale] = cp.teacher_forced_logits(h, codes)
        cp.close()
    exact, compact, unscaled = results[True, None], results[False, None], results[False, 1.0]
    assert np.isfinite(exact).all() and np.isfinite(compact).all()
    assert not np.isfinite(unscaled).all()  # the overflow the scaling avoids
    assert np.abs(compact - exact).max() <= 0.02 * np.abs(exact).max()


@pytest.fixture
def c_steps():
    if code_step.kernel() is None:
        pytest.skip("the code step's kernel was not built")


@pytest.mark.parametrize(
    "out_type, interrupted", [("f32", False), ("f16", False), ("q8_0", False), ("q8_0", True)]
)
def test_the_steps_in_c_give_the_python_steps_codes_and_inputs(
    tiny_gguf, out_type, interrupted, c_steps, monkeypatch
):
    """Steps 2..15 in C (`code_step`: in one call, until the cores' sharing changes) give the
    codes and the talker's next inputs of the Python steps bit for bit: one stream and three,
    sampling (top-p or not) and greedy, tables of each type the kernel reads (voice_design: an
    input projection, a width that is not the code predictor's), and `interrupted`, a change
    before each call's second step, so that each call runs one step and the next goes on."""
    model = kazeia_stream.load_model(tiny_gguf("voice_design", out_type)[0])
    cp = CodePredictor(model.mmproj_file, model.config.code_predictor, 2, max_streams=3)
    ref = np.load(REFS / "talker_voice_design.npz")
    hidden, code0 = ref["talker_hidden"], ref["codes"][:, 0]
    settings = [Sampling(True, 0.9, 50, 1.0), Sampling(True, 1.5, 0, 0.8), Sampling(False)]
    steps = []  # the streams of each step run in C
    run = code_step.CodeSteps.run

    def counted(self, replays, threads, first, changes, seen):
        if interrupted:
            changes[0] += 1
        done = run(self, replays, threads, first, changes, seen)
        assert done == (1 if interrupted else len(replays))
        steps.extend([len(self.codes)] * done)
        return done

    def frames():
        out = []
        for params in settings:
            for first, n in ((0, 1), (1, 3)):
                samplers = [CodeSampler(params, np.random.default_rng(first + s)) for s in range(n)]
                for _ in range(2):  # two frames: the second's draws take the generators' next uniforms
                    out.append(cp.predict_many(hidden[first : first + n], code0[first : first + n], samplers))
        return out

    monkeypatch.setattr(code_step.CodeSteps, "run", counted)
    native = frames()
    # every step after the first in C; three streams' once the way their products run is
    # chosen (at F32, after `forward_many` timed both)
    assert steps.count(1) == 2 * 14 * len(settings) and steps.count(3) > 0
    monkeypatch.setattr(code_step, "kernel", lambda: None)
    count = len(steps)
    python = frames()
    cp.close()
    assert len(steps) == count
    for (codes, inputs), (want_codes, want_inputs) in zip(native, python):
        np.testing.assert_array_equal(codes, want_codes)
        np.testing.assert_array_equal(inputs, want_inputs)
    sampled = native[: 2 * 2 * 2]  # the two sampling settings' frames (greedy ones repeat)
    assert len({c.tobytes() for c, _ in sampled}) == len(sampled)  # they draw differently


def test_the_c_steps_read_every_f16_as_numpy_does(c_steps):
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)  # subnormals, infinities, NaNs
    out = np.empty(len(halves), np.float32)
    read = code_step.kernel().kz_code_step_row
    assert read(halves.ctypes.data, int(QType.F16), len(halves), 0, out.ctypes.data)
    np.testing.assert_array_equal(out.view(np.uint32), halves.astype(np.float32).view(np.uint32))


def test_the_c_steps_can_be_turned_off(monkeypatch, c_steps):
    monkeypatch.setenv(code_step.ENV, "0")
    code_step.kernel.cache_clear()
    try:
        assert code_step.kernel() is None
    finally:
        monkeypatch.undo()
        code_step.kernel.cache_clear()
    assert code_step.kernel() is not None


@pytest.mark.skipif(not q8_product.KERNEL.available(), reason="our Q8_0 kernel does not run here")
def test_a_runtime_builds_a_first_frame_s_graphs_while_its_vocabulary_loads(tiny_gguf, monkeypatch):
    """The generator's thread builds the code predictor's graphs (and the talker's steps')
    while the main thread waits for the vocabulary: a first utterance's frames build none of
    the code predictor's (whose products our kernel takes: Q8_0), and are the same as a
    runtime's later utterances."""
    from kazeia_stream.engine.frames import GenerationOptions
    from kazeia_stream.engine.qwen3 import Qwen3LM

    model = kazeia_stream.load_model(tiny_gguf("custom_voice", "q8_0")[0])
    runtime = kazeia_stream.Runtime(model)
    runtime.generator.call(lambda: None)  # after the runtime's own first call
    built, build = [], Qwen3LM._build
    monkeypatch.setattr(Qwen3LM, "_build", lambda lm, *shape: built.append(lm) or build(lm, *shape))

    def frames() -> list[np.ndarray]:
        prompt = model.prompt("A first utterance.", voice="ryan", text_streaming=True)
        options = GenerationOptions(max_frames=3, ignore_eos=True)
        state = runtime.frames.start(prompt, model.text_feed(prompt), options, np.random.default_rng(3))
        try:
            return [runtime.frames.next_frame(state) for _ in range(3)]
        finally:
            runtime.frames.finish(state)

    first = frames()
    assert built and runtime.code_predictor.lm not in built  # the talker's prefill graph was built
    assert all(np.array_equal(a, b) for a, b in zip(first, frames()))
