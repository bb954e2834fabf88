"""Shared fixtures: tiny random checkpoints and their GGUF conversions, built once per session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAKE_CHECKPOINT = ROOT / "tools" / "make_random_checkpoint.py"
# The seeds tools/make_references.py built its tiny checkpoints from (tests/data/refs/*.npz).
TINY_SEEDS = {"custom_voice": 1, "voice_design": 2, "base": 3}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_checkpoint(kind, seed=None)`: directory of a tiny random checkpoint in the
    official layout (kind: custom_voice, base or voice_design)."""
    cache: dict[tuple[str, int], Path] = {}

    def make(kind: str, seed: int | None = None) -> Path:
        seed = TINY_SEEDS[kind] if seed is None else seed
        if (kind, seed) not in cache:
            out = tmp_path_factory.mktemp("checkpoints") / f"tiny-{kind}-{seed}"
            subprocess.run(
                [
                    sys.executable,
                    str(MAKE_CHECKPOINT),
                    "--preset",
                    "tiny",
                    "--kind",
                    kind,
                    "--seed",
                    str(seed),
                    str(out),
                ],
                check=True,
                capture_output=True,
            )
            cache[kind, seed] = out
        return cache[kind, seed]

    return make


@pytest.fixture(scope="session")
def tiny_gguf(
    tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Callable[..., Path]
) -> Callable[..., tuple[Path, Path]]:
    """`tiny_gguf(kind, out_type="f32", seed=None, decoder="f32")`: (talker, mmproj) GGUF
    paths of the converted tiny checkpoint."""
    from kazeia_stream.model.convert import convert

    cache: dict[tuple[str, str, int, str], tuple[Path, Path]] = {}

    def make(
        kind: str, out_type: str = "f32", seed: int | None = None, decoder: str = "f32"
    ) -> tuple[Path, Path]:
        seed = TINY_SEEDS[kind] if seed is None else seed
        if (kind, out_type, seed, decoder) not in cache:
            cache[kind, out_type, seed, decoder] = convert(
                tiny_checkpoint(kind, seed), tmp_path_factory.mktemp("gguf"), out_type, decoder
            )
        return cache[kind, out_type, seed, decoder]

    return make


@pytest.fixture(scope="session")
def pulse_null_sink(tmp_path_factory: pytest.TempPathFactory):
    """A private PulseAudio daemon with a 24 kHz null sink, made ALSA's (hence PortAudio's)
    default output for this process and its children for the rest of the session; yields a
    `audio.PulseServer` (tests/audio.py; `.record()` gives a `Recorder` on the sink's monitor,
    `.subprocess_env()` the environment for child processes). Skips where PulseAudio or
    PortAudio is not installed (.ci/run installs them)."""
    import os

    from audio import PULSE_PACKAGES, missing_tools, reinit_portaudio, start_pulse, stop_pulse

    if missing := missing_tools():
        pytest.skip(f"{', '.join(missing)} not installed (apt-get install {PULSE_PACKAGES})")
    try:
        import sounddevice  # noqa: F401  (needs PortAudio)
    except OSError as e:
        pytest.skip(f"{e} (apt-get install {PULSE_PACKAGES})")
    # The daemon's socket lives under it: keep it short (unix socket paths < 108 bytes).
    root = tmp_path_factory.mktemp("pulse")
    server = start_pulse(root)
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        reinit_portaudio()  # PortAudio reads ALSA's config (~/.asoundrc) when initialised
        import sounddevice as sd

        names = [d["name"] for d in sd.query_devices() if d["max_output_channels"] > 0]
        if "default" not in names and "pulse" not in names:
            pytest.skip(
                f"ALSA does not see PulseAudio (outputs: {names}); apt-get install libasound2-plugins"
            )
        yield server
    finally:
        stop_pulse(server)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reinit_portaudio()


@pytest.fixture(scope="session")
def tiny_runtime(tiny_gguf: Callable[..., tuple[Path, Path]]):
    """`tiny_runtime(kind, out_type="f32")`: a `Runtime` (the engines) on the converted tiny
    model, shared by the tests of a session as an application shares one."""
    from kazeia_stream import Runtime, load_model

    cache: dict[tuple[str, str], Runtime] = {}

    def make(kind: str, out_type: str = "f32") -> Runtime:
        if (kind, out_type) not in cache:
            cache[kind, out_type] = Runtime(load_model(tiny_gguf(kind, out_type)[0]))
        return cache[kind, out_type]

    return make


