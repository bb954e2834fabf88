"""Voice cloning with Base models against the official implementation: the reference's samples,
the clone prompts in all four modes, teacher-forced logits and the audio after an in-context
prompt; voices saved and reused; bad references refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import trio

import kazeia_stream
from kazeia_stream import UsageError
from kazeia_stream.engine.dump import dump
from kazeia_stream.model.reference import read_reference
from kazeia_stream.model.voice import Voice, VoiceLibrary

DATA = Path(__file__).parent / "data"
REFS = DATA / "refs"
REF_AUDIO = DATA / "voice" / "north_wind.wav"  # espeak-ng speech, 22.05 kHz
ENCODERS = np.load(REFS / "encoders_base.npz")
REF_TEXT = str(ENCODERS["ref_text"])


def rel(ours: np.ndarray, official: np.ndarray) -> float:
    assert ours.shape == official.shape
    return float(np.abs(ours - official).max() / np.abs(official).max())


def norm_rel(ours: np.ndarray, official: np.ndarray) -> float:
    assert ours.shape == official.shape
    return float(np.linalg.norm(ours - official) / np.linalg.norm(official))


def official_voice(icl: bool) -> Voice:
    """The official encoders' x-vector and reference codes, to test the prompts on their own."""
    return Voice(ENCODERS["x_vector"], ENCODERS["ref_codes"] if icl else None, REF_TEXT if icl else None)


@pytest.fixture(scope="module")
def runtime(tiny_runtime) -> kazeia_stream.Runtime:
    return tiny_runtime("base")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kazeia_stream", *args], capture_output=True, text=True, timeout=300
    )


def one_line_error(r: subprocess.CompletedProcess, *words: str) -> bool:
    lines = r.stderr.strip().splitlines()
    return (
        r.returncode == 1
        and len(lines) == 1
        and lines[0].startswith("kazeia-stream: error:")
        and all(w in lines[0] for w in words)
    )


# -- the reference recording ---------------------------------------------------------------------


def test_the_reference_is_resampled_to_the_official_samples():
    ref = read_reference(REF_AUDIO, None, 24000)
    assert ref.rate == 24000 and ref.samples.dtype == np.float32
    assert np.array_equal(ref.samples, ENCODERS["ref_wav_24k"])


def test_stereo_is_downmixed_and_any_rate_is_resampled(tmp_path):
    mono, rate = sf.read(REF_AUDIO, dtype="float32")
    stereo = tmp_path / "stereo.wav"
    sf.write(stereo, np.stack([mono, mono], axis=1), rate, subtype="FLOAT")
    assert np.array_equal(read_reference(stereo, None, 24000).samples, ENCODERS["ref_wav_24k"])
    for other in (8000, 44100, 48000):
        samples = read_reference(mono, rate, other).samples  # samples in, resampled to `other`
        ref = read_reference(samples, other, 24000)
        assert abs(len(ref.samples) - len(ENCODERS["ref_wav_24k"])) <= 3
        assert ref.seconds == pytest.approx(len(mono) / rate, abs=1e-3)


@pytest.mark.parametrize(
    "samples, rate, words",
    [
        (np.full(12000, 0.1, np.float32), 24000, "at least 1 s"),
        (np.full(31 * 16000, 0.1, np.float32), 16000, "at most 30 s"),
        (np.zeros(48000, np.float32), 24000, "silent"),
        (np.full(48000, np.nan, np.float32), 24000, "NaN"),
        (np.zeros((2, 3, 4), np.float32), 24000, "shape"),
        (np.full(48000, 0.1, np.float32), None, "sample rate"),
    ],
)
def test_bad_reference_samples_are_refused(samples, rate, words):
    with pytest.raises(UsageError, match=words):
        read_reference(samples, rate, 24000)


def test_bad_reference_files_are_refused(tmp_path):
    text = tmp_path / "notes.wav"
    text.write_text("not audio at all")
    for path, words in (
        (tmp_path / "missing.wav", "no such file"),
        (text, "not an audio file"),
        (tmp_path, "folder"),
    ):
        with pytest.raises(UsageError, match=words):
            read_reference(path, None, 24000)


# -- prompts, logits and audio against the official implementation ---------------------------------


def test_clone_prompts_match_the_official_ones_in_all_four_modes(runtime):
    ref = np.load(REFS / "prompts_base.npz")
    cases = json.loads(str(ref["cases_json"]))
    assert {(c["ref_text"] is None, c["non_streaming"]) for c in cases} == {
        (True, False),
        (True, True),
        (False, False),
        (False, True),
    }
    for i, case in enumerate(cases):
        voice = official_voice(icl=case["ref_text"] is not None)
        prompt = runtime.model.prompt(
            case["text"], voice=voice, language=case["language"], text_streaming=not case["non_streaming"]
        )
        assert rel(prompt.prefill, ref[f"c{i}_prefill"]) <= 1e-5, case["name"]
        assert rel(prompt.trailing, ref[f"c{i}_trailing"]) <= 1e-5, case["name"]


