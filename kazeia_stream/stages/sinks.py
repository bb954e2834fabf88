"""Audio sink actors: the sound card and a raw PCM pipe."""

from __future__ import annotations

import logging
import time

import trio

from ..channels import SpokenAudio
from ..pcm import pcm_bytes
from .playback import AudioPlayer, prebuffer_for

log = logging.getLogger(__name__)


async def play(
    utterance: SpokenAudio, player: AudioPlayer, expected_s: float, longest_s: float | None = None
) -> None:
    """Play an utterance as it is produced.

    Whenever playback waits (before it starts, or after running dry) the pre-buffer follows the
    measured production rate and the audio still to play, so a machine slower than real time
    buffers just enough that playback then runs to the end without a gap. `expected_s` is the
    utterance's estimated length; once more than that is produced, `longest_s` (its frame cap)
    is assumed instead, so an utterance longer than expected runs dry at most once.
    """
    first = None
    produced = 0.0
    async for chunk in utterance:
        now = time.perf_counter()
        first = first or now - chunk.duration  # production started about one chunk earlier
        played = produced - player.queued_seconds
        produced += chunk.duration
        rate = produced / max(now - first, 1e-6)
        length = expected_s if produced <= expected_s or longest_s is None else longest_s
        player.prebuffer_s = prebuffer_for(rate, max(length, produced) - played)
        player.write(chunk.pcm)
    if utterance.metrics.cancelled:
        player.flush()
        return
    await player.drain()
    if player.underruns:
        log.warning("%d playback underruns", player.underruns)


async def write_pcm(utterance: SpokenAudio, out: trio.abc.SendStream, fmt: str) -> None:
    """Write an utterance's PCM to a stream as it is produced, one write per chunk."""
    async for chunk in utterance:
        await out.send_all(pcm_bytes(chunk.pcm, fmt))
