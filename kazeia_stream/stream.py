"""The streaming API for a conversational loop.

    async with kazeia_stream.open(model, voice="ryan") as tts:
        async for chunk in tts.speak(llm_tokens()):   # a str or an async iterable of str
            play(chunk.pcm)
        tts.cancel()                                  # barge-in

Each utterance runs as trio actors in one nursery: text feeder -> generator (talker + code
predictor) -> decoder, joined by bounded memory channels, heavy calls in worker threads. The
decoder works on frame N while the generator works on frame N+1, except for the first frame,
whose decode runs alone because nothing can be heard before it.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import AsyncIterable, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import trio

from .channels import AudioChunk, Frame, TextTokens, UtteranceMetrics
from .engine.generator import GenerationOptions
from .engine.synthesis import Engines, Threads
from .model import Model
from .model.prompt import Prompt
from .stages.decoder import decode_frames
from .stages.generator import generate_frames
from .stages.text_feeder import feed_text

# Channel sizes. Text: token ids are tiny and an LLM may write faster than speech, so a deep
# buffer never stalls it in practice. Frames: 2, so the decoder always has the next frame ready
# while little work is lost on barge-in. Audio: 4 chunks (>= 0.32 s) between the decoder and the
# consumer, which keeps its own playback buffer; a slow consumer makes the producers wait.
TEXT_BUFFER = 256
FRAME_BUFFER = 2
AUDIO_BUFFER = 4


class Utterance:
    """An utterance being spoken: iterate it for `AudioChunk`s; `cancel()` stops it at once."""

    def __init__(self, receive: trio.MemoryReceiveChannel[AudioChunk], sample_rate: int) -> None:
        self._receive = receive
        self.metrics = UtteranceMetrics(started=time.perf_counter(), sample_rate=sample_rate)
        self.cancel_scope = trio.CancelScope()
        self.done = trio.Event()
        self.error: BaseException | None = None

    def cancel(self) -> None:
        """Stop generating at the next engine-call boundary and drop audio not yet taken."""
        self.metrics.cancelled = True
        self.cancel_scope.cancel()

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[AudioChunk]:
        async with self._receive:
            async for chunk in self._receive:
                if self.metrics.cancelled:
                    return
                yield chunk
        await self.done.wait()
        if self.error is not None:
            raise self.error


class Session:
    """A loaded model ready to speak utterance after utterance; made by `open`."""

    def __init__(self, model: Model, nursery: trio.Nursery, engines: Engines, voice: str | None,
                 language: str, instruct: str | None, text_streaming: bool,
                 options: GenerationOptions) -> None:
        self.model, self.engines = model, engines
        self._nursery = nursery
        self.voice, self.language, self.instruct = voice, language, instruct
        self.text_streaming = text_streaming
        self.options = options
        self._lock = engine_lock(engines)
        self.current: Utterance | None = None

    def speak(self, text: str | AsyncIterable[str], *, seed: int | None = None) -> Utterance:
        """Start speaking `text` (after the current utterance, if any) and return it."""
        send, receive = trio.open_memory_channel[AudioChunk](AUDIO_BUFFER)
        utterance = Utterance(receive, self.model.sample_rate)
        self.current = utterance
        options = self.options if seed is None else replace(self.options, seed=seed)
        self._nursery.start_soon(self._run, text, utterance, send, options)
        return utterance

    def cancel(self) -> None:
        """Barge-in: stop the current utterance."""
        if self.current is not None:
            self.current.cancel()

    @property
    def metrics(self) -> UtteranceMetrics | None:
        """The current (or last) utterance's metrics."""
        return None if self.current is None else self.current.metrics

    async def _run(self, text: str | AsyncIterable[str], utt: Utterance,
                   audio: trio.MemorySendChannel[AudioChunk], options: GenerationOptions) -> None:
        m = utt.metrics
        async with audio, self._lock:
            try:
                with utt.cancel_scope:
                    await self._actors(text, utt, audio, options)
            except Exception as exc:  # surfaces where the caller iterates the utterance
                utt.error = _leaf(exc)
            m.finished = time.perf_counter()
            utt.done.set()

    async def _actors(self, text: str | AsyncIterable[str], utt: Utterance,
                      audio: trio.MemorySendChannel[AudioChunk], options: GenerationOptions) -> None:
        m = utt.metrics
        text_send, text_recv = trio.open_memory_channel[TextTokens](TEXT_BUFFER)
        frame_send, frame_recv = trio.open_memory_channel[Frame](FRAME_BUFFER)
        gen = self.engines.generator(options)
        first_audio = trio.Event()

        def make_prompt(ids: list[int], complete: bool) -> Prompt:
            return self.model.prompt_from_tokens(
                ids, voice=self.voice, language=self.language, instruct=self.instruct,
                text_streaming=self.text_streaming, text_complete=complete)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed_text, self.model, text, text_send)
            nursery.start_soon(generate_frames, self.model, gen, make_prompt, self.text_streaming,
                               text_recv, frame_send, m, first_audio)
            nursery.start_soon(decode_frames, self.engines.codec, self.engines.cores, frame_recv,
                               audio, m, first_audio)


_ENGINE_LOCKS: weakref.WeakKeyDictionary[Engines, trio.Lock] = weakref.WeakKeyDictionary()


def engine_lock(engines: Engines) -> trio.Lock:
    """The lock that lets one utterance at a time use a model's engines, whichever session it
    belongs to (sessions on one model share its engines and their caches)."""
    return _ENGINE_LOCKS.setdefault(engines, trio.Lock())


def _leaf(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


@asynccontextmanager
async def open(model: Model, *, voice: str | None = None, language: str = "auto",
               instruct: str | None = None, text_streaming: bool = True,
               threads: Threads | None = None, **generation) -> AsyncIterator[Session]:
    """A speaking session on a loaded model. `generation` takes `GenerationOptions` fields
    (seed, temperature, top_k, ...)."""
    # Fail here, not in the middle of the first utterance, on a bad voice or language; and
    # compute the prompt rows all utterances share before the first text arrives.
    prompt = model.prompt("check", voice=voice, language=language, instruct=instruct)
    engines = model.engines if threads is None else Engines(model, threads)
    async with engine_lock(engines):
        await trio.to_thread.run_sync(engines.prepare, prompt)
    async with trio.open_nursery() as nursery:
        session = Session(model, nursery, engines, voice, language, instruct, text_streaming,
                          GenerationOptions(**generation))
        try:
            yield session
        finally:
            nursery.cancel_scope.cancel()