def test_teacher_forced_logits_and_audio_after_an_in_context_prompt(runtime):
    ref = np.load(REFS / "talker_base.npz")
    case = json.loads(str(ref["case_json"]))
    voice = official_voice(icl=True)
    prompt = runtime.model.prompt(case["text"], voice=voice, language=case["language"])
    out = dump(
        runtime.talker,
        runtime.code_predictor,
        runtime.codec,
        lambda: runtime.decoder_state(voice),
        prompt,
        runtime.model.text_feed(prompt),
        ref["codes"],
        3,
    )
    assert rel(out["talker_logits"], ref["talker_logits"]) <= 1e-4
    assert rel(out["cp_logits"], ref["cp_logits"]) <= 1e-4
    # the official decodes [reference codes + generated codes] and cuts the reference's samples;
    # the decoder primed with the reference gives the samples after the cut
    assert rel(out["audio"], ref["audio"]) <= 1e-4
    assert rel(out["audio_streamed"], ref["audio"]) <= 1e-4


def test_voice_from_audio_matches_the_official_encoders(runtime):
    voice = runtime.voice_from_audio(REF_AUDIO, ref_text=REF_TEXT)
    assert norm_rel(voice.x_vector, ENCODERS["x_vector"]) <= 1e-4
    assert np.array_equal(voice.ref_codes, ENCODERS["ref_codes"])
    assert voice.icl and voice.ref_text == REF_TEXT and voice.ref_seconds == pytest.approx(3.97, abs=0.01)
    samples, rate = sf.read(REF_AUDIO, dtype="float32")
    plain = kazeia_stream.voice_from_audio(runtime.model, samples, sample_rate=rate)
    assert not plain.icl and np.array_equal(plain.x_vector, voice.x_vector)


# -- speaking in a cloned voice --------------------------------------------------------------------


def test_a_base_model_needs_a_voice(runtime):
    with pytest.raises(UsageError, match="voice create"):
        runtime.synthesize("Hello.")
    with pytest.raises(UsageError, match="no built-in voices"):
        runtime.synthesize("Hello.", voice="ryan")


def test_voices_do_not_cross_models(runtime, tiny_runtime):
    with pytest.raises(UsageError, match="need a Base model"):
        tiny_runtime("custom_voice").synthesize("Hello.", voice=official_voice(icl=False))
    with pytest.raises(UsageError, match="Base model"):
        tiny_runtime("custom_voice").voice_from_audio(REF_AUDIO)
    wide = Voice(np.ones(2 * len(ENCODERS["x_vector"]), np.float32))
    with pytest.raises(UsageError, match="width"):
        runtime.synthesize("Hello.", voice=wide)


def test_a_saved_voice_speaks_as_the_voice_it_was_saved_from(runtime, tmp_path):
    voice = official_voice(icl=True)
    library = VoiceLibrary(tmp_path / "voices")
    path = library.save(voice, "north")
    assert path.stat().st_size < 8 * 1024 and library.names() == ["north"]
    loaded = library.load("north")
    assert loaded.name == "north" and loaded.ref_text == REF_TEXT
    assert np.array_equal(loaded.ref_codes, voice.ref_codes) and np.array_equal(
        loaded.x_vector, voice.x_vector
    )
    a, _ = runtime.synthesize("Hello there.", voice=voice, seed=5, max_frames=6)
    b, _ = runtime.synthesize("Hello there.", voice=loaded, seed=5, max_frames=6)
    assert len(a) > 0 and np.array_equal(a, b)
    with pytest.raises(UsageError, match="not a voice file"):
        (tmp_path / "junk.voice.safetensors").write_bytes(b"\x00" * 64)
        Voice.load(tmp_path / "junk.voice.safetensors")


@pytest.mark.parametrize("icl", [False, True])
async def test_streaming_text_in_a_cloned_voice_equals_offline_synthesis(runtime, icl):
    """Text arriving in pieces: the session waits for the tokens an in-context prompt aligns
    with the reference, then speaks exactly what offline synthesis speaks."""
    voice = official_voice(icl)
    # more tokens than an in-context prompt takes before the first frame (the rest trails)
    text = "On 2024-03-15 at 3:45 p.m., Dr. Müller paid $1,234.56 for a café crème; naïve? Perhaps."
    assert runtime.model.count_tokens(text) > runtime.model.text_needed(voice)
    expected, _ = await trio.to_thread.run_sync(
        lambda: runtime.synthesize(text, voice=voice, seed=2, text_streaming=True, max_frames=30)
    )

    async def pieces():
        for word in text.split(" "):
            yield word + " "
            await trio.sleep(0.001)

    async with runtime.open(voice=voice, seed=2, max_frames=30) as tts:
        chunks = [chunk.pcm async for chunk in tts.speak(pieces())]
    assert np.array_equal(np.concatenate(chunks), expected)


