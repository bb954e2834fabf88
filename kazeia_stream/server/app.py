"""The speech server: OpenAI's `/v1/audio/speech` dialect and a conversational WebSocket, an ASGI
app (Starlette) on Hypercorn's trio worker, over one `Runtime`.

Routes: `GET /health` (no key needed), `GET /v1/models`, `GET /v1/audio/voices`,
`POST /v1/audio/speech`, WebSocket `/v1/audio/speech/stream` (the protocol is in README).
Audio leaves as it is produced. Errors are OpenAI's JSON shape (`{"error": {"message", "type",
"param", "code"}}`) with their status. The runtime speaks up to its `max_streams` utterances at
once, generated together; requests beyond them wait in order, up to `max_queue` of them; more
get 503 with Retry-After.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import math
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from .. import __version__
from ..engine.frames import GenerationOptions
from ..errors import KazeiaError, UsageError
from ..runtime import Runtime
from ..session import single_errors
from .formats import FORMATS, check_format, open_encoder
from .voices import ServerVoices

log = logging.getLogger(__name__)

MAX_INPUT_CHARS = 4096  # OpenAI's limit for `input`
MAX_BODY_BYTES = 64 * 1024
RETRY_AFTER_S = 2
GRACEFUL_TIMEOUT_S = 10.0  # in-flight streams may finish this long after a shutdown signal
IDLE_CLOSE_S = 0.5  # then Hypercorn closes the connections left (idle keep-alive ones)
# sampling settings a request may set, beside `seed` (GenerationOptions fields)
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "repetition_penalty")


class ApiError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class Admission:
    """Requests in flight: at most `speaking` speaking and `max_queue` waiting; beyond, 503.
    Also counts every stream speaking (WebSocket utterances too), which a shutdown waits for."""

    def __init__(self, speaking: int, max_queue: int) -> None:
        self.limit = speaking + max_queue
        self.in_flight = 0
        self.streams = 0
        self.stopping = False

    def take(self) -> Callable[[], None]:
        """Admit a request (or raise a 503); returns what releases it."""
        if self.stopping:
            raise ApiError(503, "the server is shutting down", "server_error", code="shutting_down")
        if self.in_flight >= self.limit:
            raise ApiError(
                503, f"the server is busy ({self.in_flight} requests in flight); retry shortly",
                "server_error", code="busy", headers={"Retry-After": str(RETRY_AFTER_S)},
            )  # fmt: skip
        self.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1

        return release


class _Released(StreamingResponse):
    """A streamed response whose body a task of its own writes into a channel (`produce`), and
    that frees its admission however it ends: finished, failed, or the client gone before or
    during it. The body holds a session, a nursery, which must be left in the task that
    entered it: Starlette iterates a body in a task of its own and, when the client left,
    cancelled that task with an async generator body suspended inside the session's nursery,
    which corrupted trio's cancel-scope stack (seen in a test server's log)."""

    def __init__(
        self,
        produce: Callable[[trio.MemorySendChannel[bytes]], Awaitable[None]],
        admission: Admission,
        **kw: Any,
    ) -> None:
        self._chunks, chunks = trio.open_memory_channel[bytes](0)
        super().__init__(chunks, **kw)
        self._produce, self._release = produce, admission.take()
        self._admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._admission.streams += 1
        try:
            with single_errors():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._write)
                    await super().__call__(scope, receive, send)
                    nursery.cancel_scope.cancel()  # the client is gone, or it was all sent
        finally:
            self._admission.streams -= 1
            self._release()

    async def _write(self) -> None:
        async with self._chunks:
            await self._produce(self._chunks)


@dataclass(frozen=True)
class Speech:
    """A checked request: what to say, how, and how to send it."""

    text: str
    n_tokens: int
    session: dict[str, Any]  # Runtime.open's keyword arguments
    response_format: str
    sse: bool


class SpeechServer:
    """The app's state: the runtime, its voices, the key, the admission queue."""

    def __init__(self, runtime: Runtime, voices: ServerVoices, api_key: str | None, max_queue: int) -> None:
        self.runtime, self.voices, self.api_key = runtime, voices, api_key
        self.admission = Admission(runtime.max_streams, max_queue)
        self.model_id = runtime.model.identity
        self.app: ASGIApp = _Guard(
            Starlette(
                routes=[
                    Route("/health", self.health),
                    Route("/v1/models", self.models),
                    Route("/v1/audio/voices", self.list_voices),
                    Route("/v1/audio/speech", self.speech, methods=["POST"]),
                    WebSocketRoute("/v1/audio/speech/stream", self.stream),
                ],
                exception_handlers={ApiError: _api_error, 404: _not_found, 405: _not_allowed},
            ),
            self,
        )

    # -- plain routes ----------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "in_flight": self.admission.in_flight, "version": __version__})

    async def models(self, request: Request) -> Response:
        model = {"id": self.model_id, "object": "model", "created": 0, "owned_by": "kazeia-stream"}
        return JSONResponse({"object": "list", "data": [model]})

    async def list_voices(self, request: Request) -> Response:
        voices = [{"id": name, "name": name} for name in self.voices.names]
        return JSONResponse(
            {"object": "list", "data": voices, "voices": voices, "languages": self.runtime.model.languages}
        )

    # -- POST /v1/audio/speech ---------------------------------------------------------------------

    async def speech(self, request: Request) -> Response:
        speech = self._parse(await _json_body(request))
        started = time.perf_counter()

        async def produce(chunks: trio.MemorySendChannel[bytes]) -> None:
            async with self.runtime.open(**speech.session) as tts:
                async for piece in self._encoded(tts.speak(speech.text), speech, started):
                    await chunks.send(piece)

        media = "text/event-stream" if speech.sse else FORMATS[speech.response_format]
        return _Released(produce, self.admission, media_type=media, headers={"Cache-Control": "no-store"})

    async def _encoded(self, utterance: Any, speech: Speech, started: float) -> AsyncIterator[bytes]:
        """The utterance's audio in the response format; with SSE, as OpenAI's events."""
        encoder = open_encoder(speech.response_format, self.runtime.model.sample_rate)
        first: float | None = None
        frames = 0
        async for chunk in utterance:
            if first is None:
                first = time.perf_counter()
            frames += 1
            if data := encoder.write(chunk.pcm):
                yield _sse_delta(data) if speech.sse else data
        if data := encoder.finish():
            yield _sse_delta(data) if speech.sse else data
        m = utterance.metrics
        ttfa = None if first is None else first - started
        log.info(
            "speech: %.2f s of audio, first after %s s (queued %.2f s), RTF %.2f",
            m.audio_s, "-" if ttfa is None else f"{ttfa:.2f}", m.started - started, m.rtf or 0.0,
        )  # fmt: skip
        if speech.sse:
            tokens = speech.n_tokens
            usage = {"input_tokens": tokens, "output_tokens": frames, "total_tokens": tokens + frames}
            done = {
                "type": "speech.audio.done",
                "usage": usage,
                "ttfa_s": ttfa,
                "queued_s": m.started - started,
            }
            yield f"data: {json.dumps(done)}\n\n".encode()

    def _parse(self, body: Any) -> Speech:
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        text = body.get("input")
        if not isinstance(text, str) or not text.strip():
            raise ApiError(400, "'input' must be a non-empty string", param="input")
        if len(text) > MAX_INPUT_CHARS:
            raise ApiError(400, f"'input' is longer than {MAX_INPUT_CHARS} characters", param="input")
        fmt = _string(body, "response_format", "mp3")
        stream_format = _string(body, "stream_format", "audio")
        if stream_format not in ("audio", "sse"):
            raise ApiError(400, "stream_format must be 'audio' or 'sse'", param="stream_format")
        speed = body.get("speed", 1.0)
        if not isinstance(speed, int | float) or isinstance(speed, bool) or speed != 1.0:
            raise ApiError(400, "only speed 1.0 is supported (the model has no speed control)", param="speed")
        session = self._settings(body)
        try:
            fmt = check_format(fmt)
            self.runtime.probe(session["voice"], session["language"], session["instruct"])
            n_tokens = self.runtime.model.count_tokens(text)
        except KazeiaError as e:
            raise ApiError(400, str(e)) from None
        return Speech(text, n_tokens, session, fmt, stream_format == "sse")

    def _settings(self, body: dict[str, Any]) -> dict[str, Any]:
        """Runtime.open's arguments from a request's (or a WebSocket config's) fields."""
        try:
            voice = self.voices.resolve(_string(body, "voice", None))
        except UsageError as e:
            raise ApiError(400, str(e), param="voice") from None
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise ApiError(400, "'seed' must be a non-negative integer", param="seed")
        options = {name: body[name] for name in ("seed", *SAMPLING_FIELDS) if body.get(name) is not None}
        try:
            GenerationOptions(**options).resolve(self.runtime.model.config.generation)
        except (TypeError, ValueError) as e:
            raise ApiError(400, f"bad sampling settings: {e}") from None
        return {
            "voice": voice,
            "language": _string(body, "language", "auto"),
            "instruct": _string(body, "instructions", None) if self.runtime.model.kind != "base" else None,
            **options,
        }

    # -- WebSocket /v1/audio/speech/stream ----------------------------------------------------------

    async def stream(self, ws: WebSocket) -> None:
        """The conversational protocol (README): config, then text pieces and `end` per
        utterance; `cancel` is barge-in; binary audio and JSON events back."""
        if self.api_key is not None and not _key_ok(ws.headers, ws.query_params.get("api_key"), self.api_key):
            await ws.close(code=4401, reason="invalid API key")
            return
        await ws.accept()
        if self.admission.stopping:
            await ws.close(code=1013, reason="the server is shutting down")
            return
        try:
            config = await _message(ws)
            if not isinstance(config, dict) or config.get("type") != "session.config":
                raise UsageError('the first message must be {"type": "session.config", ...}')
            fmt = check_format(_string(config, "response_format", "pcm"))
            settings = self._settings(config)
            async with self.runtime.open(**settings) as tts:
                await ws.send_json(
                    {"type": "session.ready", "sample_rate": self.runtime.model.sample_rate, "format": fmt}
                )
                await _Conversation(self, ws, tts, fmt).run()
        except WebSocketDisconnect:
            return
        except (KazeiaError, ApiError, ValueError) as e:
            await _send_error(ws, str(e.message if isinstance(e, ApiError) else e))
            await ws.close(code=1008)


