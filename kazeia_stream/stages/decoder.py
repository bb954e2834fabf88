"""Decoder actor: frames in, PCM out, through the exact streaming codec decoder."""

from __future__ import annotations

import time

import numpy as np
import trio

from ..channels import AudioChunk, Frame, UtteranceMetrics
from ..engine.codec import CodecDecoder, DecoderState
from ..engine.threads import SharedCores


async def decode_frames(
    codec: CodecDecoder,
    cores: SharedCores,
    frames: trio.MemoryReceiveChannel[Frame],
    out: trio.MemorySendChannel[AudioChunk],
    metrics: UtteranceMetrics,
    first_audio: trio.Event,
) -> None:
    """Decode frames as they come, each segment from a new decoder state. Frames of a segment
    that queued up while the decoder was busy are decoded together in one push (same samples,
    fewer and larger matrix products). The first push runs alone (the generator waits for it)
    on every core: measured on 2 cores, first audio ~50 ms sooner, the next frame ~50 ms later.
    Later pushes take the codec's own thread count (one) from libllama's calls.
    Sets `first_audio` once the first chunk exists, records the decoder's trace, the time of the
    first audio and the samples produced."""
    state: DecoderState | None = None
    async with frames, out:
        next_frame: Frame | None = None
        while True:
            if next_frame is None:
                try:
                    next_frame = await frames.receive()
                except trio.EndOfChannel:
                    return
            batch, next_frame = _batch(frames, next_frame)
            if state is None or batch[0].new_segment:
                state = codec.new_state()
            codes = np.stack([f.codes for f in batch])
            start = time.perf_counter()
            threads = cores.count if metrics.first_audio is None else codec.threads
            with cores.lend(threads):
                pcm = await trio.to_thread.run_sync(codec.push, state, codes, threads)
            end = time.perf_counter()
            for f in batch:
                metrics.decoder.add(f.index, start, end)
            if metrics.first_audio is None:
                metrics.first_audio = end
                first_audio.set()
            metrics.samples += len(pcm)
            await out.send(AudioChunk(batch[0].index, pcm, metrics.sample_rate))


def _batch(frames: trio.MemoryReceiveChannel[Frame], first: Frame) -> tuple[list[Frame], Frame | None]:
    """`first` and the frames of its segment already waiting; and the next segment's first
    frame if it was taken too."""
    batch = [first]
    while frames.statistics().current_buffer_used:
        frame = frames.receive_nowait()
        if frame.new_segment:
            return batch, frame
        batch.append(frame)
    return batch, None
