"""`kazeia-stream "text"` speaking into a real (null) sound device, recorded from its monitor."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import trio
from audio import align, correlation, gain
from processes import FAULTHANDLER, signalled

from kazeia_stream.stages.playback import AudioPlayer

TEXT = "Hello there, this is the live playback test."


@pytest.fixture(scope="module")
def model_path(tiny_gguf) -> str:
    return str(tiny_gguf("custom_voice")[0])


@pytest.mark.subprocess
def test_cli_plays_the_speech_in_real_time(pulse_null_sink, model_path, tiny_runtime):
    sent = tiny_runtime("custom_voice").synthesize(TEXT, voice="ryan", seed=5, text_streaming=True)[0]
    with pulse_null_sink.record() as rec:
        start = time.perf_counter()
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "kazeia_stream",
                TEXT,
                "--model",
                model_path,
                "--voice",
                "ryan",
                "--seed",
                "5",
            ],
            capture_output=True,
            timeout=300,
            env=pulse_null_sink.subprocess_env(),
        )
        wall = time.perf_counter() - start
        time.sleep(0.3)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout == b"" and r.stderr == b""
    _, played = align(sent, rec.samples())
    assert correlation(sent, played) > 0.99
    assert gain(sent, played) == pytest.approx(1.0, abs=0.03)
    assert wall >= len(sent) / 24000  # it waits until the last sample was heard


@pytest.mark.subprocess
def test_missing_device_is_a_one_line_error(pulse_null_sink, model_path):
    r = subprocess.run(
        [sys.executable, "-m", "kazeia_stream", "Hi.", "--model", model_path, "--device", "no-such-card"],
        capture_output=True,
        timeout=120,
        env=pulse_null_sink.subprocess_env(),
    )
    err = r.stderr.decode().strip()
    assert r.returncode != 0 and "no audio output device 'no-such-card'" in err
    assert len(err.splitlines()) == 1


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "sig, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_a_signal_during_live_playback_stops_it_in_one_line(pulse_null_sink, model_path, sig, code, word):
    with pulse_null_sink.record() as rec:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kazeia_stream", TEXT * 10, "--model", model_path],
            stderr=subprocess.PIPE,
            env={**pulse_null_sink.subprocess_env(), **FAULTHANDLER},
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not np.any(np.abs(rec.samples()) > 1e-3):
            time.sleep(0.05)  # until the speech is heard
        rc, _, err = signalled(proc, sig)
    assert rc == code and err.decode().strip() == f"kazeia-stream: {word}", err


async def test_barge_in_silences_the_sound_card_within_100_ms(pulse_null_sink, tiny_runtime):
    runtime = tiny_runtime("custom_voice")
    with pulse_null_sink.record() as rec, AudioPlayer(runtime.model.sample_rate) as player:
        async with runtime.open(voice="ryan", seed=5) as tts:
            utterance = tts.speak(TEXT)
            async for chunk in utterance:
                player.write(chunk.pcm)
                if player.playing and player.queued_seconds > 0.3:
                    break
            await trio.sleep(0.3)
            t_cancel = time.monotonic()
            tts.cancel()
            player.flush()
            await trio.sleep(0.5)
        recorded = rec.samples()
    loud = np.flatnonzero(np.abs(recorded) > 1e-3)
    assert loud.size, "nothing was played before the barge-in"
    assert rec.wall_time(int(loud[-1])) - t_cancel < 0.1