class _Conversation:
    """One WebSocket's utterances: a reader task takes the client's messages, an utterance at a
    time is spoken and its audio sent."""

    def __init__(self, server: SpeechServer, ws: WebSocket, tts: Any, fmt: str) -> None:
        self.server, self.ws, self.tts, self.fmt = server, ws, tts, fmt
        self.count = 0
        self.text: trio.MemorySendChannel[str] | None = None

    async def run(self) -> None:
        """Until the client goes (WebSocketDisconnect, raised as itself, not in a group)."""
        with single_errors():
            await self._run()

    async def _run(self) -> None:
        async with trio.open_nursery() as nursery:
            queue_send, queue_recv = trio.open_memory_channel[trio.MemoryReceiveChannel[str]](math.inf)
            nursery.start_soon(self._speaker, queue_recv)
            try:
                while True:
                    try:
                        msg = await _message(self.ws)
                    except UsageError as e:  # not JSON: said, and the session goes on
                        await _send_error(self.ws, str(e))
                        continue
                    kind = msg.get("type") if isinstance(msg, dict) else None
                    if kind == "text":
                        piece = msg.get("text")
                        if not isinstance(piece, str):
                            await _send_error(self.ws, "a text message needs a string 'text'")
                            continue
                        if self.text is None:
                            self.text, receive = trio.open_memory_channel[str](math.inf)
                            queue_send.send_nowait(receive)
                        self.text.send_nowait(piece)
                    elif kind == "end":
                        if self.text is not None:
                            self.text.close()
                            self.text = None
                    elif kind == "cancel":
                        if self.text is not None:
                            self.text.close()
                            self.text = None
                        self.tts.cancel()
                    else:
                        await _send_error(self.ws, f"unknown message type {kind!r}: text, end or cancel")
            finally:
                nursery.cancel_scope.cancel()

    async def _speaker(self, queue: trio.MemoryReceiveChannel[trio.MemoryReceiveChannel[str]]) -> None:
        async for text in queue:
            self.count += 1
            n = self.count
            await self.ws.send_json({"type": "utterance.started", "utterance": n})
            encoder = open_encoder(self.fmt, self.server.runtime.model.sample_rate)
            utterance = self.tts.speak(_pieces(text))
            first = True
            self.server.admission.streams += 1
            try:
                async for chunk in utterance:
                    if first:
                        first = False
                        ttfa = utterance.metrics.ttfa_s
                        await self.ws.send_json(
                            {"type": "utterance.first_audio", "utterance": n, "ttfa_s": ttfa}
                        )
                    if data := encoder.write(chunk.pcm):
                        await self.ws.send_bytes(data)
            except KazeiaError as e:
                await _send_error(self.ws, str(e), n)
            finally:
                self.server.admission.streams -= 1
            if not utterance.metrics.cancelled and (data := encoder.finish()):
                await self.ws.send_bytes(data)
            m = utterance.metrics
            done = {
                "type": "utterance.done",
                "utterance": n,
                "cancelled": m.cancelled,
                "metrics": _metrics(m),
            }
            await self.ws.send_json(done)