@pytest.fixture(scope="session")
def capped_model(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Callable[..., Path]) -> Path:
    """The tiny CustomVoice model with `max_new_tokens` 4 in its generation config: at most 3
    frames per utterance, so that a page of text runs in seconds and every segment shows."""
    import json
    import shutil

    from kazeia_stream.model.convert import convert

    src = tiny_checkpoint("custom_voice")
    ckpt = tmp_path_factory.mktemp("capped") / "tiny-capped"
    shutil.copytree(src, ckpt)
    config = json.loads((ckpt / "generation_config.json").read_text())
    (ckpt / "generation_config.json").write_text(json.dumps({**config, "max_new_tokens": 4}))
    return convert(ckpt, tmp_path_factory.mktemp("gguf"), "f32")[0]


@pytest.fixture
def q8_kernel(monkeypatch: pytest.MonkeyPatch):
    """`q8_kernel(value)` sets `KAZEIA_Q8_KERNEL` for the engines made during the test ("0":
    Q8_0 products on ggml's kernels, as on a CPU without AVX2; "avx2": our AVX2 variant, as on a
    CPU without AVX512-VNNI); the default again after it."""
    from kazeia_stream.engine import q8_product

    def use(value: str) -> None:
        monkeypatch.setenv(q8_product.ENV, value)
        q8_product.KERNEL.chosen.cache_clear()

    yield use
    monkeypatch.delenv(q8_product.ENV, raising=False)
    q8_product.KERNEL.chosen.cache_clear()


@pytest.fixture
def slow_decoder(monkeypatch: pytest.MonkeyPatch):
    """`slow_decoder(runtime, delay)`: the runtime's decoder waits `delay` s before each push it
    is asked for, so that the generator runs ahead and frames queue up; returns the list of
    each push's frame count, filled as they come."""
    import trio

    def slow(runtime, delay: float) -> list[int]:
        pushes: list[int] = []
        decode = runtime.decoder.decode

        async def slowed(state, codes, first=False):
            pushes.append(len(codes))
            await trio.sleep(delay)
            return await decode(state, codes, first)

        monkeypatch.setattr(runtime.decoder, "decode", slowed)
        return pushes

    return slow


@pytest.fixture
def slow_generator(monkeypatch: pytest.MonkeyPatch):
    """`slow_generator(runtime, delay)`: the runtime's generator waits `delay` s before each
    frame (more than a frame's 80 ms: slower than real time, as on a slow machine; less:
    faster)."""
    import trio

    def slow(runtime, delay: float) -> None:
        next_frame = runtime.generator.next_frame

        async def slowed(state):
            await trio.sleep(delay)
            return await next_frame(state)

        monkeypatch.setattr(runtime.generator, "next_frame", slowed)

    return slow


@pytest.fixture
def engine_spans(monkeypatch: pytest.MonkeyPatch):
    """`engine_spans(runtime)`: from then on, (start, end) of each of the runtime's engine calls,
    per engine: "decoder" (`CodecDecoder.push_many`) and "generator" (`FrameLoop.next_frames`;
    a pass calls it again inside for streams that join it: only the outer call counts)."""
    import time

    def record(runtime) -> dict[str, list[tuple[float, float]]]:
        spans: dict[str, list[tuple[float, float]]] = {"decoder": [], "generator": []}
        depth = dict.fromkeys(spans, 0)

        def timed(name, fn):
            def run(*args, **kwargs):
                depth[name] += 1
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    depth[name] -= 1
                    if not depth[name]:
                        spans[name].append((start, time.perf_counter()))

            return run

        monkeypatch.setattr(runtime.codec, "push_many", timed("decoder", runtime.codec.push_many))
        monkeypatch.setattr(runtime.frames, "next_frames", timed("generator", runtime.frames.next_frames))
        return spans

    return record


def pytest_configure(config: pytest.Config) -> None:
    """The codec decoder's weight cache for every test and the processes it starts: a folder of
    the session's, never the user's (a decoder's later loads map what its first one saved). Set
    before the test modules import, as some copy the environment then."""
    os.environ["KAZEIA_CACHE"] = tempfile.mkdtemp(prefix="kazeia-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(os.environ.pop("KAZEIA_CACHE", ""), ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests on the real-time sound device are marked `realtime` (deselect with -m), and
    `serial`: they keep time, so they run alone, after the parallel run (README)."""
    for item in items:
        if "pulse_null_sink" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.realtime)
            item.add_marker(pytest.mark.serial)
