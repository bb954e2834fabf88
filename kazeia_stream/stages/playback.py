"""Live playback through sounddevice that never blocks the producer.

Generation (trio tasks, llama.cpp threads) and the sound card run on different clocks. The
producer `write()`s PCM chunks into a queue; PortAudio's callback thread pulls from it. Neither
waits for the other: `write()` only appends under a short lock, and the callback only copies
into PortAudio's buffer (no allocation beyond array views, no logging, no I/O).

An utterance is the audio between the first `write()` and `end_of_stream()`. Its playback starts
only when `prebuffer_s` seconds are queued, or at `end_of_stream()` for short utterances, so a
producer slower than real time can buffer enough first that playback does not stutter; see
`prebuffer_for()`. If the queue runs dry before `end_of_stream()` (an underrun), playback pauses
and waits for `prebuffer_s` again rather than stuttering on every chunk that trickles in.

`flush()` is barge-in: it drops the queue and aborts the stream, which also drops what PortAudio
and the sound server had buffered (up to `latency` seconds), then restarts the stream.

sounddevice is imported lazily: PortAudio enumerates devices when it is initialised, and a
machine without PortAudio must still be able to write files. Every failure to open audio is a
one-line `UsageError`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from types import ModuleType, TracebackType
from typing import Any

import numpy as np
import trio

from ..errors import UsageError

log = logging.getLogger(__name__)

DEFAULT_PREBUFFER_S = 0.1


def prebuffer_for(
    rate: float, remaining_s: float, margin: float = 0.1, minimum: float = DEFAULT_PREBUFFER_S
) -> float:
    """Seconds of audio to queue before playback starts so that it never runs dry.

    `rate` is audio seconds produced per wall second (>= 1: faster than real time).
    `remaining_s` is the audio still to be produced, counted from a moment when nothing is
    queued (at the start of an utterance: its expected whole length).

    Playback of L = remaining_s seconds started once B seconds are queued ends at wall time
    B/rate + L; production ends at L/rate. Audio produced by time t is rate*t, audio played is
    t - B/rate; requiring rate*t >= t - B/rate up to t = L/rate gives B >= L * (1 - rate).
    A faster-than-real-time producer only needs `minimum` against scheduling jitter; a slower
    one gets L * (1 - rate) + `margin`.
    """
    if rate >= 1.0:
        return minimum
    return max(minimum, max(remaining_s, 0.0) * (1.0 - max(rate, 0.0)) + margin)


def _sounddevice() -> ModuleType:
    """Import sounddevice, turning a missing PortAudio into a one-line error."""
    try:
        import sounddevice
    except OSError as e:  # sounddevice raises OSError('PortAudio library not found')
        raise UsageError(f"cannot play audio: {e} (install it: apt-get install libportaudio2)") from None
    except ImportError:
        raise UsageError(
            "cannot play audio: the sounddevice package is missing (pip install sounddevice)"
        ) from None
    return sounddevice


def _output_devices(sd: ModuleType) -> list[tuple[int, str]]:
    return [(i, d["name"]) for i, d in enumerate(sd.query_devices()) if d["max_output_channels"] > 0]


def list_output_devices() -> list[str]:
    """Output devices as "INDEX: NAME" (either part can be passed as `device`)."""
    return [f"{i}: {name}" for i, name in _output_devices(_sounddevice())]


def _resolve_device(sd: ModuleType, device: str | int | None) -> int:
    """Index of the output device: the default, an index, or a unique (sub)name."""
    outputs = _output_devices(sd)
    available = ", ".join(f"{name!r} ({i})" for i, name in outputs) or "none"
    if not outputs:
        raise UsageError(
            "no audio output device found (no sound card, or no sound server "
            "such as PulseAudio running); write to a file instead"
        )
    if device is None:
        default = sd.default.device[1]
        if isinstance(default, str):
            device = default
        else:
            idx = int(default) if default is not None else -1
            return idx if idx in dict(outputs) else outputs[0][0]
    if isinstance(device, str) and device.strip().lstrip("-").isdigit():
        device = int(device)
    if isinstance(device, int):
        if device in dict(outputs):
            return device
        raise UsageError(f"no audio output device {device}; available: {available}")
    exact = [i for i, name in outputs if name == device]
    if exact:
        return exact[0]
    matches = [i for i, name in outputs if device.lower() in name.lower()]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise UsageError(f"no audio output device {device!r}; available: {available}")
    names = ", ".join(f"{name!r} ({i})" for i, name in outputs if i in matches)
    raise UsageError(f"audio output device {device!r} is ambiguous: {names}")


class AudioPlayer:
    """Plays float32 mono PCM on an output device from a queue the producer never waits on.

    Usage: `with AudioPlayer(24000) as p: p.write(pcm); ...; p.end_of_stream(); p.wait_done()`
    (or `await p.drain()` in trio). `prebuffer_s` may be changed at any time.
    """

    def __init__(
        self,
        sample_rate: int,
        device: str | int | None = None,
        latency: float = 0.2,
        prebuffer_s: float = DEFAULT_PREBUFFER_S,
    ) -> None:
        self.sample_rate = int(sample_rate)
        self.device = device
        self.latency = float(latency)
        self.prebuffer_s = float(prebuffer_s)
        self._lock = threading.Lock()  # guards the queue and the state below; held briefly
        self._chunks: deque[np.ndarray] = deque()
        self._head = 0  # samples of _chunks[0] already played
        self._queued = 0  # samples in _chunks not yet played
        self._playing = False  # prebuffer reached: the callback is emptying the queue
        self._eos = False  # end_of_stream() called for the current utterance
        self._new_utterance = True  # the next write() starts an utterance
        self._idle = threading.Event()  # set when nothing is queued nor waits to play
        self._idle.set()
        self._end_time = 0.0  # stream clock (PortAudio's) at which the last sample is heard
        self._underruns = 0
        self._utterance_underruns = 0
        self._warned = False
        self._stream: Any = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> AudioPlayer:
        """Open and start the output stream (it outputs silence until audio is queued)."""
        if self._stream is not None:
            return self
        sd = _sounddevice()
        index = _resolve_device(sd, self.device)
        try:
            stream = sd.OutputStream(
                samplerate=self.sample_rate,
                device=index,
                channels=1,
                dtype="float32",
                latency=self.latency,
                callback=self._callback,
            )
            stream.start()
        except sd.PortAudioError as e:
            name = sd.query_devices(index)["name"]
            raise UsageError(
                f"cannot open audio output {name!r} ({index}) at {self.sample_rate} Hz: {e}"
            ) from None
        self._stream = stream
        log.info(
            "audio output %r, %d Hz, latency %.0f ms",
            sd.query_devices(index)["name"],
            self.sample_rate,
            1000 * stream.latency,
        )
        return self

    def close(self) -> None:
        """Stop at once (queued audio is dropped) and release the device."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.abort()
            stream.close()
        self._clear()

    def __enter__(self) -> AudioPlayer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- producer side ---------------------------------------------------------------------

    # The producer's calls take the queue's lock from trio's thread: KI-protected, like the
    # scheduler's (`scheduler._Passes._submit`), so that a Ctrl-C never leaves it held.

    @trio.lowlevel.enable_ki_protection
    def write(self, pcm: np.ndarray) -> None:
        """Queue mono PCM (float32 in [-1, 1]); returns at once. The data is copied."""
        data = np.array(pcm, dtype=np.float32, copy=True)
        if data.ndim == 2 and data.shape[1] == 1:
            data = data[:, 0]
        if data.ndim != 1:
            raise UsageError(f"playback takes mono PCM, got an array of shape {np.shape(pcm)}")
        self._warn_underruns()
        if data.size == 0:
            return
        with self._lock:
            if self._new_utterance:
                self._new_utterance = False
                self._utterance_underruns = 0
                self._warned = False
            self._eos = False
            self._chunks.append(data)
            self._queued += data.size
            self._idle.clear()

    @trio.lowlevel.enable_ki_protection
    def end_of_stream(self) -> None:
        """The current utterance is complete: play what is queued even below the prebuffer."""
        with self._lock:
            self._eos = True
            self._new_utterance = True
            if self._queued == 0:
                self._playing = False
                self._idle.set()
        self._warn_underruns()

    def flush(self) -> None:
        """Barge-in: drop everything queued and what the device has buffered; silence follows
        within a few tens of milliseconds. The player stays open for the next utterance."""
        self._clear()
        stream = self._stream
        if stream is not None:  # abort drops PortAudio's (and the sound server's) buffer
            stream.abort()
            stream.start()

    @property
    def queued_seconds(self) -> float:
        """Audio queued and not yet handed to the device (excludes the device's own latency)."""
        return self._queued / self.sample_rate

    @property
    def underruns(self) -> int:
        """Callbacks that found the queue dry mid-utterance, plus device-reported underflows."""
        return self._underruns

    @property
    def playing(self) -> bool:
        """Whether an utterance is being played (the prebuffer was reached)."""
        return self._playing

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until all queued audio has been played; True unless `timeout` ran out.

        Implies `end_of_stream()` (else audio below the prebuffer would never play). The queue
        empties up to `latency` (plus one callback period) before the sound does, so this waits
        until the time PortAudio said the last sample reaches the DAC.
        """
        if self._stream is None:
            raise UsageError("AudioPlayer.wait_done() before start()")
        self.end_of_stream()
        start = time.monotonic()
        if not self._idle.wait(timeout):
            return False
        tail = self._tail()
        if timeout is not None and time.monotonic() - start + tail > timeout:
            time.sleep(max(0.0, timeout - (time.monotonic() - start)))
            return False
        time.sleep(tail)
        return True

    async def drain(self, poll_s: float = 0.005) -> None:
        """trio: like `wait_done()` without a thread; cancellable."""
        if self._stream is None:
            raise UsageError("AudioPlayer.drain() before start()")
        self.end_of_stream()
        while not self._idle.is_set():
            await trio.sleep(poll_s)
        await trio.sleep(self._tail())

    # -- internals -------------------------------------------------------------------------

    @trio.lowlevel.enable_ki_protection
    def _clear(self) -> None:
        with self._lock:
            self._chunks.clear()
            self._head = 0
            self._queued = 0
            self._playing = False
            self._eos = False
            self._new_utterance = True
            self._idle.set()

    def _tail(self) -> float:
        """Seconds until the last sample handed to the device is heard."""
        stream = self._stream
        if stream is None or self._end_time <= 0.0:
            return 0.0
        return min(max(0.0, self._end_time - stream.time), 2.0 * stream.latency + 0.5)

    def _warn_underruns(self) -> None:
        """Log from the producer's thread (never from the callback), once per utterance."""
        if self._utterance_underruns and not self._warned:
            self._warned = True
            log.warning(
                "audio playback ran dry (%d underruns so far); generation is slower "
                "than real time: raise prebuffer_s (see prebuffer_for)",
                self._underruns,
            )

    def _callback(self, outdata: np.ndarray, frames: int, time_info: Any, status: Any) -> None:
        out = outdata[:, 0]
        with self._lock:
            if status.output_underflow and self._playing:
                self._underrun()
            if not self._playing:
                need = self.prebuffer_s * self.sample_rate
                if self._queued == 0 or (self._queued < need and not self._eos):
                    out.fill(0.0)
                    return
                self._playing = True
            pos = 0
            chunks = self._chunks
            while pos < frames and chunks:
                chunk = chunks[0]
                n = min(frames - pos, chunk.size - self._head)
                out[pos : pos + n] = chunk[self._head : self._head + n]
                pos += n
                self._head += n
                if self._head == chunk.size:
                    chunks.popleft()
                    self._head = 0
            self._queued -= pos
            if pos < frames:
                out[pos:].fill(0.0)
            if self._queued == 0 and self._eos:  # utterance over
                self._playing = False
                # When its last sample reaches the DAC (PortAudio may report 0: unknown).
                dac = time_info.outputBufferDacTime or time_info.currentTime + self.latency
                self._end_time = dac + pos / self.sample_rate
                self._idle.set()
            elif pos < frames:  # starved: pause until the prebuffer is reached again
                self._playing = False
                self._underrun()

    def _underrun(self) -> None:
        self._underruns += 1
        self._utterance_underruns += 1
