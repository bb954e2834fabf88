"""The CLI's modes, each through a session (the decoder overlapping the generator): speaking
through the sound card, `--pipe` (text in, PCM out) and `-o` (a file)."""

from __future__ import annotations

import array
import codecs
import fcntl
import logging
import os
import stat
import sys
import termios
import time
from collections.abc import AsyncIterator
from typing import Any

import trio

from .audio_file import AudioFileWriter
from .engine.frames import frame_cap
from .errors import EmptyTextError, OutputError, UsageError
from .pcm import SAMPLE_BYTES
from .runtime import Runtime
from .stages.playback import AudioPlayer
from .stages.sinks import play, write_pcm

log = logging.getLogger(__name__)

SECONDS_PER_TOKEN = 0.3  # a typical speaking pace, for the pre-buffer estimate


async def speak_live(runtime: Runtime, text: str, *, device: str | int | None, **session: Any) -> int:
    """Speak `text` through the sound card as soon as audio exists."""
    model = runtime.model
    n_tokens = model.count_tokens(text)
    frame_s = model.config.codec.samples_per_frame / model.sample_rate
    longest_s = frame_s * frame_cap(n_tokens, model.config.generation.max_new_tokens)
    with AudioPlayer(model.sample_rate, device=device) as player:
        async with runtime.open(**session) as tts:
            utterance = tts.speak(text, ahead=lambda: player.queued_seconds)
            await play(utterance, player, SECONDS_PER_TOKEN * n_tokens, longest_s)
            m = utterance.metrics
            log.info(
                "first audio after %.3f s, real-time factor %.2f, %d underruns",
                m.ttfa_s or 0.0,
                m.rtf or 0.0,
                player.underruns,
            )
    return 0


async def write_file(runtime: Runtime, text: str, path: str, **session: Any) -> int:
    """Write the speech of `text` into a file as it is produced, with a progress line on a
    terminal."""
    rate = runtime.model.sample_rate
    progress = Progress(rate)
    with AudioFileWriter(path, rate) as out:  # a bad target fails before any work
        async with runtime.open(**session) as tts:
            async for chunk in tts.speak(text, live=False):
                out.write(chunk.pcm)
                progress.update(out.frames)
    progress.close(f"wrote {path}: {out.frames / rate:.2f} s")
    return 0


class Progress:
    """One self-rewriting status line on a terminal's stderr; nothing in a pipe."""

    def __init__(self, sample_rate: int) -> None:
        self.sample_rate = sample_rate
        self.enabled = sys.stderr.isatty()
        self.start = time.perf_counter()

    def update(self, samples: int) -> None:
        if self.enabled:
            audio = samples / self.sample_rate
            rtf = (time.perf_counter() - self.start) / max(audio, 1e-9)
            print(f"\r{audio:6.2f} s of audio, {rtf:4.2f}x real time ", end="", file=sys.stderr, flush=True)

    def close(self, message: str) -> None:
        if self.enabled:
            print("\r" + " " * 40 + "\r", end="", file=sys.stderr)
        log.info("%s", message)


LINE_BUFFER = 16  # lines waiting while the current one is spoken
PIECE_BUFFER = 1024  # text pieces of one line waiting to be tokenized


class Refusals:
    """Input `pipe` reported on stderr and skipped, going on with the rest: its exit status is
    then 1, as a tool that reads many inputs (cp, grep) says that one of them failed."""

    def __init__(self) -> None:
        self.count = 0

    def report(self, message: str) -> None:
        print(f"kazeia-stream: {message}", file=sys.stderr)
        self.count += 1


