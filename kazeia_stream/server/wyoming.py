"""`kazeia-stream wyoming`: a Wyoming text-to-speech server (Home Assistant's protocol) on one
`Runtime`.

- `describe` -> `info`: one TTS program whose voices are the server's voices, each with the
  model's languages as ISO 639-1 codes (Home Assistant matches languages by code).
- `synthesize` -> `audio-start`, one `audio-chunk` per 80 ms frame (s16le mono), `audio-stop`.
- streaming: `synthesize-start`, `synthesize-chunk`s, `synthesize-stop` -> each sentence spoken
  as soon as it is complete, as its own audio-start/chunks/audio-stop (as Piper does), then
  `synthesize-stopped`. The plain `synthesize` that clients send inside the exchange (Home
  Assistant does, for servers that do not stream) is ignored.
- our errors (unknown voice or language, empty text) -> an `error` event (for a plain
  `synthesize`, then an empty audio-start/audio-stop: Home Assistant reads until audio-stop);
  the connection and the server go on.

The runtime's frame generator blocks while it runs, so each utterance runs in a worker thread (as
many as the runtime speaks at once: their frames come from its shared passes; more clients
queue in arrival order) and hands each frame to the event loop. A client that goes away stops
its utterance at the next frame.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event, async_read_event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice
from wyoming.ping import Ping, Pong
from wyoming.server import AsyncEventHandler, AsyncServer, AsyncStdioServer
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

from .. import __version__
from ..errors import KazeiaError, UsageError
from ..model.model import VoiceArg
from ..model.segments import Segmenter
from ..pcm import pcm_bytes
from ..runtime import Runtime
from .voices import ServerVoices

log = logging.getLogger(__name__)

WIDTH = 2  # s16le
CHANNELS = 1

# The model's language names as ISO 639-1 codes. Dialects are Chinese: a dialect speaker speaks
# its dialect when asked for Chinese (or auto), so "zh" names Chinese and the dialects are
# reached by name only.
LANGUAGE_CODES = {
    "chinese": "zh",
    "english": "en",
    "german": "de",
    "italian": "it",
    "portuguese": "pt",
    "spanish": "es",
    "japanese": "ja",
    "korean": "ko",
    "french": "fr",
    "russian": "ru",
    "beijing_dialect": "zh",
    "sichuan_dialect": "zh",
}
CODE_LANGUAGES = {code: name for name, code in LANGUAGE_CODES.items() if not name.endswith("_dialect")}

# A streamed sentence shorter than this (UTF-8 bytes) is spoken with the next one: a word or two
# alone ("Hi.", "Dr.") makes a poor utterance. Whole texts keep the runtime's split (half a
# segment), which would hold a short reply back until its end.
STREAM_MIN_BYTES = 16

QWEN = Attribution(name="Qwen team, Alibaba Cloud (Qwen3-TTS)", url="https://github.com/QwenLM/Qwen3-TTS")


def serve(runtime: Runtime, voices: ServerVoices, uri: str) -> int:
    """Serve on `uri` (tcp://HOST:PORT or unix://PATH) until SIGINT or SIGTERM; 0 once stopped."""
    try:
        server = AsyncServer.from_uri(uri)
    except ValueError as exc:
        raise UsageError(f"bad --uri {uri!r}: {exc}") from None
    if isinstance(server, AsyncStdioServer):
        raise UsageError("--uri: stdio:// is not supported; use tcp://HOST:PORT or unix://PATH")
    asyncio.run(WyomingServer(runtime, voices).run(server, uri))
    return 0


def language_codes(languages: list[str]) -> list[str]:
    """The ISO 639-1 codes of a model's languages (those we know a code for), once each."""
    return sorted({LANGUAGE_CODES[name] for name in languages if name in LANGUAGE_CODES})


def model_language(requested: str | None, languages: list[str]) -> str:
    """The model's name for a requested language: a name ("english"), a code ("en") or a
    locale ("en-US", "en_GB"); "auto" when none. Anything else is returned as it came, for the
    runtime to refuse naming what the client sent."""
    if not requested:
        return "auto"
    name = requested.strip().lower()
    if name in languages:
        return name
    code = re.split(r"[-_]", name, maxsplit=1)[0]
    known = CODE_LANGUAGES.get(code)
    return known if known in languages else requested


def info(runtime: Runtime, voices: ServerVoices) -> Info:
    """What `describe` answers: one streaming TTS program with the server's voices."""
    model = runtime.model
    languages = language_codes(model.languages)
    kind = model.kind.replace("_", " ")
    return Info(
        tts=[
            TtsProgram(
                name="kazeia-stream",
                description=f"Qwen3-TTS on llama.cpp ({model.talker_path.name}, {kind})",
                attribution=QWEN,
                installed=True,
                version=__version__,
                voices=[
                    TtsVoice(
                        name=name,
                        description=name,
                        attribution=QWEN,
                        installed=True,
                        version=None,
                        languages=languages,
                    )
                    for name in voices.names
                ],
                supports_synthesize_streaming=True,
            )
        ]
    )


class _Synthesis:
    """One utterance, generated in the runtime's worker thread and handed over frame by frame.

    The generator is driven and closed in that thread (a generator cannot be closed while
    another thread runs it); `stop` makes it end at the next frame, or not start at all if it is
    still waiting for its turn, and closing it frees the engines at once."""

    def __init__(self, executor: ThreadPoolExecutor, frames: Callable[[], Iterator[np.ndarray]]) -> None:
        self._loop = asyncio.get_running_loop()
        self._chunks: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self._stop = threading.Event()
        self.finished = self._loop.run_in_executor(executor, self._run, frames)

    def stop(self) -> None:
        self._stop.set()

    async def next(self) -> bytes | None:
        """The next frame as s16le, None at the end; raises what the synthesis raised."""
        item = await self._chunks.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def _run(self, make: Callable[[], Iterator[np.ndarray]]) -> None:
        if self._stop.is_set():  # the client went away while it waited
            self._post(None)
            return
        frames = make()
        try:
            for pcm in frames:
                if self._stop.is_set():
                    break
                self._post(pcm_bytes(pcm, "s16le"))
        except Exception as exc:
            self._post(exc)
        finally:
            if isinstance(frames, Generator):
                frames.close()  # leaves the engines
            self._post(None)

    def _post(self, item: bytes | BaseException | None) -> None:
        with suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self._chunks.put_nowait, item)


