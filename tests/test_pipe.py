"""`kazeia-stream --pipe` as a real subprocess: text lines in, raw PCM out, nothing else."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from kazeia_stream.pcm import pcm_bytes

pytestmark = [pytest.mark.subprocess]

LINES = ["Hello there, this is the first line.", "And a second one!"]


@pytest.fixture(scope="module")
def model_path(tiny_gguf) -> str:
    return str(tiny_gguf("custom_voice")[0])


@pytest.fixture(scope="module")
def expected(tiny_runtime) -> list[np.ndarray]:
    runtime = tiny_runtime("custom_voice")
    return [runtime.synthesize(line, voice="ryan", seed=9, text_streaming=True)[0] for line in LINES]


def same_pcm(data: bytes, expected: list[np.ndarray], fmt: str) -> bool:
    """Exactly the bytes of the expected audio, whatever the timing."""
    return data == b"".join(pcm_bytes(a, fmt) for a in expected)


def pipe(model_path: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kazeia_stream",
        "--pipe",
        "--model",
        model_path,
        "--voice",
        "ryan",
        "--seed",
        "9",
        *extra,
    ]


def closing(fd: int, command: list[str]) -> list[str]:
    """`command` run with descriptor `fd` closed, as a shell's `<&-`, `>&-` or `2>&-` does."""
    return ["sh", "-c", f'exec "$@" {fd}>&-', "sh", *command]


@pytest.mark.parametrize("fmt", ["s16le", "f32le"])
def test_lines_in_pcm_out(model_path, expected, fmt):
    stdin = ("\n".join(LINES) + "\n\n").encode()
    r = subprocess.run(pipe(model_path, "--format", fmt), input=stdin, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    assert same_pcm(r.stdout, expected, fmt)
    assert r.stderr == b""


def test_invalid_utf8_is_reported_and_skipped_and_the_exit_status_says_so(model_path, expected):
    stdin = LINES[0].encode() + b"\n\xff\xfe\n" + LINES[1].encode()  # no final newline either
    r = subprocess.run(pipe(model_path), input=stdin, capture_output=True, timeout=300)
    assert r.returncode == 1, r.stderr.decode()
    assert same_pcm(r.stdout, expected, "s16le")  # every valid line is spoken all the same
    assert b"invalid UTF-8" in r.stderr and len(r.stderr.splitlines()) == 1


def test_a_reader_that_closes_early_ends_it_quietly(model_path):
    proc = subprocess.Popen(
        pipe(model_path), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdin.write(("A long line that would take a while to speak entirely. " * 4 + "\n").encode())
    proc.stdin.flush()
    first = proc.stdout.read(1920 * 2)
    proc.stdout.close()
    start = time.perf_counter()
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    assert len(first) == 1920 * 2
    assert proc.stderr.read() == b""
    assert time.perf_counter() - start < 30


def test_pcm_is_flushed_per_chunk_while_the_text_is_still_being_written(model_path):
    proc = subprocess.Popen(
        pipe(model_path), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdin.write(b"Hello there, the line is not finished yet and")
    proc.stdin.flush()
    first = proc.stdout.read(1920 * 2)  # audio arrives before the newline
    assert len(first) == 1920 * 2
    proc.stdin.write(b" now it is.\n")
    proc.stdin.close()
    rest = proc.stdout.read()
    assert proc.wait(timeout=60) == 0
    assert (len(first) + len(rest)) % (1920 * 2) == 0


def test_a_carriage_return_ends_a_line(model_path, expected):
    stdin = (LINES[0] + "\r" + LINES[1] + "\r\n").encode()
    r = subprocess.run(pipe(model_path), input=stdin, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    assert same_pcm(r.stdout, expected, "s16le") and r.stderr == b""


def test_the_same_seed_gives_the_same_bytes_on_a_loaded_machine(model_path, expected):
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        stdin = ("\n".join(LINES) + "\n").encode()
        r = subprocess.run(
            pipe(model_path, "--format", "f32le"), input=stdin, capture_output=True, timeout=300
        )
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    assert r.returncode == 0, r.stderr.decode()
    assert same_pcm(r.stdout, expected, "f32le")


def test_a_regular_file_gets_the_same_bytes(model_path, expected, tmp_path):
    """Into a file the decoder pushes four frames at a time (`live.listener`): the same PCM."""
    out = tmp_path / "out.s16"
    stdin = ("\n".join(LINES) + "\n").encode()
    with open(out, "wb") as f:
        r = subprocess.run(pipe(model_path), input=stdin, stdout=f, stderr=subprocess.PIPE, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    assert same_pcm(out.read_bytes(), expected, "s16le") and r.stderr == b""


@pytest.mark.parametrize(
    "fd, message",
    [(0, b"--pipe reads the text from stdin, which is closed"), (1, b"cannot write to stdout: it is closed")],
)
def test_a_closed_stdin_or_stdout_is_a_one_line_error(model_path, fd, message):
    r = subprocess.run(closing(fd, pipe(model_path)), stderr=subprocess.PIPE, timeout=300)
    assert r.returncode == 1
    assert r.stderr == b"kazeia-stream: error: " + message + b"\n"


def test_with_stderr_closed_the_refusals_go_nowhere_and_the_pcm_is_untouched(model_path, expected):
    """A closed stderr: our messages must not fall back to stdout (print's None file) nor
    the next file opened take fd 2."""
    stdin = LINES[0].encode() + b"\n\xff\xfe\n" + LINES[1].encode() + b"\n"
    r = subprocess.run(closing(2, pipe(model_path)), input=stdin, stdout=subprocess.PIPE, timeout=300)
    assert r.returncode == 1  # a line had invalid UTF-8, as with a stderr
    assert same_pcm(r.stdout, expected, "s16le")
