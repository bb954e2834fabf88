"""Decoder actor: frames in, PCM out, through the exact streaming codec decoder."""

from __future__ import annotations

import time

import numpy as np
import trio

from ..channels import AudioChunk, Frame, UtteranceMetrics
from ..engine.codec import CodecDecoder
from ..engine.llm import SharedCores


async def decode_frames(codec: CodecDecoder, cores: SharedCores,
                        frames: trio.MemoryReceiveChannel[Frame],
                        out: trio.MemorySendChannel[AudioChunk], metrics: UtteranceMetrics,
                        first_audio: trio.Event) -> None:
    """Decode frames as they come. Frames that queued up while the decoder was busy are decoded
    together in one push (same samples, fewer and larger matrix products). The first push runs
    alone (the generator waits for it) on every core: measured on 2 cores, first audio ~50 ms
    sooner, the next frame ~50 ms later. Later pushes take the codec's own thread count
    (one) from libllama's calls.
    Sets `first_audio` once the first chunk exists, records the decoder's trace, the time of the
    first audio and the samples produced."""
    async with frames, out:
        codec.reset()
        async for frame in frames:
            batch = [frame]
            while frames.statistics().current_buffer_used:
                batch.append(frames.receive_nowait())
            codes = np.stack([f.codes for f in batch])
            start = time.perf_counter()
            threads = cores.count if metrics.first_audio is None else codec.threads
            with cores.lend(threads):
                pcm = await trio.to_thread.run_sync(codec.push, codes, threads)
            end = time.perf_counter()
            for f in batch:
                metrics.decoder.add(f.index, start, end)
            if metrics.first_audio is None:
                metrics.first_audio = end
                first_audio.set()
            metrics.samples += len(pcm)
            await out.send(AudioChunk(batch[0].index, pcm, metrics.sample_rate))
