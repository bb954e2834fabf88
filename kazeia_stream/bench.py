"""`kazeia-stream bench`: time to first audio, real-time factor and per-stage cost per frame.

Generates exactly N frames (EOS ignored) for a fixed sentence, pushing the decoder one frame at
a time as a live stream would, and reports figures a user can compare across machines and types.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from typing import Any

import numpy as np

from .engine.frames import GenerationOptions
from .model.model import VoiceArg
from .runtime import Runtime

BENCH_TEXT = (
    "Streaming speech starts before the sentence is finished, so a listener hears the "
    "first words while the rest is still being written."
)


def peak_rss_mb() -> float:
    """Peak resident memory of this process (Linux reports kilobytes, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024 if sys.platform == "darwin" else 1024)


def _figures(
    frames: int,
    audio_s: float,
    ttfa: float,
    wall: float,
    talker_s: float,
    talker_steps: int,
    cp_s: float,
    decoder_s: float,
) -> dict[str, Any]:
    n = max(frames, 1)
    return {
        "frames": frames,
        "audio_s": round(audio_s, 3),
        "ttfa_s": round(ttfa, 3),
        "wall_s": round(wall, 3),
        "rtf": round(wall / audio_s, 3),
        "ms_per_frame": {
            "talker": round(1000 * talker_s / max(talker_steps, 1), 1),
            "code_predictor": round(1000 * cp_s / n, 1),
            "decoder": round(1000 * decoder_s / n, 1),
        },
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }


def median(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over repeated runs (peak memory: the largest); shared machines
    move single runs by tens of percent."""

    def combine(key: str, values: list[Any]) -> Any:
        if isinstance(values[0], dict):
            return {k: combine(k, [v[k] for v in values]) for k in values[0]}
        return max(values) if key == "peak_rss_mb" else statistics.median(values)

    return {k: combine(k, [r[k] for r in results]) for k in results[0]}


async def run_pipeline_bench(
    runtime: Runtime, frames: int, repeat: int = 1, voice: VoiceArg = None, seed: int = 0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The same figures measured through the actor pipeline (decoder overlapping the
    generator), for `repeat` utterances in one session, plus each one's per-frame trace.
    `voice` defaults to the model's first built-in speaker."""
    results, traces = [], []
    voice = voice or runtime.model.default_voice
    async with runtime.open(voice=voice, seed=seed, max_frames=frames, ignore_eos=True) as tts:
        for _ in range(repeat):
            utterance = tts.speak(BENCH_TEXT)
            async for _chunk in utterance:
                pass
            m = utterance.metrics
            assert m.ttfa_s is not None and m.wall_s is not None
            results.append(
                _figures(
                    m.frames,
                    m.audio_s,
                    m.ttfa_s,
                    m.wall_s,
                    m.talker_s,
                    m.talker_steps,
                    m.code_predictor_s,
                    m.decoder.busy,
                )
            )
            t0 = m.started
            traces.append(
                {
                    "generator": [(i, round(a - t0, 4), round(b - t0, 4)) for i, a, b in m.generator.spans],
                    "decoder": [(i, round(a - t0, 4), round(b - t0, 4)) for i, a, b in m.decoder.spans],
                    "overlap_s": round(m.overlap_s, 3),
                    "prefill_s": round(m.prefill_s, 3),
                }
            )
    return results, traces


def run_bench(runtime: Runtime, frames: int, voice: VoiceArg = None, seed: int = 0) -> dict[str, Any]:
    """Run one utterance of `frames` frames and return the benchmark's figures."""
    model = runtime.model
    voice = voice or model.default_voice
    runtime.prepare(runtime.probe(voice, "auto", None), voice)  # as a session does
    t_start = time.perf_counter()
    prompt = model.prompt(BENCH_TEXT, voice=voice, text_streaming=True)
    options = GenerationOptions(seed=seed, max_frames=frames, ignore_eos=True)
    state = runtime.frames.start(prompt, model.text_feed(prompt), options, np.random.default_rng(seed))
    decoder = runtime.decoder_state(voice)
    ttfa = decoder_s = 0.0
    samples = 0
    while (codes := runtime.frames.next_frame(state)) is not None:
        t0 = time.perf_counter()
        samples += len(runtime.codec.push(decoder, codes[None]))
        decoder_s += time.perf_counter() - t0
        if not ttfa:
            ttfa = time.perf_counter() - t_start
    wall = time.perf_counter() - t_start
    t = state.times
    return _figures(
        t.frames,
        samples / model.sample_rate,
        ttfa,
        wall,
        t.talker,
        t.talker_steps,
        t.code_predictor,
        decoder_s,
    )
