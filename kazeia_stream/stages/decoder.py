"""Decoder actor: frames in, PCM out, through the exact streaming codec decoder."""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from ..channels import AudioChunk, Frame, UtteranceMetrics
from ..engine.codec import CodecDecoder, DecoderState
from ..engine.threads import SharedCores


async def decode_frames(
    codec: CodecDecoder,
    new_state: Callable[[], DecoderState],
    cores: SharedCores,
    frames: trio.MemoryReceiveChannel[Frame],
    out: trio.MemorySendChannel[AudioChunk],
    metrics: UtteranceMetrics,
    first_audio: trio.Event,
) -> None:
    """Decode frames as they come, one push per frame, each segment from a new decoder state
    (`new_state()`: a fresh one, or one primed with an in-context voice's reference frames).

    One frame per push, even when frames queued up while the decoder was busy: a push of
    several frames rounds differently (other matrix widths), and the same seed must give the
    same bytes whatever the timing. The first push runs alone (the generator waits for it) on
    every core: measured on 2 cores, first audio ~50 ms sooner, the next frame ~50 ms later.
    Later pushes take the codec's own thread count (one) from libllama's calls.
    Sets `first_audio` once the first chunk exists, records the decoder's trace, the time of the
    first audio and the samples produced."""
    state: DecoderState | None = None
    async with frames, out:
        async for frame in frames:
            if state is None or frame.new_segment:
                state = new_state()
            start = time.perf_counter()
            threads = cores.count if metrics.first_audio is None else codec.threads
            with cores.lend(threads):
                pcm = await trio.to_thread.run_sync(codec.push, state, frame.codes[None], threads)
            end = time.perf_counter()
            metrics.decoder.add(frame.index, start, end)
            if metrics.first_audio is None:
                metrics.first_audio = end
                first_audio.set()
            metrics.samples += len(pcm)
            await out.send(AudioChunk(frame.index, pcm, metrics.sample_rate))