async def _message(ws: WebSocket) -> Any:
    """The client's next message, parsed; UsageError for a binary or non-JSON one."""
    message = await ws.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    if message.get("text") is None:
        raise UsageError("messages to the server are JSON text (binary messages carry the audio back)")
    try:
        return json.loads(message["text"])
    except ValueError as e:
        raise UsageError(f"a message is not valid JSON ({e})") from None


async def _pieces(channel: trio.MemoryReceiveChannel[str]) -> AsyncIterator[str]:
    async with channel:
        async for piece in channel:
            yield piece


def _metrics(m: Any) -> dict[str, Any]:
    return {"ttfa_s": m.ttfa_s, "rtf": m.rtf, "audio_s": m.audio_s, "wall_s": m.wall_s, "frames": m.frames}


async def _send_error(ws: WebSocket, message: str, utterance: int | None = None) -> None:
    event: dict[str, Any] = {"type": "error", "message": message}
    if utterance is not None:
        event["utterance"] = utterance
    await ws.send_json(event)


def _sse_delta(data: bytes) -> bytes:
    event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}
    return f"data: {json.dumps(event)}\n\n".encode()


def _string(body: dict[str, Any], key: str, default: str | None) -> Any:
    value = body.get(key, default)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"{key!r} must be a string", param=key)
    return value


