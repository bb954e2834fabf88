"""Decoder actor: frames in, PCM out, through the passes of the runtime's codec decoder."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import trio

from ..channels import AudioChunk, Frame, UtteranceMetrics
from ..engine.codec import DecoderState
from ..scheduler import Decoder

MAX_PUSH = 4  # frames a push takes at most (2, 3 and 4 cost about alike a frame)


async def decode_frames(
    decoder: Decoder,
    new_state: Callable[[], DecoderState],
    frames: trio.MemoryReceiveChannel[Frame],
    out: trio.MemorySendChannel[AudioChunk],
    metrics: UtteranceMetrics,
    first_audio: trio.Event,
) -> None:
    """Decode frames as they come, each segment from a new decoder state (`new_state()`: a
    fresh one, or one primed with an in-context voice's reference frames), one chunk of audio
    per frame.

    A pass decodes the frame that came, and with it the frames of its segment that queued up
    meanwhile (`MAX_PUSH` at most; they are late already: none waits for another), but never
    an utterance's first: its audio comes alone, as soon as it can. A push of several frames
    gives the same samples (the decoder's numbers do not depend on the push) and costs less a
    frame (Zen 4, one stream: 45 ms a frame alone, 40 two at a time; `python -m
    kazeia_stream.engine.codec MMPROJ 1 2`), which a decoder that falls behind the generator
    gains (where it keeps up, every push takes one frame). An utterance's first frame is
    decoded ahead of other streams' frames (alone, on every core, the generator waiting, when
    no other stream runs). Sets `first_audio` once the first chunk exists, records the
    decoder's trace (each frame its share of its push), the time of the first audio and the
    samples produced."""
    state: DecoderState | None = None
    held: Frame | None = None  # a queued frame of the next segment: the next push's first
    async with frames, out:
        while True:
            try:
                batch = [held or await frames.receive()]
            except trio.EndOfChannel:
                break
            held = _queued(frames, batch) if metrics.first_audio is not None else None
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


def _queued(frames: trio.MemoryReceiveChannel[Frame], batch: list[Frame]) -> Frame | None:
    """Add to `batch` the frames of its segment queued behind it, up to `MAX_PUSH` in all;
    return a queued first frame of the next segment (the next push's first), if one came."""
    while len(batch) < MAX_PUSH:
        try:
            frame = frames.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return None
        if frame.new_segment:
            return frame
        batch.append(frame)
    return None
