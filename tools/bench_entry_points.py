#!/usr/bin/env python3
"""Time the command line from process start, as a user runs it: `--pipe` (first PCM byte and
the whole run) and `-o FILE` (the whole run), for the same text and seed, `--repeat` times
each, interleaved; and the library's `Runtime.synthesize` against a session's utterance of the
same text and seed, in one process, after a warm-up (`api`). With `--busy`, the same again
beside one other process spinning on one core. Prints one JSON line: the medians (s), each
one's audio length, `--pipe`'s real-time factor after its first byte (to compare with `bench
--pipeline`'s RTF, which counts from the text), `-o`'s from process start, `synthesize`'s wall
time over the session's, and with --busy each time's ratio to the quiet run.

    python tools/bench_entry_points.py --model M --repeat 3 --busy
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import soundfile as sf

TEXT = "The quick brown fox jumps over the lazy dog, and then it rests."


def _spin() -> None:
    while True:
        pass


def pipe(model: str, seed: int) -> tuple[float, float, int]:
    """(first byte, whole run, samples) of `kazeia-stream --pipe` (s16le), from process start."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kazeia_stream", "--pipe", "--model", model, "--seed", str(seed)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(TEXT.encode() + b"\n")
    proc.stdin.close()
    if not proc.stdout.read(1):
        raise SystemExit("--pipe wrote nothing")
    first = time.perf_counter() - start
    rest = proc.stdout.read()
    if proc.wait():
        raise SystemExit(f"--pipe exited with {proc.returncode}")
    return first, time.perf_counter() - start, (1 + len(rest)) // 2


def output(model: str, seed: int, path: Path) -> tuple[float, float, int]:
    """(whole run, audio seconds, sample rate) of `kazeia-stream -o FILE`, from process start."""
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "kazeia_stream", "--model", model, "--seed", str(seed), "-o", str(path), TEXT],
        check=True,
        stderr=subprocess.DEVNULL,
    )
    wall, info = time.perf_counter() - start, sf.info(str(path))
    return wall, info.duration, info.samplerate


def api(model: str, repeat: int, seed: int) -> tuple[list[float], list[float]]:
    """Wall times (s) of `Runtime.synthesize` and of a session's utterance, the same text and
    seed (the same audio), `repeat` times each, interleaved, after one of each to warm up."""
    import trio

    import kazeia_stream

    runtime = kazeia_stream.Runtime(kazeia_stream.load_model(model))

    def synthesize() -> float:
        start = time.perf_counter()
        runtime.synthesize(TEXT, seed=seed, text_streaming=True)
        return time.perf_counter() - start

    async def session() -> float:
        async with runtime.open(seed=seed) as tts:
            start = time.perf_counter()
            async for _chunk in tts.speak(TEXT):
                pass
            return time.perf_counter() - start

    times: tuple[list[float], list[float]] = ([], [])
    for i in range(repeat + 1):
        synthesized, spoken = synthesize(), trio.run(session)
        if i:  # the first of each warms up
            times[0].append(synthesized)
            times[1].append(spoken)
    return times


def measure(model: str, repeat: int, seed: int) -> dict[str, float]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # its own process, its memory gone after
        synthesized, spoken = pool.apply(api, (model, repeat, seed))
    firsts, pipes, piped_s, outs, out_s = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeat):
            first, whole, samples = pipe(model, seed)
            wall, seconds, rate = output(model, seed, Path(tmp) / "out.wav")
            firsts.append(first)
            pipes.append(whole)
            piped_s.append(samples / rate)
            outs.append(wall)
            out_s.append(seconds)
    first, piped, out = map(statistics.median, (firsts, pipes, outs))
    pipe_rtfs = [(p - f) / a for p, f, a in zip(pipes, firsts, piped_s)]
    return {
        "pipe_first_byte_s": round(first, 3),
        "pipe_wall_s": round(piped, 3),
        "output_wall_s": round(out, 3),
        "output_over_pipe": round(out / piped, 3),
        "pipe_audio_s": round(statistics.median(piped_s), 3),
        "output_audio_s": round(statistics.median(out_s), 3),
        "pipe_rtf_after_first_byte": round(statistics.median(pipe_rtfs), 3),
        "output_rtf": round(statistics.median(w / a for w, a in zip(outs, out_s)), 3),
        "synthesize_wall_s": round(statistics.median(synthesized), 3),
        "session_wall_s": round(statistics.median(spoken), 3),
        "synthesize_over_session": round(statistics.median(s / t for s, t in zip(synthesized, spoken)), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--busy", action="store_true", help="also measure beside one spinning process")
    args = ap.parse_args()
    result: dict[str, object] = {"quiet": measure(args.model, args.repeat, args.seed)}
    if args.busy:
        spinner = multiprocessing.Process(target=_spin, daemon=True)
        spinner.start()
        try:
            busy = measure(args.model, args.repeat, args.seed)
        finally:
            spinner.terminate()
        quiet = result["quiet"]
        assert isinstance(quiet, dict)
        result["busy"] = busy
        keys = ("pipe_first_byte_s", "pipe_wall_s", "output_wall_s", "synthesize_wall_s")
        result["busy_over_quiet"] = {key: round(busy[key] / quiet[key], 2) for key in keys}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
