"""The speech server, live on 127.0.0.1, through clients nobody here wrote: the `openai` package,
`httpx` and `websockets`."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import websockets
from decoding import decode

import kazeia_stream
from kazeia_stream.pcm import pcm_bytes

pytestmark = pytest.mark.subprocess

TEXT = "Hello there, this is a tiny test."
LONG = " ".join(["This sentence is long enough to keep the engines busy for a while."] * 6)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kazeia_stream",
                "serve",
                "--model",
                str(model),
                "--port",
                str(self.port),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
            assert self.proc.poll() is None, self.proc.communicate()[1]
        raise AssertionError("the server did not start")

    def threads(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, err


@pytest.fixture(scope="module")
def model(tiny_gguf) -> Path:
    return tiny_gguf("custom_voice")[0]


@pytest.fixture(scope="module")
def server(model) -> Iterator[Server]:
    s = Server(model)
    yield s
    rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err, err


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def expected(model) -> bytes:
    """The API's audio for TEXT with ryan and seed 3 (streaming text, as the server feeds it), in
    the CLI's s16le."""
    runtime = kazeia_stream.Runtime(kazeia_stream.load_model(model))
    audio, _ = runtime.synthesize(TEXT, voice="ryan", seed=3, text_streaming=True)
    return pcm_bytes(audio, "s16le")


def s16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2")


def speech(client: openai.OpenAI, fmt: str, **extra: object) -> bytes:
    r = client.audio.speech.create(
        model="tts-1", voice="ryan", input=TEXT, response_format=fmt, extra_body={"seed": 3, **extra}
    )
    return r.content


# -- the OpenAI dialect ------------------------------------------------------------------------------


def test_openai_client_gets_the_apis_audio_as_pcm(client, expected):
    assert speech(client, "pcm") == expected and len(expected) > 0


def test_openai_streaming_response_arrives_in_pieces(client, expected):
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="ryan", input=TEXT, response_format="pcm", extra_body={"seed": 3}
    ) as response:
        assert response.headers["content-type"] == "audio/pcm"
        pieces = list(response.iter_bytes(chunk_size=None))
    assert len(pieces) > 1 and b"".join(pieces) == expected


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_lossless_formats_decode_to_the_pcm_samples(client, expected, fmt):
    audio, rate, channels = decode(speech(client, fmt), "int16")
    assert rate == 24000 and channels == 1
    np.testing.assert_array_equal(audio, s16(expected))


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_lossy_formats_have_the_right_length_and_rate(client, expected, fmt):
    n = len(s16(expected))
    info = sf.info(io.BytesIO(speech(client, fmt)))
    assert info.channels == 1 and info.samplerate in (24000, 48000)
    assert abs(info.frames * 24000 / info.samplerate - n) <= 3000  # codec delay and padding


def test_httpx_streams_wav_with_a_header_for_unknown_length(server):
    body = {"model": "tts-1", "input": TEXT, "voice": "ryan", "response_format": "wav", "seed": 3}
    with httpx.stream("POST", server.url + "/v1/audio/speech", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
        data = b"".join(r.iter_bytes())
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    assert sf.info(io.BytesIO(data)).samplerate == 24000


def test_sse_sends_base64_deltas_then_done_with_usage(server, expected):
    body = {"model": "tts-1", "input": TEXT, "voice": "ryan", "response_format": "pcm", "seed": 3,
            "stream_format": "sse"}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/audio/speech", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert events[-1]["type"] == "speech.audio.done" and len(deltas) == len(events) - 1
    assert events[-1]["usage"]["input_tokens"] > 0 and events[-1]["ttfa_s"] > 0
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == expected


def test_models_voices_and_health(server, client):
    assert [m.id for m in client.models.list()]
    voices = httpx.get(server.url + "/v1/audio/voices").json()
    assert "ryan" in [v["id"] for v in voices["voices"]] and "english" in voices["languages"]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok"


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"model": "tts-1", "input": "", "voice": "ryan"}, 400, "input"),
        ({"model": "tts-1", "input": "   ", "voice": "ryan"}, 400, "input"),
        ({"model": "tts-1", "input": TEXT, "voice": "alloy"}, 400, "unknown voice 'alloy'"),
        ({"model": "tts-1", "input": TEXT, "voice": "ryan", "language": "klingon"}, 400, "unknown language"),
        ({"model": "tts-1", "input": TEXT, "voice": "ryan", "response_format": "aac"}, 400, "aac"),
        (
            {"model": "tts-1", "input": TEXT, "voice": "ryan", "response_format": "ogg"},
            400,
            "response_format",
        ),
        ({"model": "tts-1", "input": TEXT, "voice": "ryan", "speed": 1.5}, 400, "speed"),
        ({"model": "tts-1", "input": "x" * 5000, "voice": "ryan"}, 400, "longer than"),
        ({"model": "tts-1", "input": TEXT, "voice": "ryan", "seed": -1}, 400, "seed"),
        ([1, 2], 400, "JSON object"),
    ],
)
def test_bad_requests_get_openai_shaped_errors(server, body, status, words):
    r = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health").status_code == 200


