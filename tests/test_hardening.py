"""Every bad input through the real command: its exit code, one line on stderr naming the problem,
no traceback, no file written or replaced but the one asked for, the audio so far delivered."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from processes import FAULTHANDLER, signalled
from test_model import one_layer_more, unknown_tokenizer

pytestmark = pytest.mark.subprocess

LONG = "A long line that would take a while to speak entirely, again and again. " * 20
WAV_HEADER = 44  # bytes before the samples of a 16-bit WAV


@pytest.fixture(scope="module")
def model(tiny_gguf) -> str:
    return str(tiny_gguf("custom_voice")[0])


def run(*args: str | bytes, **kw) -> tuple[int, str, bytes]:
    r = subprocess.run([sys.executable, "-m", "kazeia_stream", *args], capture_output=True, timeout=300, **kw)
    return r.returncode, r.stderr.decode(errors="replace").strip(), r.stdout


def one_line(err: str, *words: str) -> bool:
    return len(err.splitlines()) == 1 and "Traceback" not in err and all(w in err for w in words)


def pair(tmp_path: Path, talker: Path, mmproj: Path) -> str:
    folder = tmp_path / "pair"
    folder.mkdir()
    shutil.copy(talker, folder / talker.name)
    shutil.copy(mmproj, folder / mmproj.name)
    return str(folder)


@pytest.mark.parametrize(
    "args, words",
    [
        (["   "], ["the text is empty"]),
        ([b"caf\xff"], ["not valid UTF-8"]),
        (["Hi.", "--voice", "nobody"], ["unknown voice 'nobody'"]),
        (["Hi.", "--language", "klingon"], ["unknown language 'klingon'"]),
        (["Hi.", "--seed", "-1"], ["--seed", "at least 0"]),
        (["Hi.", "--threads", "0"], ["--threads", "at least 1"]),
    ],
)
def test_bad_input_fails_in_one_line_and_leaves_the_target_as_it_was(model, tmp_path, args, words):
    out = tmp_path / "out.wav"
    out.write_bytes(b"an older file")
    rc, err, _ = run(*args, "-o", str(out), "--model", model)
    assert rc != 0 and one_line(err.splitlines()[-1], *words), err
    assert "Traceback" not in err
    assert out.read_bytes() == b"an older file" and sorted(os.listdir(tmp_path)) == ["out.wav"]


def test_bad_model_files_fail_in_one_line(tiny_gguf, tmp_path):
    talker, mmproj = tiny_gguf("custom_voice")
    _, other_mmproj = tiny_gguf("custom_voice", seed=11)
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    shutil.copy(talker, truncated / talker.name)
    with open(truncated / mmproj.name, "wb") as f:
        f.write(mmproj.read_bytes()[: mmproj.stat().st_size // 2])
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    shutil.copy(mmproj, wrong / "talker.gguf")
    shutil.copy(mmproj, wrong / mmproj.name)
    cases = {
        str(tmp_path / "nothing"): "no such file or folder",
        str(truncated): "truncated",
        str(wrong): "not a Qwen3-TTS talker",
    }
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(talker, mixed / talker.name)
    shutil.copy(other_mmproj, mixed / other_mmproj.name)
    cases[str(mixed)] = "converted from different checkpoints"
    for path, words in cases.items():
        rc, err, _ = run("Hi.", "-o", str(tmp_path / "x.wav"), "--model", path)
        assert rc == 1 and one_line(err, words), (path, err)
    assert not (tmp_path / "x.wav").exists()


def test_a_published_pair_of_other_sizes_is_refused(tiny_gguf, tmp_path):
    talker, _ = tiny_gguf("custom_voice")
    _, mmproj = tiny_gguf("voice_design")  # code predictor for a talker of width 96, not 64
    rc, err, _ = run("Hi.", "-o", str(tmp_path / "x.wav"), "--model", pair(tmp_path, talker, mmproj))
    assert rc == 1 and one_line(err, "are not a pair"), err


@pytest.mark.parametrize("target", ["folder", "device", "link-to-stdout", "no-folder", "raw"])
def test_only_a_regular_file_is_written(model, tmp_path, target):
    path = {
        "folder": tmp_path,
        "device": Path("/dev/null"),
        "link-to-stdout": tmp_path / "link.wav",
        "no-folder": tmp_path / "missing" / "x.wav",
        "raw": tmp_path / "x.raw",
    }[target]
    if target == "link-to-stdout":
        path.symlink_to("/proc/self/fd/1")  # stdout is a pipe here
    start = time.perf_counter()
    rc, err, _ = run(LONG, "-o", str(path), "--model", model)
    assert rc == 1 and one_line(err, str(path)), err
    assert time.perf_counter() - start < 30  # found before the speech is generated
    assert Path("/dev/null").is_char_device()
    assert os.listdir(tmp_path) == (["link.wav"] if target == "link-to-stdout" else [])


def test_a_symlink_target_writes_the_file_it_points_to(model, tmp_path):
    real = tmp_path / "real.wav"
    real.write_bytes(b"old")
    link = tmp_path / "link.wav"
    link.symlink_to(real)
    rc, err, _ = run("Hi there.", "-o", str(link), "--model", model)
    assert rc == 0, err
    assert link.is_symlink() and sf.info(str(real)).frames > 0
    assert sorted(os.listdir(tmp_path)) == ["link.wav", "real.wav"]


def test_a_write_error_on_the_file_is_reported_and_replaces_nothing(model, tmp_path):
    out = tmp_path / "out.wav"
    out.write_bytes(b"an older file")

    def small_files() -> None:  # as a full disk: writes past 64 KiB fail (EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))

    rc, err, _ = run(LONG, "-o", str(out), "--model", model, preexec_fn=small_files)
    assert rc == 1 and one_line(err, "cannot write", str(out)), err
    assert out.read_bytes() == b"an older file" and os.listdir(tmp_path) == ["out.wav"]


def test_pipe_write_errors_are_reported_but_a_closed_reader_is_not(model):
    with open("/dev/full", "wb") as full:
        r = subprocess.run(
            [sys.executable, "-m", "kazeia_stream", "--pipe", "--model", model],
            input=b"Hello there.\n",
            stdout=full,
            stderr=subprocess.PIPE,
            timeout=300,
        )
    err = r.stderr.decode().strip()
    assert r.returncode == 1 and one_line(err, "cannot write to stdout", "No space left"), err


# a CLI process that prints each thread's stack on SIGABRT (Python's faulthandler)
DUMPING = {**os.environ, **FAULTHANDLER}


# how a shell without job control starts a background command: SIGINT ignored
SIGINT_IGNORED = ["sh", "-c", 'trap "" INT; exec "$@"', "sh"]


@pytest.mark.parametrize("started", [[], SIGINT_IGNORED], ids=["plain", "sigint_ignored"])
@pytest.mark.parametrize(
    "sig, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_a_signal_during_pipe_output_ends_it_in_one_line(model, started, sig, code, word):
    proc = subprocess.Popen(
        [*started, sys.executable, "-m", "kazeia_stream", "--pipe", "--model", model],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=DUMPING,
    )
    proc.stdin.write((LONG + "\n").encode())
    proc.stdin.flush()
    got = proc.stdout.read(1920 * 2)  # audio has started
    rc, rest, err = signalled(proc, sig)
    got += rest
    assert rc == code and one_line(err.decode().strip(), word), err
    assert len(got) >= 1920 * 2 and len(got) % 2 == 0


@pytest.mark.parametrize(
    "sig, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_a_signal_while_writing_a_file_keeps_the_audio_so_far(model, tmp_path, sig, code, word):
    out = tmp_path / "out.wav"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kazeia_stream", LONG, "-o", str(out), "--model", model],
        stderr=subprocess.PIPE,
        env=DUMPING,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until the temporary file holds some audio
        parts = [p for p in tmp_path.iterdir() if p.name.endswith(".part")]
        if parts and parts[0].stat().st_size > WAV_HEADER + 1920 * 2 * 5:
            break
        time.sleep(0.05)
    rc, _, err = signalled(proc, sig)
    assert rc == code and one_line(err.decode().strip(), word), err
    pcm, rate = sf.read(str(out), dtype="float32")
    assert rate == 24000 and len(pcm) >= 1920 * 5 and len(pcm) % 1920 == 0
    assert os.listdir(tmp_path) == ["out.wav"]


@pytest.mark.skipif(Path("/dev/snd").exists(), reason="this machine has a sound card")
def test_no_audio_device_is_one_line(model, tmp_path):
    # no sound server reachable (the tests' private one lives under another runtime folder)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path)}
    rc, err, _ = run("Hi there.", "--model", model, env=env)
    assert rc == 1 and one_line(err, "no audio output device"), err


@pytest.mark.parametrize(
    "args, words",
    [
        (["bench", "--frames", "0"], ["--frames", "at least 1"]),
        (["bench", "--repeat", "-3"], ["--repeat", "at least 1"]),
        (["dump", "--text", "Hi.", "--codes", "/nonexistent.npy", "--out", "x.npz"], ["not a .npy file"]),
    ],
)
def test_bad_subcommand_options_fail_in_one_line(model, tmp_path, args, words):
    rc, err, _ = run(*args, "--model", model, cwd=tmp_path)
    assert rc != 0 and one_line(err.splitlines()[-1], *words) and "Traceback" not in err, err
    assert os.listdir(tmp_path) == []


def test_dump_refuses_codes_out_of_range(model, tmp_path):
    codes = tmp_path / "codes.npy"
    np.save(codes, np.full((3, 16), 5000))
    rc, err, _ = run(
        "dump", "--text", "Hi.", "--codes", str(codes), "--out", str(tmp_path / "d.npz"), "--model", model
    )
    assert rc == 1 and one_line(err, "between 0 and 2047"), err


def test_convert_onto_a_file_fails_in_one_line(tiny_checkpoint, tmp_path):
    target = tmp_path / "taken"
    target.write_text("a file")
    rc, err, _ = run("convert", str(tiny_checkpoint("custom_voice")), str(target))
    assert rc == 1 and one_line(err, "not a folder"), err
    assert target.read_text() == "a file"


def test_a_talker_missing_tensors_is_one_line(tiny_gguf, tmp_path):
    talker, mmproj = tiny_gguf("custom_voice")
    folder = pair(tmp_path, talker, mmproj)
    one_layer_more(Path(folder) / talker.name)
    rc, err, _ = run("voices", "--model", folder)
    assert rc == 1 and one_line(err, "talker tensor 'blk.2.attn_norm.weight' is missing"), err


def test_a_vocabulary_libllama_refuses_is_one_line_and_v_gives_its_reason(tiny_gguf, tmp_path):
    """-v passes llama.cpp's errors on (its log filtered in C, model/llama_log.c), not its
    debug lines."""
    talker, mmproj = tiny_gguf("custom_voice")
    folder = pair(tmp_path, talker, mmproj)
    unknown_tokenizer(Path(folder) / talker.name)
    rc, err, _ = run("voices", "--model", folder)
    assert rc == 1 and one_line(err, "libllama could not load it"), err
    rc, err, _ = run("voices", "--model", folder, "-v")
    assert rc == 1 and "unknown tokenizer: 'zzzz'" in err and "libllama could not load it" in err, err
    assert "Traceback" not in err and "llama_model_loader: - kv" not in err, err  # INFO: -vv


def test_a_folder_that_cannot_be_written_is_one_line(model, tmp_path):
    folder = tmp_path / "locked"
    folder.mkdir()
    if os.geteuid() == 0:  # root writes anywhere but into an immutable folder
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not available here")
    else:
        folder.chmod(0o555)
    try:
        rc, err, _ = run("Hi there.", "-o", str(folder / "x.wav"), "--model", model)
    finally:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
        folder.chmod(0o755)
    assert rc == 1 and one_line(err, "cannot be written"), err
    assert os.listdir(folder) == []


@pytest.mark.subprocess
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_process_exits_is_ignored(tmp_path, sig):
    """Once the command is done, the interpreter waits for threads that are still finishing (a
    server's workers): a signal then changes nothing (it printed a KeyboardInterrupt traceback
    after a Wyoming server had stopped)."""
    script = (
        "import sys, threading, time\n"
        "from kazeia_stream.cli import main\n"
        "threading.Thread(target=time.sleep, args=(3,)).start()  # the exit waits for it\n"
        f"sys.exit(main(['convert', {str(tmp_path / 'none')!r}, {str(tmp_path / 'out')!r}]))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()  # the command's error: main has returned
    assert line.startswith("kazeia-stream: error: ") and "not a checkpoint directory" in line, line
    time.sleep(0.2)
    proc.send_signal(sig)
    rest = proc.stderr.read()
    assert proc.wait(timeout=30) == 1 and rest == "", rest
