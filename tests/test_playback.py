"""AudioPlayer against real audio: a PulseAudio null sink plays at real-time speed and its
monitor is recorded, so the tests check what was heard and when, not just what was called."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import trio
from audio import SAMPLE_RATE, active_spans, align, chirp_signal, correlation, gain, tone

from kazeia_stream.channels import AudioChunk
from kazeia_stream.errors import UsageError
from kazeia_stream.stages import playback
from kazeia_stream.stages.playback import AudioPlayer, list_output_devices, prebuffer_for
from kazeia_stream.stages.sinks import play

SR = SAMPLE_RATE


def test_prebuffer_formula() -> None:
    assert prebuffer_for(1.0, 10.0) == pytest.approx(0.1)
    assert prebuffer_for(3.0, 10.0) == pytest.approx(0.1)
    assert prebuffer_for(0.5, 10.0) == pytest.approx(5.1)
    assert prebuffer_for(0.25, 4.0, margin=0.0) == pytest.approx(3.0)
    assert prebuffer_for(0.0, 2.0) == pytest.approx(2.1)  # nothing comes: wait for it all
    # The bound is tight: with B = L (1 - rate) the produced audio never falls behind playback.
    rate, length = 0.4, 6.0
    b = prebuffer_for(rate, length, margin=0.0)
    t = np.linspace(b / rate, length / rate, 1000)
    assert np.all(rate * t >= t - b / rate - 1e-9)


def _fake_sd(devices: list[dict], default: int = -1) -> SimpleNamespace:
    return SimpleNamespace(query_devices=lambda: devices, default=SimpleNamespace(device=[default, default]))


def test_device_resolution_without_audio() -> None:
    devs = [
        {"name": "mic", "max_output_channels": 0},
        {"name": "HDA Intel PCH: ALC3246 Analog (hw:0,0)", "max_output_channels": 2},
        {"name": "pulse", "max_output_channels": 32},
        {"name": "default", "max_output_channels": 32},
    ]
    sd = _fake_sd(devs, default=3)
    assert playback._resolve_device(sd, None) == 3
    assert playback._resolve_device(sd, 2) == 2
    assert playback._resolve_device(sd, "2") == 2
    assert playback._resolve_device(sd, "alc3246") == 1
    assert playback._resolve_device(sd, "pulse") == 2
    assert playback._resolve_device(_fake_sd(devs), None) == 1  # no default: first output
    with pytest.raises(UsageError, match=r"^no audio output device 'foo'; available: 'HDA"):
        playback._resolve_device(sd, "foo")
    with pytest.raises(UsageError, match="no audio output device 0; available"):
        playback._resolve_device(sd, 0)  # an input-only device
    with pytest.raises(UsageError, match="ambiguous"):
        playback._resolve_device(sd, "a")
    with pytest.raises(UsageError, match="^no audio output device found"):
        playback._resolve_device(_fake_sd(devs[:1]), None)


def test_portaudio_missing_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sounddevice", None)  # import fails
    with pytest.raises(UsageError, match="sounddevice"):
        AudioPlayer(SR).start()
    with pytest.raises(UsageError):
        list_output_devices()


def test_write_rejects_stereo() -> None:
    with pytest.raises(UsageError, match="mono"):
        AudioPlayer(SR).write(np.zeros((10, 2), np.float32))


# -- real audio ----------------------------------------------------------------------------


@pytest.mark.subprocess
def test_devices_visible_here_and_in_subprocesses(pulse_null_sink) -> None:
    assert any(d.endswith(": default") for d in list_output_devices())
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            ("from kazeia_stream.stages.playback import list_output_devices;print(list_output_devices())"),
        ],
        env=pulse_null_sink.subprocess_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "default" in out and "pulse" in out


def test_missing_device_is_one_line(pulse_null_sink) -> None:
    with pytest.raises(UsageError) as e:
        AudioPlayer(SR, device="no-such-card").start()
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("no audio output device 'no-such-card'; available: ")
    assert "'default'" in msg
    with pytest.raises(UsageError, match="no audio output device 99"):
        AudioPlayer(SR, device=99).start()


def test_plays_signal_exactly_in_real_time(pulse_null_sink) -> None:
    sent = chirp_signal(2.0)
    with pulse_null_sink.record() as rec, AudioPlayer(SR) as player:
        t0 = time.monotonic()
        for i in range(0, len(sent), 1920):  # 80 ms frames, as the engine produces them
            player.write(sent[i : i + 1920])
        write_s = time.monotonic() - t0
        # writes never wait for the device, and all of it is queued but what the device took
        # meanwhile: its first block (0.1-0.2 s measured) and what it played since
        assert write_s < 0.5
        elapsed = time.monotonic() - t0
        assert 2.0 - (elapsed + 0.25) <= player.queued_seconds <= 2.0
        assert player.wait_done(timeout=5)
        t_done = time.monotonic()
        wall = t_done - t0
        time.sleep(0.1)
    got = rec.samples()
    _, seg = align(sent, got)
    corr, g = correlation(sent, seg), gain(sent, seg)
    spans = active_spans(got)
    heard, ended = rec.wall_time(spans[-1][0]), rec.wall_time(spans[-1][1])
    span_wall = ended - heard
    print(
        f"writes {1000 * write_s:.1f} ms, first sound after {1000 * (heard - t0):.0f} ms, "
        f"wait_done {1000 * (t_done - ended):+.0f} ms from the last sound, corr {corr:.5f}, "
        f"gain {g:.4f}, played span {span_wall:.3f} s (wall)"
    )
    assert write_s < 0.05  # the producer never waits for the device
    assert corr > 0.99
    assert g == pytest.approx(1.0, abs=0.03)
    assert len(spans) == 1 and (spans[0][1] - spans[0][0]) / SR == pytest.approx(2.0, abs=0.02)
    assert span_wall == pytest.approx(2.0, abs=0.1)  # real time, not faster
    assert heard - t0 < 0.35  # device latency 0.2 s + one period
    assert -0.02 < t_done - ended < 0.06  # done = heard, not just handed to the device
    # the sink's clock may run a few ms a second off the monotonic one (1.995 s a span seen)
    assert 2.0 - 0.02 <= wall < 2.0 + 0.4
    assert player.underruns == 0


def test_flush_silences_within_100ms(pulse_null_sink) -> None:
    with pulse_null_sink.record() as rec, AudioPlayer(SR) as player:
        player.write(tone(4.0))
        time.sleep(1.2)  # steady playback; ~0.2 s more sits in the device's buffer
        t_flush = time.monotonic()
        player.flush()
        call_s = time.monotonic() - t_flush
        assert player.queued_seconds == 0
        time.sleep(0.5)
        # The player keeps working after a flush.
        player.write(tone(0.3, freq=660))
        assert player.wait_done(timeout=3)
        time.sleep(0.1)
    spans = active_spans(rec.samples())
    assert len(spans) == 2, spans
    silent_after = rec.wall_time(spans[0][1]) - t_flush
    print(f"flush() took {1000 * call_s:.1f} ms; silence {1000 * silent_after:.0f} ms after it")
    assert call_s < 0.05
    assert silent_after < 0.1
    assert (spans[1][1] - spans[1][0]) / SR == pytest.approx(0.3, abs=0.02)


def test_underruns_counted_when_starved(pulse_null_sink, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kazeia_stream")
    with pulse_null_sink.record() as rec, AudioPlayer(SR, prebuffer_s=0.1) as player:
        for _ in range(3):  # 0.2 s of audio every 0.5 s: slower than real time
            player.write(tone(0.2))
            time.sleep(0.5)
        player.write(tone(0.2))
        assert player.wait_done(timeout=3)
        n = player.underruns
        time.sleep(0.1)
    print(f"underruns {n}")
    assert n >= 3
    warnings = [r for r in caplog.records if "ran dry" in r.getMessage()]
    assert len(warnings) == 1  # once per utterance
    assert len(active_spans(rec.samples())) == 4  # each chunk played whole, then a pause


def test_no_underruns_after_end_of_stream(pulse_null_sink) -> None:
    with AudioPlayer(SR) as player:
        player.write(tone(0.3))
        player.end_of_stream()
        assert player.wait_done(timeout=3)
        time.sleep(0.3)  # the callback keeps running on an empty queue
        assert player.underruns == 0


def test_prebuffer_delays_start(pulse_null_sink) -> None:
    with pulse_null_sink.record() as rec, AudioPlayer(SR, prebuffer_s=1.0) as player:
        player.write(tone(0.6))
        time.sleep(0.6)
        assert not player.playing and player.queued_seconds == pytest.approx(0.6, abs=0.01)
        t_enough = time.monotonic()
        player.write(tone(0.6))  # 1.2 s queued >= 1.0 s: starts
        assert player.wait_done(timeout=3)
        # A short utterance under the prebuffer plays at end_of_stream().
        player.write(tone(0.3, freq=660))
        time.sleep(0.4)
        assert not player.playing
        t_eos = time.monotonic()
        player.end_of_stream()
        assert player.wait_done(timeout=3)
        time.sleep(0.1)
        assert player.underruns == 0
    spans = active_spans(rec.samples())
    assert len(spans) == 2, spans
    assert (spans[0][1] - spans[0][0]) / SR == pytest.approx(1.2, abs=0.02)  # no gap inside
    assert rec.wall_time(spans[0][0]) > t_enough - 0.05
    assert rec.wall_time(spans[1][0]) > t_eos
    assert (spans[1][1] - spans[1][0]) / SR == pytest.approx(0.3, abs=0.02)


async def test_drain_from_trio(pulse_null_sink) -> None:
    with AudioPlayer(SR) as player:
        t0 = trio.current_time()
        player.write(tone(0.5))
        with trio.fail_after(3):
            await player.drain()
        elapsed = trio.current_time() - t0
        assert 0.5 <= elapsed < 1.1
        # Cancellable: a drain that cannot finish in time is cancelled cleanly.
        player.write(tone(2.0))
        with trio.move_on_after(0.2) as scope:
            await player.drain()
        assert scope.cancelled_caught
        player.flush()


class SlowUtterance:
    """`n` chunks of 80 ms, one every 160 ms: a producer at half real time."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.metrics = SimpleNamespace(cancelled=False)

    async def __aiter__(self):
        for i in range(self.n):
            await trio.sleep(0.16)
            yield AudioChunk(i, tone(0.08, freq=440 + 20 * i), SR)


async def test_an_utterance_longer_than_expected_runs_dry_once_then_plays_to_the_end(pulse_null_sink):
    with pulse_null_sink.record() as rec, AudioPlayer(SR) as player:
        # 1.6 s of audio where 0.5 s was expected; the frame cap bounds it at 2 s.
        await play(SlowUtterance(20), player, expected_s=0.5, longest_s=2.0)
        assert player.underruns == 1
    spans = [(a, b) for a, b in active_spans(rec.samples(), min_gap_s=0.03)]
    assert len(spans) == 2, spans  # one pause, no stutter
    assert sum(b - a for a, b in spans) / SR == pytest.approx(1.6, abs=0.03)  # nothing lost