def test_bad_bodies_and_routes(server, client):
    r = httpx.post(server.url + "/v1/audio/speech", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/audio/speech", content=b" " * (1 << 20), timeout=30)
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    assert httpx.get(server.url + "/v1/audio/speech").status_code == 405
    with pytest.raises(openai.BadRequestError, match="unknown voice"):
        client.audio.speech.create(model="tts-1", voice="nobody", input=TEXT)
    assert len(speech(client, "pcm")) > 0  # still serving


def test_an_api_key_guards_every_route_but_health(model):
    s = Server(model, "--api-key", "sekrit")
    try:
        assert httpx.get(s.url + "/health").status_code == 200
        for path in ("/v1/models", "/v1/audio/voices", "/v1/nothing"):
            r = httpx.get(s.url + path, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.audio.speech.create(model="tts-1", voice="ryan", input=TEXT)
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sekrit", max_retries=0)
        assert len(
            good.audio.speech.create(model="tts-1", voice="ryan", input=TEXT, response_format="pcm").content
        )
    finally:
        rc, err = s.stop()
        assert rc == 0, err


# -- several clients, disconnects, shutdown -----------------------------------------------------


def test_concurrent_clients_are_spoken_together_each_as_alone(tiny_gguf):
    """The server's runtime (4 streams by default) generates the three requests together; each
    gets its audio as spoken alone (each stream's arithmetic is its solo
    arithmetic), within the decoder's rounding beside other streams: at most 1 in 16 bits."""
    q8 = tiny_gguf("custom_voice", "q8_0")[0]
    runtime = kazeia_stream.Runtime(kazeia_stream.load_model(q8))
    alone = s16(pcm_bytes(runtime.synthesize(TEXT, voice="ryan", seed=3, text_streaming=True)[0], "s16le"))
    s = Server(q8)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    results: list[bytes] = []
    spans: list[tuple[float, float]] = []

    def one() -> None:
        with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="ryan", input=TEXT, response_format="pcm", extra_body={"seed": 3}
        ) as response:
            pieces = response.iter_bytes(chunk_size=None)
            first = next(pieces)
            start = time.monotonic()
            results.append(first + b"".join(pieces))
            spans.append((start, time.monotonic()))

    try:
        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        s.stop()
    assert len(results) == 3
    for got in results:
        assert len(got) == 2 * len(alone)
        assert np.abs(s16(got).astype(np.int32) - alone).max() <= 1
    # they were in flight at once: each began before the others had finished
    assert max(start for start, _ in spans) < min(end for _, end in spans)


def test_a_full_queue_answers_503_with_retry_after(model):
    s = Server(model, "--max-queue", "0", "--max-streams", "1")
    try:
        body = {"model": "tts-1", "input": LONG, "voice": "ryan", "response_format": "pcm"}
        with httpx.stream("POST", s.url + "/v1/audio/speech", json=body, timeout=60) as first:
            pieces = first.iter_bytes()  # kept: a dropped iterator closes the response
            next(pieces)  # the first request is speaking
            r = httpx.post(s.url + "/v1/audio/speech", json=body, timeout=60)
            assert r.status_code == 503 and r.headers["retry-after"] == "2"
            assert r.json()["error"]["code"] == "busy"
        assert (
            httpx.post(s.url + "/v1/audio/speech", json={**body, "input": TEXT}, timeout=60).status_code
            == 200
        )
    finally:
        s.stop()


def test_disconnects_mid_stream_leak_no_thread_nor_memory(server):
    body = {"model": "tts-1", "input": LONG, "voice": "ryan", "response_format": "pcm"}
    short = {**body, "input": "Hi."}
    httpx.post(server.url + "/v1/audio/speech", json=short, timeout=60)
    threads, rss = server.threads(), server.rss_mb()
    for i in range(100):
        if i % 10:
            with httpx.stream("POST", server.url + "/v1/audio/speech", json=body, timeout=60) as r:
                next(r.iter_bytes())  # then hang up mid-utterance
        else:
            assert httpx.post(server.url + "/v1/audio/speech", json=short, timeout=60).status_code == 200
    time.sleep(0.5)
    assert httpx.get(server.url + "/health").json()["in_flight"] == 0
    assert server.threads() <= threads + 2
    assert server.rss_mb() < rss + 50


@pytest.mark.serial
def test_sigterm_lets_the_stream_in_flight_finish(model, expected):
    s = Server(model)
    idle = httpx.Client()  # a keep-alive connection left open must not hold the shutdown
    assert idle.get(s.url + "/health").status_code == 200
    body = {"model": "tts-1", "input": TEXT, "voice": "ryan", "response_format": "pcm", "seed": 3}
    with httpx.stream("POST", s.url + "/v1/audio/speech", json=body, timeout=60) as r:
        pieces = r.iter_bytes()
        first = next(pieces)
        stopped_at = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        late = httpx.post(s.url + "/v1/audio/speech", json=body, timeout=60)
        data = first + b"".join(pieces)
    assert data == expected  # the stream in flight finished whole
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
    _, err = s.proc.communicate(timeout=60)
    assert time.monotonic() - stopped_at < 5
    assert s.proc.returncode == 0 and "stopped" in err and "Traceback" not in err, err
    idle.close()


# -- the conversational WebSocket --------------------------------------------------------------------


async def converse(url: str, script) -> list:
    async with websockets.connect(url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
        await ws.send(
            json.dumps({"type": "session.config", "voice": "ryan", "response_format": "pcm", "seed": 3})
        )
        ready = json.loads(await ws.recv())
        assert ready["type"] == "session.ready" and ready["sample_rate"] == 24000
        return await script(ws)


async def events_until_done(ws, cancel_after_audio: bool = False) -> tuple[list[dict], bytes, float | None]:
    events, audio, cancelled_at = [], b"", None
    while True:
        msg = await asyncio.wait_for(ws.recv(), 60)
        if isinstance(msg, bytes):
            audio += msg
            if cancel_after_audio and cancelled_at is None:
                cancelled_at = time.monotonic()
                await ws.send(json.dumps({"type": "cancel"}))
            continue
        event = json.loads(msg)
        events.append(event)
        if event["type"] == "utterance.done":
            return events, audio, cancelled_at


@pytest.mark.serial
def test_websocket_speaks_text_pieces_and_barges_in(server, expected):
    async def script(ws):
        for word in TEXT.split(" "):
            await ws.send(json.dumps({"type": "text", "text": word + " "}))
        await ws.send(json.dumps({"type": "end"}))
        first = await events_until_done(ws)
        await ws.send(json.dumps({"type": "text", "text": LONG}))
        await ws.send(json.dumps({"type": "end"}))
        barged = await events_until_done(ws, cancel_after_audio=True)
        stop = time.monotonic()
        await ws.send(json.dumps({"type": "text", "text": TEXT}))
        await ws.send(json.dumps({"type": "end"}))
        after = await events_until_done(ws)
        return first, barged, stop, after

    (events, audio, _), (b_events, b_audio, cancelled_at), stop, (a_events, a_audio, _) = asyncio.run(
        converse(server.url, script)
    )
    assert [e["type"] for e in events] == ["utterance.started", "utterance.first_audio", "utterance.done"]
    assert events[-1]["metrics"]["ttfa_s"] > 0 and not events[-1]["cancelled"]
    assert audio == expected  # the text's pieces speak as the text given whole
    assert b_events[-1]["cancelled"] and stop - cancelled_at < 1.0
    assert len(b_audio) < 2 * 24000 * 10  # far less than the long text's audio
    assert not a_events[-1]["cancelled"] and len(a_audio) > 0  # the session goes on


def test_websocket_errors_are_events(server):
    async def script(ws):
        await ws.send(json.dumps({"type": "dance"}))
        return json.loads(await ws.recv())

    event = asyncio.run(converse(server.url, script))
    assert event["type"] == "error" and "unknown message type" in event["message"]

    async def garbage(ws):
        answers = []
        for bad in ("{not json", b"\x00\x01"):
            await ws.send(bad)
            answers.append(json.loads(await ws.recv()))
        await ws.send(json.dumps({"type": "text", "text": TEXT}))
        await ws.send(json.dumps({"type": "end"}))
        return answers, await events_until_done(ws)

    (not_json, binary), (events, audio, _) = asyncio.run(converse(server.url, garbage))
    assert "not valid JSON" in not_json["message"] and "JSON text" in binary["message"]
    assert not events[-1]["cancelled"] and len(audio) > 0  # the session went on

    async def bad_voice() -> dict:
        async with websockets.connect(server.url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
            await ws.send(json.dumps({"type": "session.config", "voice": "nobody"}))
            return json.loads(await ws.recv())

    event = asyncio.run(bad_voice())
    assert event["type"] == "error" and "unknown voice" in event["message"]


def test_websocket_clients_that_leave_mid_utterance_leave_the_server_serving(server):
    async def leave(ws):
        await ws.send(json.dumps({"type": "text", "text": LONG}))
        await ws.send(json.dumps({"type": "end"}))
        while not isinstance(await ws.recv(), bytes):  # audio is flowing: hang up
            pass

    for _ in range(3):
        asyncio.run(converse(server.url, leave))
    time.sleep(0.5)
    assert httpx.get(server.url + "/health").json()["in_flight"] == 0
    # the module's server must also stop without a traceback (its fixture checks)