async def read_lines(
    fd: int, lines: trio.MemorySendChannel[trio.MemoryReceiveChannel[str]], refusals: Refusals
) -> None:
    """Send each line of UTF-8 text on `fd` as a channel of its pieces, opened as soon as the
    line starts, so a line is spoken while it is still being written. A line ends at LF, CR or
    CR LF. Invalid UTF-8 is reported and skipped (`refusals`)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    send: trio.MemorySendChannel[str] | None = None
    async with lines, trio.lowlevel.FdStream(os.dup(fd)) as source:
        while data := await source.receive_some(65536):
            for part in data.splitlines(keepends=True):
                if send is None:
                    send, receive = trio.open_memory_channel[str](PIECE_BUFFER)
                    await lines.send(receive)
                text, bad = _decode(decoder, part)
                if bad:
                    refusals.report(f"skipped invalid UTF-8 bytes {bad!r}")
                text = text.rstrip("\r\n")
                if text:
                    await send.send(text)
                if part.endswith((b"\n", b"\r")):
                    decoder.reset()
                    await send.aclose()
                    send = None
        if send is not None:
            await send.aclose()


def _decode(decoder: codecs.IncrementalDecoder, data: bytes) -> tuple[str, bytes]:
    """Decode, dropping invalid byte sequences: the text, and the bytes dropped."""
    text, bad = "", b""
    while True:
        try:
            text += decoder.decode(data)
            break
        except UnicodeDecodeError as e:
            text += data[: e.start].decode("utf-8", errors="ignore")
            bad += data[e.start : e.end]
            data = data[e.end :]
            decoder.reset()
    return text, bad


async def _pieces(channel: trio.MemoryReceiveChannel[str]) -> AsyncIterator[str]:
    async with channel:
        async for piece in channel:
            yield piece


def listener(fd: int, fmt: str, sample_rate: int) -> dict[str, Any]:
    """How the PCM written to `fd` is heard, as `Session.speak`'s keywords: nobody hears a
    regular file or /dev/null as it comes (`live=False`: the decoder may push several frames at
    once); a pipe's reader has at least what is still in the pipe to hear (`ahead`, which
    lets the decoder do the same while that is long); of anything else (a terminal, a socket,
    a pipe that does not say) nothing is known, and the utterance is live."""
    mode = os.fstat(fd)
    if stat.S_ISREG(mode.st_mode) or os.path.samestat(mode, os.stat(os.devnull)):
        return {"live": False}
    if stat.S_ISFIFO(mode.st_mode):
        try:
            _queued_bytes(fd)
        except OSError:
            return {}
        per_second = SAMPLE_BYTES[fmt] * sample_rate
        return {"ahead": lambda: _queued_bytes(fd) / per_second}
    return {}


def _queued_bytes(fd: int) -> int:
    """The bytes written to a pipe that its reader has not read yet."""
    queued = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, queued)
    return queued[0]


async def pipe(runtime: Runtime, fmt: str, **session: Any) -> int:
    """Read text from stdin (a line is an utterance) and write raw PCM to stdout, nothing
    else, flushed per chunk. A reader that closed stdout ends it quietly; any other write error
    is an `OutputError`. Input refused on the way (invalid UTF-8, a line the session refuses)
    is reported and skipped, and the exit status is then 1 (`Refusals`). Whether anyone hears
    the audio as it comes depends on what stdout is (`listener`)."""
    lines_send, lines = trio.open_memory_channel[trio.MemoryReceiveChannel[str]](LINE_BUFFER)
    refusals = Refusals()
    out = trio.lowlevel.FdStream(os.dup(sys.stdout.fileno()))
    heard = listener(out.fileno(), fmt, runtime.model.sample_rate)
    async with out, runtime.open(**session) as tts, trio.open_nursery() as nursery:
        nursery.start_soon(read_lines, sys.stdin.fileno(), lines_send, refusals)
        async for line in lines:
            try:
                await write_pcm(tts.speak(_pieces(line), **heard), out, fmt)
            except EmptyTextError:  # blank lines are simply skipped
                pass
            except UsageError as e:
                refusals.report(str(e))
            except trio.BrokenResourceError as e:
                if not isinstance(e.__cause__, BrokenPipeError):
                    reason = getattr(e.__cause__, "strerror", None) or str(e.__cause__ or e)
                    raise OutputError(f"cannot write to stdout: {reason}") from None
                nursery.cancel_scope.cancel()
                break
    return 1 if refusals.count else 0
