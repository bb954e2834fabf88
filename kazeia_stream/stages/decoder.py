"""Decoder actor: frames in, PCM out, through the passes of the runtime's codec decoder."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import numpy as np
import trio

from ..channels import AudioChunk, Frame, UtteranceMetrics
from ..engine.codec import DecoderState
from ..scheduler import Decoder

MAX_PUSH = 4  # frames a push takes at most (0.32 s of audio)
# A live listener keeps at least this much audio unheard when a push held back for more frames
# comes out: what its own scheduling may take (a chunk's write, a sound server's period).
LISTENER_MARGIN_S = 0.2


async def decode_frames(
    decoder: Decoder,
    new_state: Callable[[], DecoderState],
    frames: trio.MemoryReceiveChannel[Frame],
    out: trio.MemorySendChannel[AudioChunk],
    metrics: UtteranceMetrics,
    first_audio: trio.Event,
    live: bool = True,
    ahead: Callable[[], float] | None = None,
) -> None:
    """Decode frames as they come, each segment from a new decoder state (`new_state()`: a
    fresh one, or one primed with an in-context voice's reference frames), one chunk of audio
    per frame.

    A push decodes up to `MAX_PUSH` frames of a segment at once. It reads the decoder's
    weights once for all of them (Zen 4, one stream: 45 ms a frame alone, 40 two at a time;
    the Xeon with AMX: 54-59 alone, 35-36 four at a time; `python -m kazeia_stream.engine.codec
    MMPROJ 1 4`), so that frames queued behind a slow push always join the next, and a push
    waits for more frames while the listener does not need its audio yet, or has run dry
    (`_hold_until`).
    An utterance's first frame is never held: its audio comes alone, as soon as it can
    (decoded ahead of other streams' frames, and alone, on every core, the generator
    waiting). Pushes give the samples of one-frame pushes, bit for bit.
    Sets `first_audio` once the first chunk exists, records the decoder's trace (each frame
    its share of its push), the time of the first audio and the samples produced."""
    state: DecoderState | None = None
    held: Frame | None = None  # a queued frame of the next segment: the next push's first
    share = 0.0  # seconds a frame took in the last push
    async with frames, out:
        while True:
            try:
                batch = [held or await frames.receive()]
            except trio.EndOfChannel:
                break
            if metrics.first_audio is not None:  # an utterance's first frame is never held
                held = await _gather(frames, batch, _hold_until(metrics, live, share, ahead))
            if state is None or batch[0].new_segment:  # in a thread: it waits while the decoder loads
                state = await trio.to_thread.run_sync(new_state)
            start = time.perf_counter()
            codes = np.stack([frame.codes for frame in batch])
            pcm = await decoder.decode(state, codes, first=metrics.first_audio is None)
            end = time.perf_counter()
            share = (end - start) / len(batch)
            for i, frame in enumerate(batch):
                metrics.decoder.add(frame.index, start + i * share, start + (i + 1) * share)
            if metrics.first_audio is None:
                metrics.first_audio = end
                first_audio.set()
            metrics.samples += len(pcm)
            for frame, chunk in zip(batch, np.split(pcm, len(batch))):
                await out.send(AudioChunk(frame.index, chunk, metrics.sample_rate))


def _hold_until(
    metrics: UtteranceMetrics, live: bool, share: float, ahead: Callable[[], float] | None = None
) -> float:
    """Until when (trio's clock) a push may wait for more frames: forever where nobody listens
    as the audio comes (`live` false: a file, a whole response), else while the listener has
    more left to hear than a whole push of `share` seconds a frame and `LISTENER_MARGIN_S`:
    what a listener who has heard the audio in real time since its first chunk has left, or
    more where `ahead()` says the listener has more (a player's queue, a pipe's unread bytes:
    what is left at least, as a listener may hold audio of its own).

    A listener with nothing left (it ran dry: the generator is slower than real time) waits
    for audio either way, and a push then waits for `MAX_PUSH` frames while the generator
    keeps its pace: until it could have made that many more at the pace of its last frame
    (one frame's time to spare), as a player rebuffers after running dry. One push reads the
    decoder's weights once for all its frames, so the generator gets the cores back sooner:
    over 160 frames slower than real time, the audio was heard to its end 4-7% sooner, with a
    quarter of the gaps (`docs/measurements.md`, 2026-12-06, late night)."""
    if not live:
        return math.inf
    now = time.perf_counter()
    lead = metrics.lead_s(now)
    if ahead is not None:
        lead = max(lead, ahead())
    if lead <= 0 and metrics.generator.spans:
        _, start, end = metrics.generator.spans[-1]
        return trio.current_time() + end - now + MAX_PUSH * (end - start)
    return trio.current_time() + lead - MAX_PUSH * share - LISTENER_MARGIN_S


async def _gather(frames: trio.MemoryReceiveChannel[Frame], batch: list[Frame], until: float) -> Frame | None:
    """Add to `batch` the frames of its segment that come before `until` (trio's clock; those
    queued already whatever it is), up to `MAX_PUSH` in all; return a first frame of the next
    segment (the next push's first), if one came."""
    while len(batch) < MAX_PUSH:
        frame = await _next(frames, until)
        if frame is None or frame.new_segment:
            return frame
        batch.append(frame)
    return None


async def _next(frames: trio.MemoryReceiveChannel[Frame], until: float) -> Frame | None:
    """The next frame, if one comes before `until` (one queued already comes whatever it is)
    and the utterance has one."""
    try:
        return frames.receive_nowait()
    except trio.WouldBlock:
        pass
    except trio.EndOfChannel:
        return None
    with trio.move_on_at(until), contextlib.suppress(trio.EndOfChannel):
        return await frames.receive()  # cancelled, it takes nothing
    return None
