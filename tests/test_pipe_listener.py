"""What `--pipe`'s stdout says of its listener (`live.listener`), and the pushes it gives."""

from __future__ import annotations

import contextlib
import os
import socket
import sys

import pytest
import trio
from test_stream import held_pushes

from kazeia_stream import live

RATE = 24000
TEXT = "Hello there, this is the first line."


@pytest.fixture
def pipe_fds():
    """A pipe's (read, write) descriptors, closed after the test."""
    fds = os.pipe()
    yield fds
    for fd in fds:
        os.close(fd)


def test_nobody_hears_a_regular_file_or_dev_null_as_it_comes(tmp_path):
    with open(tmp_path / "out.pcm", "wb") as f:
        assert live.listener(f.fileno(), "s16le", RATE) == {"live": False}
    with open(os.devnull, "wb") as f:
        assert live.listener(f.fileno(), "s16le", RATE) == {"live": False}


@pytest.mark.parametrize("fmt, sample_bytes", [("s16le", 2), ("f32le", 4)])
def test_a_pipes_reader_has_what_is_still_in_the_pipe_to_hear(pipe_fds, fmt, sample_bytes):
    read, write = pipe_fds
    ahead = live.listener(write, fmt, RATE)["ahead"]
    assert ahead() == 0.0
    os.write(write, bytes(sample_bytes * RATE // 2))
    assert ahead() == pytest.approx(0.5)
    os.read(read, sample_bytes * RATE // 4)
    assert ahead() == pytest.approx(0.25)


def test_of_a_pipe_that_does_not_say_what_it_holds_nothing_is_known(pipe_fds, monkeypatch):
    def refuse(*_):
        raise OSError(25, "Inappropriate ioctl for device")

    monkeypatch.setattr(live.fcntl, "ioctl", refuse)
    assert live.listener(pipe_fds[1], "s16le", RATE) == {}


def test_of_a_socket_nothing_is_known():
    a, b = socket.socketpair()
    with a, b:
        assert live.listener(a.fileno(), "s16le", RATE) == {}


@pytest.mark.serial  # the socket's first pushes need the generator faster than real time
@pytest.mark.parametrize("target", ["file", "pipe", "socket"])
def test_pipe_pushes_as_its_stdout_is_heard(
    tiny_runtime, slow_decoder, pipe_fds, monkeypatch, tmp_path, target
):
    """The tiny model's generator, faster than real time: a file's frames go four a push after
    the first; a pipe whose reader is behind (half a second unread, and it reads nothing more)
    gets a second push of more than a frame; a socket's reader may be hearing it as it comes,
    with little left to hear at first, so its first frames go alone."""
    runtime = tiny_runtime("custom_voice")
    pushes = slow_decoder(runtime, 0.0)
    text = tmp_path / "text.txt"
    text.write_text(TEXT + "\n")
    with contextlib.ExitStack() as stack:
        if target == "file":
            out = stack.enter_context(open(tmp_path / "out.pcm", "wb"))
        elif target == "pipe":
            write = pipe_fds[1]  # never read: its 64 KB hold all of it
            out = stack.enter_context(os.fdopen(write, "wb", closefd=False))
            os.write(write, bytes(2 * RATE // 2))  # a reader half a second behind already
        else:
            a, _reader = (stack.enter_context(s) for s in socket.socketpair())
            out = stack.enter_context(a.makefile("wb"))
        monkeypatch.setattr(sys, "stdin", stack.enter_context(open(text, "rb")))
        monkeypatch.setattr(sys, "stdout", out)
        session = dict(voice="ryan", seed=5, max_frames=8, text_streaming=True)
        assert trio.run(lambda: live.pipe(runtime, "s16le", **session)) == 0
    assert sum(pushes) == 8
    if target == "file":
        assert pushes == held_pushes(8)
    elif target == "pipe":
        assert pushes[0] == 1 and pushes[1] > 1
    else:
        assert pushes[:2] == [1, 1]
