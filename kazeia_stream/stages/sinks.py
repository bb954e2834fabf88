"""Audio sink actors: the sound card and a raw PCM pipe."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import trio

from .playback import AudioPlayer, prebuffer_for

if TYPE_CHECKING:
    from ..stream import Utterance

log = logging.getLogger(__name__)

FORMATS = ("s16le", "f32le")


def pcm_bytes(pcm: np.ndarray, fmt: str) -> bytes:
    """Raw little-endian PCM: 16-bit integers (clipped, rounded) or 32-bit floats."""
    if fmt == "f32le":
        return pcm.astype("<f4").tobytes()
    return np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


async def play(utterance: Utterance, player: AudioPlayer, expected_s: float) -> None:
    """Play an utterance as it is produced. Before playback starts the pre-buffer follows the
    measured production rate, so a machine slower than real time buffers just enough audio that
    playback then runs to the end without a gap (`expected_s`: the utterance's estimated length)."""
    first = None
    produced = 0.0
    async for chunk in utterance:
        now = time.perf_counter()
        first = first or now - chunk.duration  # production started about one chunk earlier
        produced += chunk.duration
        rate = produced / max(now - first, 1e-6)
        player.prebuffer_s = prebuffer_for(rate, expected_s)
        player.write(chunk.pcm)
    if utterance.metrics.cancelled:
        player.flush()
        return
    await player.drain()
    if player.underruns:
        log.warning("%d playback underruns", player.underruns)


async def write_pcm(utterance: Utterance, out: trio.abc.SendStream, fmt: str) -> None:
    """Write an utterance's PCM to a stream as it is produced, one write per chunk."""
    async for chunk in utterance:
        await out.send_all(pcm_bytes(chunk.pcm, fmt))
