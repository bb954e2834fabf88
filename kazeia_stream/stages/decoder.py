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
    together in one push (same samples, fewer and larger matrix products). While a push runs,
    the decoder holds one of the cores libllama's calls use. Sets `first_audio` once the first
    chunk exists, records the decoder's trace, the time of the first audio and the samples
    produced."""
    async with frames, out:
        codec.reset()
        async for frame in frames:
            batch = [frame]
            while frames.statistics().current_buffer_used:
                batch.append(frames.receive_nowait())
            codes = np.stack([f.codes for f in batch])
            start = time.perf_counter()
            with cores.lend():
                pcm = await trio.to_thread.run_sync(codec.push, codes)
            end = time.perf_counter()
            for f in batch:
                metrics.decoder.add(f.index, start, end)
            if metrics.first_audio is None:
                metrics.first_audio = end
                first_audio.set()
            metrics.samples += len(pcm)
            await out.send(AudioChunk(batch[0].index, pcm, metrics.sample_rate))
