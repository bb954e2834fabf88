"""Generator actor: the talker and the code predictor, one frame per worker-thread call."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import trio

from ..channels import Frame, TextTokens, UtteranceMetrics
from ..engine.generator import FrameGenerator
from ..model import Model
from ..model.prompt import Prompt


async def generate_frames(model: Model, gen: FrameGenerator, make_prompt: Callable[[list[int], bool], Prompt],
                          text_streaming: bool, tokens: trio.MemoryReceiveChannel[TextTokens],
                          out: trio.MemorySendChannel[Frame], metrics: UtteranceMetrics,
                          first_audio: trio.Event) -> None:
    """Start the utterance once enough text is known, then send frames until EOS or the cap.

    After the first frame it waits for `first_audio`: the first decode, which audio cannot start
    without, then has the machine to itself (on 2 cores: 0.17 s instead of 0.27-0.45 s beside
    the next frame's generation, which shares the cores and the memory bandwidth).

    In streaming mode the talker starts from the first token; when it needs a text row that has
    not arrived, it waits for the text (padding early would tell the model the text has ended).
    Without streaming it waits for the whole text, as the official API does. Records the
    generator's trace and engine times into `metrics`.
    """
    try:
        async with tokens, out:
            await _loop(model, gen, make_prompt, text_streaming, tokens, out, metrics, first_audio)
    finally:
        t = gen.times
        metrics.prefill_s, metrics.talker_s = t.prefill, t.talker
        metrics.talker_steps, metrics.code_predictor_s = t.talker_steps, t.code_predictor


async def _loop(model: Model, gen: FrameGenerator, make_prompt: Callable[[list[int], bool], Prompt],
            text_streaming: bool, tokens: trio.MemoryReceiveChannel[TextTokens],
            out: trio.MemorySendChannel[Frame], metrics: UtteranceMetrics,
            first_audio: trio.Event) -> None:
    ids: list[int] = []
    complete = False
    while not ids or not (complete or text_streaming):
        msg = await tokens.receive()
        ids += msg.ids
        complete = msg.complete
    prompt = make_prompt(ids, complete)
    await trio.to_thread.run_sync(gen.start, prompt, complete)
    while True:
        while not gen.text_complete and (gen.needs_text or _ready(tokens)):
            _add_text(model, gen, await tokens.receive())
        start = time.perf_counter()
        codes = await trio.to_thread.run_sync(gen.next_frame)
        if codes is None:
            return
        metrics.generator.add(gen.frame - 1, start, time.perf_counter())
        await out.send(Frame(gen.frame - 1, codes))
        if gen.frame == 1:
            await first_audio.wait()


def _ready(channel: trio.MemoryReceiveChannel) -> bool:
    return channel.statistics().current_buffer_used > 0


def _add_text(model: Model, gen: FrameGenerator, msg: TextTokens) -> None:
    """Trailing rows for new tokens; the text's end adds the EOS row (every message has one or
    the other)."""
    rows = [model.text_embeddings(msg.ids)] if msg.ids else []
    if msg.complete:
        rows.append(model.eos_embedding[None])
    gen.add_text(np.concatenate(rows), len(msg.ids), msg.complete)
