"""A page of text is spoken whole, as sentence-bounded segments, through the API, -o and --pipe."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
import trio

import kazeia_stream
from kazeia_stream.engine.frames import FrameLoop, GenerationOptions
from kazeia_stream.engine.talker import Talker
from kazeia_stream.model.segments import split_text

pytestmark = [pytest.mark.slow]

PARAGRAPH = (
    "The lighthouse keeper climbed the stairs every evening at dusk. He polished the great "
    "lens, trimmed the wick, and watched the ships pass along the rocky coast! Did anyone "
    "ever thank him? Perhaps not, but he did not mind; the light was its own reward.\n\n"
)
PAGE = (PARAGRAPH * 30)[:5000]
FRAME = 1920


@pytest.fixture(scope="module")
def runtime(capped_model) -> kazeia_stream.Runtime:
    return kazeia_stream.Runtime(kazeia_stream.load_model(capped_model))


@pytest.fixture(scope="module")
def segments(runtime) -> list[str]:
    probe = runtime.probe("ryan", "auto", None)
    return split_text(PAGE, runtime.max_segment_bytes(probe))


@pytest.fixture(scope="module")
def page_audio(runtime) -> np.ndarray:
    """The page spoken by the API as a session would speak it (text streamed in, seed 2)."""
    return runtime.synthesize(PAGE, voice="ryan", seed=2, text_streaming=True)[0]


def frames_per_segment(n_frames: int, n_segments: int) -> bool:
    """The capped model speaks 2 or 3 frames per utterance (EOS is masked for 2), so a page
    spoken whole gives 2-3 frames per segment; as one utterance it would give 3 at most."""
    return 2 * n_segments <= n_frames <= 3 * n_segments


def test_a_page_is_split_at_sentences_into_utterances_that_fit_the_talker(runtime, segments):
    assert len(PAGE) == 5000 and len(segments) >= 10
    assert all(s.rstrip()[-1] in ".!?" for s in segments[:-1])
    talker_ctx = runtime.talker.n_ctx
    for s in segments:  # its prompt and its frame cap fit in the talker's context
        prompt = runtime.model.prompt(s, voice="ryan", text_streaming=False)
        assert len(prompt.prefill) + 8 * prompt.n_text_tokens <= talker_ctx


def test_the_api_speaks_every_segment(runtime, segments, page_audio):
    n = len(page_audio)
    assert n % FRAME == 0 and frames_per_segment(n // FRAME, len(segments))
    again, _ = runtime.synthesize(PAGE, voice="ryan", seed=2, text_streaming=True)
    assert np.array_equal(page_audio, again)


async def test_a_session_speaks_every_segment_back_to_back(runtime, segments, page_audio):
    async def llm():
        for i in range(0, len(PAGE), 37):
            yield PAGE[i : i + 37]
            await trio.sleep(0)

    async with runtime.open(voice="ryan", seed=2) as tts:
        for text in (PAGE, llm()):
            utterance = tts.speak(text)
            chunks = [c async for c in utterance]
            pcm = np.concatenate([c.pcm for c in chunks])
            assert np.array_equal(pcm, page_audio)
            indices = [c.frame_index for c in chunks]
            assert indices == sorted(indices) and utterance.metrics.frames == len(pcm) // FRAME


async def test_frames_queued_behind_a_slow_decoder_never_join_the_next_segment_s(runtime, slow_decoder):
    """Each segment starts the decoder from a new state: a push of queued frames stops before
    the next segment's first (2-3 frames a segment here, up to 3 queued)."""
    text = PAGE[:1000]
    offline, _ = runtime.synthesize(text, voice="ryan", seed=2, text_streaming=True)
    pushes = slow_decoder(runtime, 0.03)
    async with runtime.open(voice="ryan", seed=2) as tts:
        pcm = np.concatenate([c.pcm async for c in tts.speak(text)])
    assert max(pushes) > 1 and np.array_equal(pcm, offline)


@pytest.mark.subprocess
def test_the_cli_writes_the_whole_page(runtime, segments, capped_model, tmp_path):
    out = tmp_path / "page.wav"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kazeia_stream",
            PAGE,
            "-o",
            str(out),
            "--model",
            str(capped_model),
            "--voice",
            "ryan",
            "--seed",
            "4",
        ],
        capture_output=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr.decode()
    written, _ = sf.read(str(out), dtype="float32")
    audio, _ = runtime.synthesize(PAGE, voice="ryan", seed=4)
    assert written.shape == audio.shape and np.abs(written - audio).max() <= 1.5 / 32768
    assert frames_per_segment(len(written) // FRAME, len(segments))


@pytest.mark.subprocess
def test_pipe_speaks_a_page_on_one_line(runtime, segments, capped_model):
    line = PAGE.replace("\n", " ")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kazeia_stream",
            "--pipe",
            "--model",
            str(capped_model),
            "--voice",
            "ryan",
            "--seed",
            "4",
            "--format",
            "f32le",
        ],
        input=(line + "\n").encode(),
        capture_output=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr.decode()
    pcm = np.frombuffer(r.stdout, "<f4")
    audio, _ = runtime.synthesize(line, voice="ryan", seed=4, text_streaming=True)
    assert np.array_equal(pcm, audio)
    max_bytes = runtime.max_segment_bytes(runtime.probe("ryan", "auto", None))
    assert frames_per_segment(len(pcm) // FRAME, len(split_text(line, max_bytes)))


def test_an_utterance_stops_at_the_end_of_the_talker_context(tiny_runtime):
    runtime = tiny_runtime("custom_voice")
    model = runtime.model
    small = Talker(model.talker_file, model.config.talker, 1, n_ctx=40)
    loop = FrameLoop(small, runtime.code_predictor, model.config)
    prompt = model.prompt("Hello there.", voice="ryan")
    state = loop.start(
        prompt,
        model.text_feed(prompt),
        GenerationOptions(seed=0, max_frames=500, ignore_eos=True),
        np.random.default_rng(0),
    )
    n = 0
    while loop.next_frame(state) is not None:
        n += 1
    assert n == 40 - len(prompt.prefill) + 1 and state.talker.pos == 40
