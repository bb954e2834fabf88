"""Decoder actor: frames in, PCM out, through the passes of the runtime's codec decoder."""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from ..channels import AudioChunk, Frame, UtteranceMetrics
from ..engine.codec import DecoderState
from ..scheduler import Decoder


async def decode_frames(
    decoder: Decoder,
    new_state: Callable[[], DecoderState],
    frames: trio.MemoryReceiveChannel[Frame],
    out: trio.MemorySendChannel[AudioChunk],
    metrics: UtteranceMetrics,
    first_audio: trio.Event,
) -> None:
    """Decode frames as they come, one per pass, each segment from a new decoder state
    (`new_state()`: a fresh one, or one primed with an in-context voice's reference frames).

    One frame per pass: a push of the frames that queued up while the decoder was busy would
    give the same samples (the decoder's numbers do not depend on the push), but measured no
    faster (see README, "How it works"). An utterance's first frame is decoded ahead of other
    streams' frames (alone, on every core, the generator waiting, when no other stream runs).
    Sets `first_audio` once the first chunk exists, records the decoder's trace, the time of
    the first audio and the samples produced."""
    state: DecoderState | None = None
    async with frames, out:
        async for frame in frames:
            if state is None or frame.new_segment:  # in a thread: it waits while the decoder loads
                state = await trio.to_thread.run_sync(new_state)
            start = time.perf_counter()
            pcm = await decoder.decode(state, frame.codes[None], first=metrics.first_audio is None)
            end = time.perf_counter()
            metrics.decoder.add(frame.index, start, end)
            if metrics.first_audio is None:
                metrics.first_audio = end
                first_audio.set()
            metrics.samples += len(pcm)
            await out.send(AudioChunk(frame.index, pcm, metrics.sample_rate))