class WyomingServer:
    """The state all connections share: the runtime, its voices, and a thread per stream the
    runtime speaks at once (each waits on the runtime's shared passes)."""

    def __init__(self, runtime: Runtime, voices: ServerVoices) -> None:
        self.runtime = runtime
        self.voices = voices
        self.info = info(runtime, voices)
        self._executor = ThreadPoolExecutor(
            max_workers=runtime.max_streams, thread_name_prefix="kazeia-wyoming"
        )
        self._syntheses: set[_Synthesis] = set()

    def language(self, requested: str | None) -> str:
        return model_language(requested, self.runtime.model.languages)

    def stream_segmenter(self, voice: VoiceArg, language: str) -> Segmenter:
        """A segmenter for streamed text in these settings: checks the voice and language, and
        keeps each sentence within what one utterance can hold (as `Runtime.audio` does)."""
        probe = self.runtime.probe(voice, language, None)
        max_bytes = self.runtime.max_segment_bytes(probe)
        return Segmenter(max_bytes, min(STREAM_MIN_BYTES, max_bytes))

    @asynccontextmanager
    async def synthesis(self, text: str, voice: VoiceArg, language: str) -> AsyncIterator[_Synthesis]:
        """An utterance of `text`, queued for the engines; stopped when the block is left."""
        synthesis = _Synthesis(
            self._executor,
            lambda: self.runtime.audio(text, voice=voice, language=language, text_streaming=False),
        )
        self._syntheses.add(synthesis)
        try:
            yield synthesis
        finally:
            synthesis.stop()
            # kept until its thread is done with it: a shutdown waits for that
            synthesis.finished.add_done_callback(lambda _: self._syntheses.discard(synthesis))

    async def run(self, server: AsyncServer, uri: str) -> None:
        """Serve until SIGINT or SIGTERM, then stop every utterance at its next frame."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            loop.add_signal_handler(sig, _on_signal, sig, stop)
        try:
            try:
                await server.start(lambda reader, writer: _Handler(self, reader, writer))
            except OSError as exc:
                raise UsageError(f"cannot listen on {uri}: {exc.strerror or exc}") from None
            log.warning(
                "wyoming server on %s (%s, %d voices)",
                _bound_uri(server, uri),
                self.runtime.model.talker_path.name,
                len(self.voices.names),
            )
            await stop.wait()
            await server.stop()  # no new connections; the open ones are closed
            for synthesis in self._syntheses:
                synthesis.stop()
            if self._syntheses:  # each ends at its next frame
                await asyncio.wait([s.finished for s in self._syntheses], timeout=10)
            log.warning("stopped")
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)
            for sig, handler in previous.items():
                loop.remove_signal_handler(sig)
                if handler is not None:
                    signal.signal(sig, handler)


def _on_signal(sig: int, stop: asyncio.Event) -> None:
    if not stop.is_set():
        log.warning("%s: stopping", signal.Signals(sig).name)
    stop.set()


def _bound_uri(server: AsyncServer, uri: str) -> str:
    """The URI with the port the system chose for port 0."""
    sockets = getattr(getattr(server, "_server", None), "sockets", None) or []
    for sock in sockets:
        address = sock.getsockname()
        if isinstance(address, tuple) and uri.startswith("tcp://"):
            host, port = address[0], address[1]
            return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
    return uri


@dataclass
class _Stream:
    """A streaming exchange (synthesize-start ... synthesize-stop) on one connection."""

    voice: VoiceArg
    language: str
    segmenter: Segmenter | None  # None: it failed at its start; its text is dropped
    text: list[str] = field(default_factory=list)  # every chunk, to recognise the compatibility copy
    sentence: str = ""  # the current segment's text so far


Job = Callable[[], Awaitable[None]]


class _Handler(AsyncEventHandler):
    """One client connection. Its events are read as they come and answered in order by one
    task, so that a stream's text keeps arriving while its first sentences are spoken, and a
    client that goes away is noticed at the next frame written to it."""

    def __init__(
        self, server: WyomingServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        super().__init__(reader, writer)
        self.server = server
        self._jobs: asyncio.Queue[Job | None] = asyncio.Queue()
        self._stream: _Stream | None = None
        self._last_stream: str | None = None  # the text of the stream that just ended

    async def run(self) -> None:
        """Read events until the client has sent its last (end of file: answer what it asked,
        as a client that half-closes expects) or is gone (stop, at the next frame)."""
        worker = asyncio.create_task(self._answer())
        try:
            while not worker.done():
                try:
                    event = await async_read_event(self.reader)
                except (OSError, EOFError):  # reset, or cut inside an event
                    worker.cancel()
                    break
                if event is None:
                    break
                await self.handle_event(event)
            self._jobs.put_nowait(None)
            await worker
        finally:
            worker.cancel()
            with suppress(asyncio.CancelledError):
                await worker
            self.writer.close()

    async def _answer(self) -> None:
        while (job := await self._jobs.get()) is not None:
            try:
                await job()
            except OSError as exc:  # the client is gone: writes fail
                log.info("client gone: %s", exc)
                self.writer.close()
                self.reader.feed_eof()
                return
            except Exception:  # a bug: this request fails, the connection goes on
                log.exception("request failed")

    def _later(self, job: Job) -> None:
        self._jobs.put_nowait(job)

    async def handle_event(self, event: Event) -> bool:
        try:
            self._dispatch(event)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            error = UsageError(f"malformed {event.type} event ({type(exc).__name__}: {exc})")
            self._later(partial(self._error, error))
        return True

    def _dispatch(self, event: Event) -> None:
        last, self._last_stream = self._last_stream, None  # a late copy comes right after the stop
        if Describe.is_type(event.type):
            self._later(partial(self.write_event, self.server.info.event()))
        elif Ping.is_type(event.type):
            self._later(partial(self.write_event, Pong(text=Ping.from_event(event).text).event()))
        elif Synthesize.is_type(event.type):
            text = _text(event)
            if self._stream is not None or (last is not None and text.strip() == last.strip()):
                return  # the copy of a stream's text sent for servers that do not stream
            name, language = _voice(event)
            self._later(partial(self._synthesize, text, name, language))
        elif SynthesizeStart.is_type(event.type):
            if self._stream is not None:
                self._end_stream()  # a client that did not stop the previous one
            self._start_stream(*_voice(event))
        elif SynthesizeChunk.is_type(event.type):
            if self._stream is not None:
                self._stream_text(_text(event))
        elif SynthesizeStop.is_type(event.type):
            if self._stream is not None:
                self._end_stream()
            else:
                self._later(partial(self.write_event, SynthesizeStopped().event()))
        # anything else (audio, other domains) is not for a TTS server

    # -- requests --------------------------------------------------------------------------------

    async def _synthesize(self, text: str, name: str | None, language: str | None) -> None:
        """A plain request: its answer always ends with audio-stop, even after an error, since
        Home Assistant reads until then (it does not look for error events outside a stream)."""
        try:
            voice = self.server.voices.resolve(name)
        except KazeiaError as exc:
            await self._error(exc)
            await self._no_audio()
            return
        await self._speak(text, voice, self.server.language(language), plain=True)

    def _start_stream(self, name: str | None, language: str | None) -> None:
        try:
            voice = self.server.voices.resolve(name)
            resolved = self.server.language(language)
            self._stream = _Stream(voice, resolved, self.server.stream_segmenter(voice, resolved))
        except KazeiaError as exc:
            self._stream = _Stream(None, "auto", None)
            self._later(partial(self._error, exc))

    def _stream_text(self, text: str) -> None:
        stream = self._stream
        assert stream is not None
        stream.text.append(text)
        if stream.segmenter is not None:
            self._sentences(stream, stream.segmenter.feed(text))

    def _end_stream(self) -> None:
        stream = self._stream
        assert stream is not None
        if stream.segmenter is not None:
            self._sentences(stream, stream.segmenter.finish())
        self._later(partial(self.write_event, SynthesizeStopped().event()))
        self._stream, self._last_stream = None, "".join(stream.text)

    def _sentences(self, stream: _Stream, parts: list[tuple[str, bool]]) -> None:
        for part, end in parts:
            stream.sentence += part
            if end:
                sentence, stream.sentence = stream.sentence, ""
                self._later(partial(self._speak, sentence, stream.voice, stream.language))

    # -- answers -----------------------------------------------------------------------------------

    async def _speak(self, text: str, voice: VoiceArg, language: str, plain: bool = False) -> None:
        """One utterance: audio-start, a chunk per frame as it comes, audio-stop. A failure before
        any audio is an error event (then, for a `plain` request, an empty audio-start/stop);
        after some, an error event, then audio-stop."""
        rate = self.server.runtime.model.sample_rate
        started = False
        failure: Exception | None = None
        async with self.server.synthesis(text, voice, language) as synthesis:
            while True:
                try:
                    chunk = await synthesis.next()
                except Exception as exc:
                    failure = exc
                    break
                if chunk is None:
                    break
                if not started:
                    await self.write_event(AudioStart(rate=rate, width=WIDTH, channels=CHANNELS).event())
                    started = True
                await self.write_event(
                    AudioChunk(rate=rate, width=WIDTH, channels=CHANNELS, audio=chunk).event()
                )
        if failure is not None:
            await self._error(failure)
            if not started and not plain:
                return
        if not started:  # no frame at all (an error, an immediate end of speech): still an answer
            await self._no_audio()
            return
        await self.write_event(AudioStop().event())

    async def _no_audio(self) -> None:
        rate = self.server.runtime.model.sample_rate
        await self.write_event(AudioStart(rate=rate, width=WIDTH, channels=CHANNELS).event())
        await self.write_event(AudioStop().event())

    async def _error(self, exc: Exception) -> None:
        if not isinstance(exc, KazeiaError):
            log.error("synthesis failed", exc_info=exc)
        await self.write_event(Error(text=str(exc) or type(exc).__name__, code=type(exc).__name__).event())


def _text(event: Event) -> str:
    text = event.data["text"]
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, not {type(text).__name__}")
    return text


def _voice(event: Event) -> tuple[str | None, str | None]:
    """The requested voice name and language. Read from the event's data, not through
    `SynthesizeVoice`, which drops the language when a name is given."""
    voice: Any = event.data.get("voice") or {}
    if not isinstance(voice, dict):
        raise TypeError(f"voice must be an object, not {type(voice).__name__}")
    name, language = voice.get("name"), voice.get("language")
    for value in (name, language):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"voice name and language must be strings, not {type(value).__name__}")
    return name, language