async def test_a_reference_is_primed_on_every_core_unless_a_stream_speaks(runtime, monkeypatch):
    """An in-context voice's reference is decoded once per voice when a session opens: on every
    core free when no stream speaks, else on the decoder's, as its passes run beside them."""
    from kazeia_stream.engine.codec import CodecDecoder

    seen, prime = [], CodecDecoder.prime

    def spy(self, state, codes, threads=None):
        seen.append((threads, runtime.cores.free()))
        return prime(self, state, codes, threads)

    monkeypatch.setattr(CodecDecoder, "prime", spy)
    await trio.to_thread.run_sync(runtime.decoder_state, official_voice(icl=True))
    async with runtime.stream():  # a stream speaking
        await trio.to_thread.run_sync(runtime.decoder_state, official_voice(icl=True))
    (alone, free), (beside, _) = seen
    assert alone == free and beside == runtime.threads.decoder


# -- the command line ------------------------------------------------------------------------------


@pytest.mark.subprocess
def test_cli_voice_create_list_and_speak(tiny_gguf, tmp_path):
    model, voices = str(tiny_gguf("base")[0]), str(tmp_path / "voices")
    r = run_cli("voice", "create", "north", "--model", model, "--ref-audio", str(REF_AUDIO),
                "--ref-text", REF_TEXT, "--voices", voices)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "saved voice 'north' (icl, 4.0 s" in r.stderr
    r = run_cli(
        "voice", "create", "north", "--model", model, "--ref-audio", str(REF_AUDIO), "--voices", voices
    )
    assert one_line_error(r, "exists", "--force")
    r = run_cli(
        "voice", "create", "plain", "--model", model, "--ref-audio", str(REF_AUDIO), "--voices", voices
    )
    assert r.returncode == 0, r.stderr
    r = run_cli("voices", "--model", model, "--voices", voices)
    assert r.returncode == 0 and "north (icl, 4.0 s), plain (x-vector, 4.0 s)" in r.stdout, r.stdout
    out = tmp_path / "north.wav"
    r = run_cli("Hello there.", "--model", model, "--voice", "north", "--voices", voices, "--seed", "1",
                "-o", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    saved = Voice.load(Path(voices) / "north.voice.safetensors")
    audio, rate = sf.read(out, dtype="float32")
    runtime = kazeia_stream.Runtime(kazeia_stream.load_model(model))
    expected, _ = runtime.synthesize("Hello there.", voice=saved, seed=1)
    assert rate == 24000 and len(audio) == len(expected) > 0
    np.testing.assert_allclose(audio, expected, atol=1e-4)  # through 16-bit PCM


@pytest.mark.subprocess
def test_cli_one_off_reference_and_its_errors(tiny_gguf, tmp_path):
    model, out = str(tiny_gguf("base")[0]), tmp_path / "once.wav"
    r = run_cli("Hello.", "--model", model, "--ref-audio", str(REF_AUDIO), "--seed", "1", "-o", str(out))
    assert r.returncode == 0 and sf.info(out).frames > 0, r.stderr
    r = run_cli("Hello.", "--model", model, "-o", str(tmp_path / "none.wav"))
    assert one_line_error(r, "voice create") and not (tmp_path / "none.wav").exists()
    r = run_cli("Hello.", "--model", model, "--ref-text", "words", "-o", str(out))
    assert one_line_error(r, "--ref-audio")
    r = run_cli("Hello.", "--model", model, "--voice", "nobody", "--voices", str(tmp_path), "-o", str(out))
    assert one_line_error(r, "no saved voice 'nobody'")
    short = tmp_path / "short.wav"
    sf.write(short, np.full(8000, 0.1, np.float32), 16000)
    r = run_cli("Hello.", "--model", model, "--ref-audio", str(short), "-o", str(out))
    assert one_line_error(r, "at least 1 s")
    r = run_cli(
        "Hello.", "--model", str(tiny_gguf("custom_voice")[0]), "--ref-audio", str(REF_AUDIO), "-o", str(out)
    )
    assert one_line_error(r, "Base model")
    assert sf.info(out).frames > 0  # the file written first is still there


@pytest.mark.subprocess
def test_cli_dump_with_a_reference_holds_what_the_encoders_saw(tiny_gguf, tmp_path):
    ref = np.load(REFS / "talker_base.npz")
    case = json.loads(str(ref["case_json"]))
    codes, out = tmp_path / "codes.npy", tmp_path / "dump.npz"
    np.save(codes, ref["codes"])
    r = run_cli("dump", "--model", str(tiny_gguf("base")[0]), "--text", case["text"], "--language",
                case["language"], "--ref-audio", str(REF_AUDIO), "--ref-text", REF_TEXT,
                "--codes", str(codes), "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    d = np.load(out)
    assert np.array_equal(d["ref_wav_24k"], ENCODERS["ref_wav_24k"])
    # the official STFT rounds in float32, which shows in the weakest bins: compare as norms
    assert norm_rel(d["mel"], ENCODERS["mel"]) <= 1e-5
    assert norm_rel(d["x_vector"], ENCODERS["x_vector"]) <= 1e-4
    assert np.array_equal(d["ref_codes"], ENCODERS["ref_codes"])
    assert rel(d["prefill"], ref["prefill"]) <= 1e-4 and rel(d["talker_logits"], ref["talker_logits"]) <= 1e-4
    assert rel(d["audio"], ref["audio"]) <= 1e-4
