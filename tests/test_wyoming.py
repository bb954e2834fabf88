"""`kazeia-stream wyoming`, live on 127.0.0.1, through the `wyoming` package's own client (the
one Home Assistant uses), on the tiny CustomVoice model."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.ping import Ping, Pong
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeStopped,
    SynthesizeVoice,
)

import kazeia_stream
from kazeia_stream.server.wyoming import language_codes, model_language

ROOT = Path(__file__).resolve().parent.parent
RATE, WIDTH, CHANNELS = 24000, 2, 1
FRAME_BYTES = 1920 * WIDTH  # one 80 ms frame of s16le
RYAN = SynthesizeVoice(name="ryan")
TEXT = "Hello there."
# About 670 frames: seconds of generation, so that a client can leave in the middle of it.
LONG = " ".join(["This sentence is long enough to keep the engines busy for a while."] * 6)
MODEL_LANGUAGES = ["de", "en", "es", "fr", "it", "ja", "ko", "pt", "ru", "zh"]


class Server:
    """The command as a subprocess on a port of the system's choosing (read from its log line)."""

    def __init__(self, model: Path, log: Path) -> None:
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kazeia_stream",
                    "wyoming",
                    "--uri",
                    "tcp://127.0.0.1:0",
                    "--model",
                    str(model),
                ],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        deadline = time.monotonic() + 120
        while not (found := re.search(r"wyoming server on tcp://127\.0\.0\.1:(\d+)", self.stderr())):
            assert self.proc.poll() is None, self.stderr()
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        self.port = int(found.group(1))

    def stderr(self) -> str:
        return self.log.read_text()

    def threads(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))

    def client(self) -> AsyncTcpClient:
        return AsyncTcpClient("127.0.0.1", self.port, connect_timeout=10, read_timeout=20)

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=60)
        finally:
            self.proc.kill()
        return self.proc.returncode, self.stderr()


@pytest.fixture(scope="module")
def model(tiny_gguf) -> Path:
    return tiny_gguf("custom_voice")[0]


@pytest.fixture(scope="module")
def server(model, tmp_path_factory) -> Iterator[Server]:
    s = Server(model, tmp_path_factory.mktemp("wyoming") / "stderr.txt")
    yield s
    rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err and err.rstrip().endswith("stopped"), err


async def read_until(client: AsyncTcpClient, last: type) -> list[Event]:
    """Events up to and including the first of type `last`."""
    events = []
    while True:
        event = await client.read_event()
        assert event is not None, f"the connection ended after {[e.type for e in events]}"
        events.append(event)
        if last.is_type(event.type):  # type: ignore[attr-defined]
            return events


async def ask(server: Server, *events: Event, last: type = AudioStop) -> list[Event]:
    """One connection: write `events`, read up to `last`."""
    async with server.client() as client:
        for event in events:
            await client.write_event(event)
        return await read_until(client, last)


def utterances(events: list[Event]) -> list[bytes]:
    """The audio of each audio-start ... audio-stop, checking its format and framing."""
    spoken: list[bytes] = []
    audio: bytes | None = None
    for event in events:
        if AudioStart.is_type(event.type):
            assert audio is None, "audio-start inside an utterance"
            start = AudioStart.from_event(event)
            assert (start.rate, start.width, start.channels) == (RATE, WIDTH, CHANNELS)
            audio = b""
        elif AudioChunk.is_type(event.type):
            assert audio is not None, "audio-chunk outside an utterance"
            chunk = AudioChunk.from_event(event)
            assert (chunk.rate, chunk.width, chunk.channels) == (RATE, WIDTH, CHANNELS)
            assert len(chunk.audio) == FRAME_BYTES  # one chunk per frame, sent as it comes
            audio += chunk.audio
        elif AudioStop.is_type(event.type):
            assert audio is not None, "audio-stop outside an utterance"
            spoken.append(audio)
            audio = None
    assert audio is None, "an utterance without audio-stop"
    return spoken


def errors(events: list[Event]) -> list[Error]:
    return [Error.from_event(e) for e in events if Error.is_type(e.type)]


