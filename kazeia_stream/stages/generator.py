"""Generator actor: an utterance's frames, from the passes of the runtime's generator."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import numpy as np
import trio

from ..channels import Frame, TextTokens, UtteranceMetrics
from ..engine.frames import FrameState, GenerationOptions
from ..model import Model
from ..model.prompt import Prompt
from ..scheduler import Generator


async def generate_frames(
    model: Model,
    loop: Generator,
    make_prompt: Callable[[list[int], bool], Prompt],
    text_needed: int | None,
    options: GenerationOptions,
    tokens: trio.MemoryReceiveChannel[TextTokens],
    out: trio.MemorySendChannel[Frame],
    metrics: UtteranceMetrics,
    first_audio: trio.Event,
) -> None:
    """Generate each segment once enough of its text is known; send frames until its EOS or
    cap, then go on with the next segment. Frames are numbered across segments; each
    segment's first is marked `new_segment`. The samplers of all segments draw from one
    generator seeded with `options.seed`.

    After the first frame it waits for `first_audio`: the first decode, which audio cannot start
    without, then does not share the cores with this utterance's next frame (alone on 2 cores:
    0.17 s instead of 0.27-0.45 s beside the next frame's generation). Until then the utterance
    is `beginning` (`SharedCores`): the decoder's passes over other streams' frames give way
    to its first frame.

    In streaming mode the talker starts once `text_needed` tokens are known (1; more for an
    in-context voice, whose prompt aligns the text with the reference frames); when it needs a
    text row that has not arrived, it waits for the text (padding early would tell the model the
    text has ended). Without streaming (`text_needed` None) it waits for the segment's whole
    text, as the official API does. Records the generator's trace and engine times into
    `metrics`.
    """
    rng = np.random.default_rng(options.seed)
    index = 0
    async with tokens, out:
        while (start := await _segment_start(tokens, text_needed)) is not None:
            prompt = make_prompt(*start)
            state = loop.start(prompt, model.text_feed(prompt), options, rng)
            try:
                index = await _frames(loop, state, index, tokens, out, metrics, first_audio)
            finally:
                loop.finish(state)
                metrics.add_times(state.times)
            await _skip_rest(state, tokens)


async def _segment_start(
    tokens: trio.MemoryReceiveChannel[TextTokens], needed: int | None
) -> tuple[list[int], bool] | None:
    """The first `needed` tokens (at least) of the next segment (all of them when `needed` is
    None), and whether they are all of it; None once the text has ended."""
    ids: list[int] = []
    end = False
    while not ids or not (end or (needed is not None and len(ids) >= needed)):
        try:
            msg = await tokens.receive()
        except trio.EndOfChannel:
            return None
        ids += msg.ids
        end = msg.segment_end
    return ids, end


async def _frames(
    loop: Generator,
    state: FrameState,
    index: int,
    tokens: trio.MemoryReceiveChannel[TextTokens],
    out: trio.MemorySendChannel[Frame],
    metrics: UtteranceMetrics,
    first_audio: trio.Event,
) -> int:
    """One segment's frames, numbered from `index`; returns the next frame's number."""
    first = index
    while True:
        while not state.text.complete and (state.needs_text or _ready(tokens)):
            msg = await tokens.receive()
            state.text.add(msg.ids, msg.segment_end)
        start = time.perf_counter()
        with loop.cores.beginning() if index == 0 else contextlib.nullcontext():
            codes = await loop.next_frame(state)
            if codes is None:
                return index
            metrics.generator.add(index, start, time.perf_counter())
            await out.send(Frame(index, codes, new_segment=index == first))
            index += 1
            if index == 1:
                await first_audio.wait()


async def _skip_rest(state: FrameState, tokens: trio.MemoryReceiveChannel[TextTokens]) -> None:
    """A segment that ended (EOS, its cap) before its text did: drop the rest of its text."""
    while not state.text.complete:
        try:
            msg = await tokens.receive()
        except trio.EndOfChannel:
            return
        state.text.add(msg.ids, msg.segment_end)


def _ready(channel: trio.MemoryReceiveChannel[TextTokens]) -> bool:
    return channel.statistics().current_buffer_used > 0