async def _json_body(request: Request) -> Any:
    size = int(request.headers.get("content-length") or 0)
    if size > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    data = b""
    async for part in request.stream():
        data += part
        if len(data) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(data)
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None


def _key_ok(headers: Any, query_key: str | None, key: str) -> bool:
    """The bearer key (or `api_key` query parameter, for WebSocket clients that cannot set
    headers), compared in constant time."""
    auth = headers.get("authorization", "")
    given = auth[7:] if auth.lower().startswith("bearer ") else (query_key or "")
    return hmac.compare_digest(given.encode(), key.encode())


class _Guard:
    """The API key on every route but /health, before routing, so an unknown route without a
    key is 401 too (nothing about the server leaks without it)."""

    def __init__(self, app: ASGIApp, server: SpeechServer) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.server.api_key
        if scope["type"] == "http" and key is not None and scope["path"] != "/health":
            request = Request(scope)
            if not _key_ok(request.headers, None, key):
                error = ApiError(401, "invalid or missing API key", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _not_found(request: Request, exc: Exception) -> Response:
    return ApiError(404, f"no route {request.url.path}", code="not_found").response()


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return ApiError(405, f"{request.method} is not allowed on {request.url.path}").response()


def serve(
    runtime: Runtime, voices: ServerVoices, host: str, port: int, api_key: str | None, max_queue: int
) -> int:
    """Run the server until SIGINT or SIGTERM, then refuse new requests (503), let the streams
    speaking finish (up to GRACEFUL_TIMEOUT_S) and close every connection, idle ones at once."""
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    _serialise_hypercorn_close()
    server = SpeechServer(runtime, voices, api_key, max_queue)
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.graceful_timeout = IDLE_CLOSE_S
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")

    async def main() -> None:
        stop = trio.Event()

        async def shutdown_trigger() -> None:
            await stop.wait()

        async def signals() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
                async for signum in received:
                    log.warning("%s: stopping (in-flight streams may finish)", signal.Signals(signum).name)
                    server.admission.stopping = True
                    with trio.move_on_after(GRACEFUL_TIMEOUT_S):
                        while server.admission.streams or server.admission.in_flight:
                            await trio.sleep(0.05)
                    stop.set()
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(signals)
            bound = await nursery.start(_run, hypercorn_serve, server.app, config, shutdown_trigger)
            log.warning("serving %s on %s", runtime.model.talker_path.name, ", ".join(bound))
            await stop.wait()
        log.warning("stopped")

    trio.run(main)
    return 0


def _serialise_hypercorn_close() -> None:
    """Hypercorn 0.18's trio TCPServer sends the EOF of a closing connection (`_close`) outside
    the lock its data sends hold: when a WebSocket client hangs up while audio is being sent, the
    two meet on the socket, trio raises BusyResourceError in the send, which nothing catches, and
    the whole server stops. Taking the same lock in `_close` orders them (installed once)."""
    from hypercorn.trio.tcp_server import TCPServer

    close = TCPServer._close
    if getattr(close, "serialised", False):
        return

    async def serialised_close(self: TCPServer) -> None:
        if self.send_lock.statistics().owner is trio.lowlevel.current_task():
            await close(self)  # a send that failed is closing the connection: it holds the lock
            return
        async with self.send_lock:
            await close(self)

    serialised_close.serialised = True  # type: ignore[attr-defined]
    TCPServer._close = serialised_close  # type: ignore[method-assign]


async def _run(
    hypercorn_serve: Callable[..., Awaitable[None]],
    app: ASGIApp,
    config: Any,
    shutdown_trigger: Callable[[], Awaitable[None]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger, task_status=task_status)