def synthesize(text: str, **voice: str) -> Event:
    """A synthesize event with any voice fields (`SynthesizeVoice` drops the language when a
    name is given)."""
    return Event(type="synthesize", data={"text": text, "voice": voice})


# -- without a server ------------------------------------------------------------------------------


def test_languages_as_codes_and_back():
    names = ["auto", "beijing_dialect", "chinese", "english", "german", "sichuan_dialect"]
    assert language_codes(names) == ["de", "en", "zh"]
    for requested, name in [
        (None, "auto"),
        ("", "auto"),
        ("auto", "auto"),
        ("en", "english"),
        ("EN", "english"),
        ("en-US", "english"),
        ("en_GB", "english"),
        ("English", "english"),
        ("zh", "chinese"),
        ("zh-CN", "chinese"),
        ("sichuan_dialect", "sichuan_dialect"),
        ("de-DE", "german"),
    ]:
        assert model_language(requested, names) == name, requested
    # unknown to the model, or to us: passed on as sent, for the runtime to refuse by name
    assert model_language("fr", names) == "fr"
    assert model_language("klingon", names) == "klingon"


# -- the server ------------------------------------------------------------------------------------


@pytest.mark.subprocess
def test_describe(server: Server, model: Path):
    events = asyncio.run(ask(server, Describe().event(), last=Info))
    assert len(events) == 1
    info = Info.from_event(events[0])
    assert len(info.tts) == 1 and not info.asr and not info.wake
    program = info.tts[0]
    assert program.name == "kazeia-stream" and program.version == kazeia_stream.__version__
    assert program.installed and program.supports_synthesize_streaming and program.attribution.url
    voices = kazeia_stream.load_model(model).voices
    assert [v.name for v in program.voices] == voices and "ryan" in voices
    for voice in program.voices:
        assert voice.installed and voice.languages == MODEL_LANGUAGES


@pytest.mark.subprocess
def test_synthesize(server: Server):
    events = asyncio.run(ask(server, Synthesize(text=TEXT, voice=RYAN).event()))
    assert AudioStart.is_type(events[0].type) and AudioStop.is_type(events[-1].type)
    [audio] = utterances(events)
    assert len(audio) > 0 and len(audio) % FRAME_BYTES == 0
    assert not errors(events)


@pytest.mark.subprocess
def test_voice_and_language_by_code_or_name(server: Server):
    async def run() -> list[list[Event]]:
        answers = []
        async with server.client() as client:  # one connection, several requests
            for request in [
                Synthesize(text=TEXT).event(),  # the default voice
                synthesize(TEXT, name="Ryan", language="en"),
                synthesize(TEXT, name="ryan", language="en-US"),
                synthesize(TEXT, language="english"),
                synthesize(TEXT, name="eric", language="zh"),
            ]:
                await client.write_event(request)
                answers.append(await read_until(client, AudioStop))
            await client.write_event(synthesize(TEXT, name="ryan", language="xx"))
            answers.append(await read_until(client, AudioStop))  # an error, then empty audio
            await client.write_event(Ping(text="still there?").event())
            answers.append(await read_until(client, Pong))
        return answers

    *spoken, bad_language, pong = asyncio.run(run())
    for events in spoken:
        assert not errors(events) and len(utterances(events)) == 1
    assert "unknown language 'xx'" in errors(bad_language)[0].text
    assert Pong.from_event(pong[0]).text == "still there?"


