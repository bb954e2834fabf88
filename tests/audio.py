"""Real audio in tests on machines without a sound card: a PulseAudio null sink and a recorder.

`start_pulse()` runs a private PulseAudio daemon (runtime dir and HOME in a temp dir) with a null
sink at 24 kHz, which consumes audio at real-time speed; ALSA's default device is routed to it
through `~/.asoundrc` in that HOME, so PortAudio (ALSA host API) plays into it. `Recorder` runs
`parec` on the sink's monitor and timestamps what arrives, so that a sample index can be mapped
to the wall-clock time it was played.

An idle null sink behaves unlike a sound card: its monitor delivers nothing, and a new stream
waits for the sink's idle block (up to ~2 s) before its audio is consumed. `start_pulse` therefore
keeps the sink busy with a low-latency stream of zeros (`pacat < /dev/zero`), like a card that is
always clocking: the recording is continuous and playback starts within the device latency.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SAMPLE_RATE = 24000
PULSE_PACKAGES = "pulseaudio pulseaudio-utils libasound2-plugins libportaudio2"
# Variables that decide which sound server and ALSA configuration a process uses.
ENV_KEYS = ("HOME", "XDG_RUNTIME_DIR", "PULSE_SERVER")


@dataclass
class PulseServer:
    """A running private PulseAudio daemon; `env` holds the variables that select it."""

    root: Path
    env: dict[str, str]
    sample_rate: int = SAMPLE_RATE
    sink: str = "nullsink"
    keepalive: subprocess.Popen[bytes] | None = None

    @property
    def monitor(self) -> str:
        return f"{self.sink}.monitor"

    def subprocess_env(self) -> dict[str, str]:
        """os.environ with this server selected: for child processes."""
        return {**os.environ, **self.env}

    def record(self) -> Recorder:
        return Recorder(self.monitor, self.sample_rate, self.subprocess_env())


def missing_tools() -> list[str]:
    return [t for t in ("pulseaudio", "parec", "pacat", "pactl") if shutil.which(t) is None]


def start_pulse(root: Path, sample_rate: int = SAMPLE_RATE, timeout: float = 10.0) -> PulseServer:
    """Start PulseAudio with a null sink in `root` (works as root too; it only warns)."""
    home, runtime = root / "home", root / "run"
    home.mkdir(parents=True, exist_ok=True)
    runtime.mkdir(parents=True, exist_ok=True)
    runtime.chmod(0o700)
    (home / ".asoundrc").write_text("pcm.!default pulse\nctl.!default pulse\n")
    env = {
        "HOME": str(home),
        "XDG_RUNTIME_DIR": str(runtime),
        "PULSE_SERVER": f"unix:{runtime / 'pulse' / 'native'}",
    }
    server = PulseServer(root, env, sample_rate)
    subprocess.run(
        [
            "pulseaudio",
            "--daemonize=yes",
            "--exit-idle-time=-1",
            "--disallow-exit",
            "-n",
            f"--load=module-null-sink sink_name={server.sink} rate={sample_rate}",
            "--load=module-native-protocol-unix",
        ],
        env=server.subprocess_env(),
        check=True,
        capture_output=True,
        timeout=timeout,
    )
    deadline = time.monotonic() + timeout
    while True:  # --daemonize returns once started, but make sure the socket answers
        r = subprocess.run(
            ["pactl", "info"],
            env=server.subprocess_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if r.returncode == 0 and server.sink in r.stdout:
            break
        if time.monotonic() > deadline:
            stop_pulse(server)
            raise RuntimeError(f"PulseAudio did not come up: {r.stderr.strip()}")
        time.sleep(0.05)
    with open("/dev/zero", "rb") as zeros:
        server.keepalive = subprocess.Popen(
            [
                "pacat",
                "--playback",
                "--raw",
                "-d",
                server.sink,
                "--format=s16le",
                f"--rate={sample_rate}",
                "--channels=1",
                "--latency-msec=20",
            ],
            stdin=zeros,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=server.subprocess_env(),
        )
    with server.record() as rec:  # the first stream waits out the idle block: once, here
        rec.wait_for(0.2, timeout=timeout)
    return server


def stop_pulse(server: PulseServer) -> None:
    """Stop the daemon started by `start_pulse` (by its pid file, never by name)."""
    if server.keepalive is not None:
        server.keepalive.terminate()
        server.keepalive.wait(timeout=5)
    pid_file = Path(server.env["XDG_RUNTIME_DIR"]) / "pulse" / "pid"
    subprocess.run(
        ["pulseaudio", "-k"], env=server.subprocess_env(), capture_output=True, timeout=10, check=False
    )
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


def reinit_portaudio() -> None:
    """Make PortAudio re-read the ALSA configuration and devices (it does so at Pa_Initialize;
    sounddevice initialises it at import time). Call after changing HOME / PULSE_SERVER."""
    import sounddevice as sd

    sd._terminate()
    sd._initialize()


@dataclass
class Recorder:
    """`parec` on a monitor source, float32 mono; each chunk is stamped with its arrival time."""

    source: str
    sample_rate: int
    env: dict[str, str]
    _chunks: list[np.ndarray] = field(default_factory=list)
    _ends: list[int] = field(default_factory=list)  # sample count after each chunk
    _times: list[float] = field(default_factory=list)  # time.monotonic() at its arrival
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _proc: subprocess.Popen[bytes] | None = None
    _thread: threading.Thread | None = None

    def start(self, settle_s: float = 0.25) -> Recorder:
        """Start `parec` and wait for `settle_s` of audio: the first chunk can hold a burst of
        the monitor's backlog, whose samples `wall_time` would misplace."""
        self._proc = subprocess.Popen(
            [
                "parec",
                "-d",
                self.source,
                "--raw",
                "--format=float32le",
                f"--rate={self.sample_rate}",
                "--channels=1",
                "--latency-msec=10",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=self.env,
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        if settle_s > 0:
            self.wait_for(settle_s)
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        pending = b""
        total = 0
        while True:
            data = self._proc.stdout.read1(1 << 16)
            if not data:
                return
            now = time.monotonic()
            data, pending = pending + data, b""
            cut = len(data) - len(data) % 4
            data, pending = data[:cut], data[cut:]
            if not data:
                continue
            chunk = np.frombuffer(data, dtype=np.float32)
            total += chunk.size
            with self._lock:
                self._chunks.append(chunk)
                self._ends.append(total)
                self._times.append(now)

    def stop(self) -> np.ndarray:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._proc is not None and self._proc.stdout is not None:
            self._proc.stdout.close()
        return self.samples()

    def __enter__(self) -> Recorder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def samples(self) -> np.ndarray:
        with self._lock:
            return np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)

    def wall_time(self, index: int) -> float:
        """time.monotonic() at which sample `index` reached the monitor (about when it played)."""
        with self._lock:
            ends, times = np.asarray(self._ends), list(self._times)
        k = min(int(np.searchsorted(ends, index, side="right")), len(ends) - 1)
        return times[k] - (ends[k] - index) / self.sample_rate

    def wait_for(self, seconds: float, timeout: float = 5.0) -> None:
        """Wait until at least `seconds` of audio have been recorded."""
        deadline = time.monotonic() + timeout
        while (self._ends[-1] if self._ends else 0) < seconds * self.sample_rate:
            if time.monotonic() > deadline:
                raise TimeoutError(f"recorded less than {seconds} s in {timeout} s")
            time.sleep(0.01)


# -- signals and comparisons ---------------------------------------------------------------


def chirp_signal(seconds: float = 2.0, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """A chirp (220 -> 1760 Hz) under a slow, uneven envelope, with short fades: it correlates
    with itself at one lag only, and a wrong gain or a dropped stretch shows."""
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    f0, f1 = 220.0, 1760.0
    phase = 2 * np.pi * (f0 * t + (f1 - f0) * t**2 / (2 * seconds))
    env = 0.35 + 0.15 * np.sin(2 * np.pi * 0.9 * t) + 0.05 * np.sin(2 * np.pi * 3.1 * t)
    fade = np.minimum(1.0, np.minimum(t, t[-1] - t) / 0.01)
    return (env * fade * np.sin(phase)).astype(np.float32)


def tone(seconds: float, freq: float = 440.0, amp: float = 0.5, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def align(sent: np.ndarray, recorded: np.ndarray) -> tuple[int, np.ndarray]:
    """Offset of `sent` inside `recorded` (FFT cross-correlation) and the aligned stretch
    (zero-padded where the recording ends early)."""
    n = len(sent) + len(recorded)
    size = 1 << (n - 1).bit_length()
    xc = np.fft.irfft(np.fft.rfft(recorded, size) * np.conj(np.fft.rfft(sent, size)), size)
    offset = int(np.argmax(xc[: len(recorded)])) if len(recorded) else 0
    seg = recorded[offset : offset + len(sent)]
    return offset, np.pad(seg, (0, len(sent) - len(seg)))


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def gain(sent: np.ndarray, received: np.ndarray) -> float:
    """Least-squares gain of `received` relative to `sent`."""
    s = sent.astype(np.float64)
    return float(np.dot(s, received) / np.dot(s, s))


def active_spans(
    x: np.ndarray, threshold: float = 0.01, min_gap_s: float = 0.05, sample_rate: int = SAMPLE_RATE
) -> list[tuple[int, int]]:
    """[start, end) sample ranges where |x| exceeds `threshold`, merging gaps < `min_gap_s`
    (a sine crosses zero twice a period)."""
    idx = np.flatnonzero(np.abs(x) > threshold)
    if idx.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(idx) > min_gap_s * sample_rate)
    starts = np.concatenate([[idx[0]], idx[breaks + 1]])
    ends = np.concatenate([idx[breaks], [idx[-1]]]) + 1
    return [(int(a), int(b)) for a, b in zip(starts, ends, strict=True)]
