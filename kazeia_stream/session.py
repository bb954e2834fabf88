"""Speaking sessions for a conversational loop, on a `Runtime`.

    async with runtime.open(voice="ryan") as tts:
        async for chunk in tts.speak(llm_tokens()):   # a str or an async iterable of str
            play(chunk.pcm)
        tts.cancel()                                  # barge-in

Each utterance runs as trio actors in one nursery: text feeder -> generator (talker + code
predictor) -> decoder, joined by bounded memory channels, heavy calls in worker threads. The
decoder works on frame N while the generator works on frame N+1, except for the first frame,
whose decode runs alone because nothing can be heard before it. A long text is spoken as
several segments (`model.segments`) through the same actors, back to back.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import trio

from .channels import AudioChunk, Frame, TextTokens, UtteranceMetrics
from .engine.frames import GenerationOptions
from .errors import leaf
from .model.prompt import Prompt
from .stages.decoder import decode_frames
from .stages.generator import generate_frames
from .stages.text_feeder import feed_text

if TYPE_CHECKING:
    from .model.model import VoiceArg
    from .runtime import Runtime

# Channel sizes. Text: token ids are tiny and an LLM may write faster than speech, so a deep
# buffer never stalls it in practice. Frames: 2, so the decoder always has the next frame ready
# while little work is lost on barge-in. Audio: 4 chunks (>= 0.32 s) between the decoder and the
# consumer, which keeps its own playback buffer; a slow consumer makes the producers wait.
TEXT_BUFFER = 256
FRAME_BUFFER = 2
AUDIO_BUFFER = 4


class Utterance:
    """An utterance being spoken: iterate it for `AudioChunk`s; `cancel()` stops it at once."""

    def __init__(
        self,
        text: str | AsyncIterable[str],
        options: GenerationOptions,
        live: bool,
        ahead: Callable[[], float] | None,
        sample_rate: int,
        on_iterate: Callable[[Utterance], None],
    ) -> None:
        self.text, self.options, self.live, self.ahead = text, options, live, ahead
        self._on_iterate = on_iterate
        self.iterated = False
        self._send, self._receive = trio.open_memory_channel[AudioChunk](AUDIO_BUFFER)
        self.metrics = UtteranceMetrics(started=time.perf_counter(), sample_rate=sample_rate)
        self.cancel_scope = trio.CancelScope()
        self.done = trio.Event()
        self.error: BaseException | None = None

    def cancel(self) -> None:
        """Stop generating at the next engine-call boundary and drop audio not yet taken (an
        utterance already finished stays as it was)."""
        if self.done.is_set():
            return
        self.metrics.cancelled = True
        self.cancel_scope.cancel()

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[AudioChunk]:
        self.iterated = True
        self._on_iterate(self)
        async with self._receive:
            async for chunk in self._receive:
                if self.metrics.cancelled:
                    return
                yield chunk
        await self.done.wait()
        if self.error is not None:
            raise self.error


class Session:
    """A voice ready to speak utterance after utterance, in the order they were asked for;
    made by `Runtime.open`. Sessions on one runtime share its engines: up to its `max_streams`
    utterances are generated together, frame by frame; the others wait in order."""

    def __init__(
        self,
        runtime: Runtime,
        nursery: trio.Nursery,
        voice: VoiceArg,
        language: str,
        instruct: str | None,
        text_streaming: bool,
        options: GenerationOptions,
        max_segment_bytes: int,
    ) -> None:
        self.runtime, self.model = runtime, runtime.model
        self.voice, self.language, self.instruct = voice, language, instruct
        self.text_streaming = text_streaming
        self.options = options
        self.max_segment_bytes = max_segment_bytes
        self._pending: deque[Utterance] = deque()  # asked for and not finished, oldest first
        self._last: UtteranceMetrics | None = None  # of the latest one finished
        self._queue, queue = trio.open_memory_channel[Utterance](math.inf)
        nursery.start_soon(self._speaker, queue)

    def speak(
        self,
        text: str | AsyncIterable[str],
        *,
        seed: int | None = None,
        live: bool = True,
        ahead: Callable[[], float] | None = None,
    ) -> Utterance:
        """Queue `text` to be spoken after the utterances asked for before it; return it.
        `live=False`: nobody hears the audio as it comes (a file, a whole response), so the
        decoder may hold frames back to push several at once (faster; see `decode_frames`);
        live, it does while the listener has enough left to hear (as if it heard the audio in
        real time from its first chunk, or more where `ahead()` says it has more: the seconds
        it has left at least, a player's queue, a pipe's unread bytes), or once it has run dry."""
        options = self.options if seed is None else replace(self.options, seed=seed)
        utterance = Utterance(text, options, live, ahead, self.model.sample_rate, self._moved_on)
        self._pending.append(utterance)
        self._queue.send_nowait(utterance)
        return utterance

    def cancel(self) -> None:
        """Barge-in: stop the utterance being spoken (or, before it starts, the next one). Those
        queued after it are spoken next."""
        if self._pending:
            self._pending[0].cancel()

    def _moved_on(self, utterance: Utterance) -> None:
        """The caller iterates `utterance`: those asked for before it that nobody iterates are
        abandoned (their audio has nowhere to go, and they would hold the queue): cancel them."""
        for earlier in self._pending:
            if earlier is utterance:
                return
            if not earlier.iterated:
                earlier.cancel()

    @property
    def metrics(self) -> UtteranceMetrics | None:
        """The metrics of the latest utterance asked for."""
        return self._pending[-1].metrics if self._pending else self._last

    async def _speaker(self, queue: trio.MemoryReceiveChannel[Utterance]) -> None:
        async for utterance in queue:
            try:
                async with utterance._send:
                    if not utterance.metrics.cancelled:
                        async with self.runtime.stream():
                            await self._speak(utterance)
            finally:
                self._pending.popleft()
                self._last = utterance.metrics
                if utterance.metrics.finished is None:  # dropped before it began
                    utterance.metrics.finished = time.perf_counter()
                utterance.done.set()

    async def _speak(self, utt: Utterance) -> None:
        try:
            with utt.cancel_scope:
                await self._actors(utt)
        except Exception as exc:  # surfaces where the caller iterates the utterance
            utt.error = leaf(exc)
        finally:  # before its place goes to a stream that waits (which may be heard at once)
            utt.metrics.finished = time.perf_counter()

    async def _actors(self, utt: Utterance) -> None:
        text_send, text_recv = trio.open_memory_channel[TextTokens](TEXT_BUFFER)
        frame_send, frame_recv = trio.open_memory_channel[Frame](FRAME_BUFFER)
        first_audio = trio.Event()
        rt = self.runtime

        def make_prompt(ids: list[int], complete: bool) -> Prompt:
            return self.model.prompt_from_tokens(
                ids,
                voice=self.voice,
                language=self.language,
                instruct=self.instruct,
                text_streaming=self.text_streaming,
                text_complete=complete,
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed_text, self.model, utt.text, self.max_segment_bytes, text_send)
            nursery.start_soon(
                generate_frames,
                self.model,
                rt.generator,
                make_prompt,
                self.model.text_needed(self.voice) if self.text_streaming else None,
                utt.options,
                text_recv,
                frame_send,
                utt.metrics,
                first_audio,
            )
            nursery.start_soon(
                decode_frames,
                rt.decoder,
                lambda: rt.decoder_state(self.voice),
                frame_recv,
                utt._send.clone(),
                utt.metrics,
                first_audio,
                utt.live,
                utt.ahead,
            )


@contextmanager
def single_errors() -> Iterator[None]:
    """Raise the one exception of a group of one as itself, so that a caller catches our error
    classes directly (trio's nurseries wrap everything that crosses them)."""
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise leaf(group) from None
        raise