@pytest.mark.subprocess
def test_streaming_speaks_each_sentence_as_it_arrives(server: Server):
    pieces = ["The bed light is off now", ". The kitchen lights", " are on, and the door is locked."]

    async def run() -> tuple[list[Event], Event]:
        async with server.client() as client:
            await client.write_event(SynthesizeStart(voice=RYAN).event())
            for piece in pieces[:2]:
                await client.write_event(SynthesizeChunk(text=piece).event())
            # the first sentence is complete: its audio comes before the rest of the text
            first = await client.read_event()
            assert first is not None and AudioStart.is_type(first.type), first
            await client.write_event(SynthesizeChunk(text=pieces[2]).event())
            # what Home Assistant sends next, for servers that do not stream: to be ignored
            await client.write_event(Synthesize(text="".join(pieces), voice=RYAN).event())
            await client.write_event(SynthesizeStop().event())
            events = [first, *await read_until(client, SynthesizeStopped)]
            # nothing follows: the compatibility copy spoke no third time
            await client.write_event(Describe().event())
            after = await client.read_event()
            assert after is not None
            return events, after

    events, after = asyncio.run(run())
    assert SynthesizeStopped.is_type(events[-1].type) and AudioStop.is_type(events[-2].type)
    spoken = utterances(events)
    assert len(spoken) == 2 and all(len(a) > 0 and len(a) % FRAME_BYTES == 0 for a in spoken)
    assert not errors(events)
    assert Info.is_type(after.type), after


@pytest.mark.subprocess
def test_the_compatibility_copy_after_a_stream_is_ignored_too(server: Server):
    async def run() -> list[Event]:
        async with server.client() as client:
            await client.write_event(SynthesizeStart(voice=RYAN).event())
            await client.write_event(SynthesizeChunk(text=TEXT).event())
            await client.write_event(SynthesizeStop().event())
            await client.write_event(Synthesize(text=TEXT, voice=RYAN).event())  # late copy
            await client.write_event(Synthesize(text="And now something else.", voice=RYAN).event())
            return await read_until(client, SynthesizeStopped) + await read_until(client, AudioStop)

    events = asyncio.run(run())
    assert len(utterances(events)) == 2 and not errors(events)


@pytest.mark.subprocess
def test_errors_are_events_and_the_server_goes_on(server: Server):
    async def run() -> tuple[list[Event], ...]:
        async with server.client() as client:
            # a plain request's answer ends with audio-stop, also after an error: Home Assistant
            # reads until then
            await client.write_event(Synthesize(text=TEXT, voice=SynthesizeVoice(name="bob")).event())
            unknown = await read_until(client, AudioStop)
            await client.write_event(Synthesize(text="  \n", voice=RYAN).event())
            empty = await read_until(client, AudioStop)
            # a stream with an unknown voice: the error at once, and still synthesize-stopped
            await client.write_event(SynthesizeStart(voice=SynthesizeVoice(name="bob")).event())
            await client.write_event(SynthesizeChunk(text=TEXT).event())
            stream_error = await read_until(client, Error)
            await client.write_event(Synthesize(text=TEXT).event())
            await client.write_event(SynthesizeStop().event())
            stopped = await read_until(client, SynthesizeStopped)
            # the same connection (another text: a copy of the stream's text would be ignored)
            await client.write_event(Synthesize(text="Good to hear.", voice=RYAN).event())
            good = await read_until(client, AudioStop)
            await client.write_event(SynthesizeStop().event())  # a stop without a stream
            lone_stop = await read_until(client, SynthesizeStopped)
        return unknown, empty, stream_error, stopped, good, lone_stop

    unknown, empty, stream_error, stopped, good, lone_stop = asyncio.run(run())
    for answer in (unknown, empty):
        assert [e.type for e in answer] == ["error", "audio-start", "audio-stop"]
    assert errors(unknown)[0].text.startswith("unknown voice 'bob'; this model has: ")
    assert "ryan" in errors(unknown)[0].text and errors(unknown)[0].code == "UsageError"
    assert errors(empty)[0].code == "EmptyTextError"
    assert len(stream_error) == 1 and "unknown voice 'bob'" in errors(stream_error)[0].text
    assert len(stopped) == 1 and len(lone_stop) == 1
    assert len(utterances(good)) == 1 and not errors(good)
    # a new connection too
    assert len(utterances(asyncio.run(ask(server, Synthesize(text=TEXT, voice=RYAN).event())))) == 1


@pytest.mark.subprocess
def test_clients_are_spoken_together(server: Server):
    """The server's runtime takes 4 streams by default: three clients' utterances are generated
    together, each one's audio arriving while the others are still speaking."""

    async def one(i: int) -> tuple[list[Event], float, float]:
        async with server.client() as client:
            await client.write_event(Synthesize(text=f"Client number {i} speaks.", voice=RYAN).event())
            events, first = [], None
            while True:
                event = await client.read_event()
                assert event is not None
                events.append(event)
                if first is None and AudioChunk.is_type(event.type):
                    first = time.monotonic()
                if AudioStop.is_type(event.type):
                    assert first is not None
                    return events, first, time.monotonic()

    async def run() -> list[tuple[list[Event], float, float]]:
        return await asyncio.gather(*(one(i) for i in range(3)))

    results = asyncio.run(run())
    for events, _, _ in results:
        assert len(utterances(events)) == 1 and not errors(events)
    assert max(first for _, first, _ in results) < min(end for _, _, end in results)


@pytest.mark.serial
@pytest.mark.subprocess
def test_a_client_that_goes_away_frees_the_engines(server: Server):
    async def leave_mid_audio() -> None:
        client = server.client()
        await client.connect()
        await client.write_event(Synthesize(text=LONG, voice=RYAN).event())
        chunks = 0
        while chunks < 3:
            event = await client.read_event()
            assert event is not None
            chunks += AudioChunk.is_type(event.type)
        await client.disconnect()

    async def leave_while_queued() -> None:
        async with server.client() as busy, server.client() as queued:
            await busy.write_event(Synthesize(text=LONG, voice=RYAN).event())
            await read_until(busy, AudioStart)
            await queued.write_event(Synthesize(text=LONG, voice=RYAN).event())
            await queued.disconnect()  # never heard a thing

    # The server's threads grow to what its clients need at once, and stay: the utterances'
    # executor starts a worker whenever a request finds none idle, up to --max-streams (4 by
    # default), so how many it holds depends on timing (one more after 8 to 24 requests here,
    # then no more). A thread left behind by each client gone would outgrow that.
    asyncio.run(ask(server, Synthesize(text=TEXT, voice=RYAN).event()))
    before, rounds = server.threads(), 6  # rounds of three clients
    for _ in range(rounds):
        asyncio.run(leave_mid_audio())
        asyncio.run(leave_while_queued())
    # each LONG takes seconds: the next client waits for none of them
    t0 = time.monotonic()
    events = asyncio.run(ask(server, Synthesize(text=TEXT, voice=RYAN).event()))
    assert time.monotonic() - t0 < 4.0
    assert len(utterances(events)) == 1 and not errors(events)
    deadline = time.monotonic() + 10
    while server.threads() >= before + rounds:
        assert time.monotonic() < deadline, f"{server.threads()} threads, {before} before"
        time.sleep(0.1)
    assert server.proc.poll() is None and "Traceback" not in server.stderr()


@pytest.mark.subprocess
def test_sigint_mid_audio_stops_cleanly(model: Path, tmp_path: Path):
    s = Server(model, tmp_path / "stderr.txt")

    async def run() -> None:
        async with s.client() as client:
            await client.write_event(Synthesize(text=LONG, voice=RYAN).event())
            await read_until(client, AudioChunk)
            s.proc.send_signal(signal.SIGINT)
            while (event := await client.read_event()) is not None:  # then the server hangs up
                assert not Error.is_type(event.type), event

    try:
        asyncio.run(run())
    finally:
        rc, err = s.stop(signal.SIGINT)
    assert rc == 0, err
    assert "SIGINT: stopping" in err and err.rstrip().endswith("stopped") and "Traceback" not in err, err


@pytest.mark.subprocess
def test_a_busy_port_is_one_line(model: Path, server: Server, tmp_path: Path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kazeia_stream",
            "wyoming",
            "--uri",
            f"tcp://127.0.0.1:{server.port}",
            "--model",
            str(model),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith(f"kazeia-stream: error: cannot listen on tcp://127.0.0.1:{server.port}: ")
    assert len(r.stderr.splitlines()) == 1, r.stderr
