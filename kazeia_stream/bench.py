"""`kazeia-stream bench`: time to first audio, real-time factor and per-stage cost per frame.

Generates exactly N frames (EOS ignored) for a fixed sentence, pushing the decoder one frame at
a time (`--pipeline`: as a session pushes it for a listener who hears it as it comes), and
reports figures a user can compare across machines and types.
`--streams N` runs N such utterances at once on one runtime (`run_streams_bench`).

Each measured run is compared with a reference measured right after it, as a shared machine's
speed moves by tens of percent between two commands minutes apart: the floor (`floors`), and
with several streams one stream alone (`run_streams_bench`). The floor's measurement evicts
the caches (its bandwidth probe reads 256 MB a thread), so a throw-away utterance then
runs to its first audio, and the next measured one finds them as an utterance spoken right after
another does (without it, first audio took 0.39-0.43 s instead of 0.25-0.32 on a host with
260 MB of last-level cache). One runs before the first measured utterance too: a runtime loads
its codec decoder in the background from its making, and the first utterance waited for it
(Zen 3: first audio 0.58 s once the page cache was dropped, 1.55 s on a host that had evicted
the files, against 0.15-0.20 s for the runs after it). The time a process takes to its first
audio, load included, is `tools/bench_entry_points.py`'s to measure.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from typing import Any

import numpy as np
import trio
from gguf import GGMLQuantizationType as QType

from .bandwidth import read_gb_s
from .channels import UtteranceMetrics
from .engine import product_rate
from .engine.frames import GenerationOptions
from .engine.qwen3 import matrix_macs
from .engine.threads import available_cores
from .model import gguf_layout as L
from .model.model import VoiceArg
from .runtime import Runtime

BENCH_TEXT = (
    "Streaming speech starts before the sentence is finished, so a listener hears the "
    "first words while the rest is still being written."
)


def peak_rss_mb() -> float:
    """Peak resident memory of this process: Linux' VmHWM where there is one (its getrusage
    figure carries over the peak of the process that started this one, across exec: a bench
    started by a 1 GB process reported 1 GB), else getrusage's (macOS reports bytes)."""
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        return kib / 1024
    except (OSError, StopIteration):
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


def _talker_reads(runtime: Runtime) -> list[str]:
    """The talker's tensors a step reads: all but the text embedding, whose rows we feed."""
    return [n for n in runtime.model.talker_file.tensor_names if n != L.TALKER_TOKEN_EMBD]


def generator_macs(runtime: Runtime) -> dict[str, dict[QType, int]]:
    """The talker's and the code predictor's multiply-adds per frame, by weight type: the
    talker's matrices once per step (`_talker_reads`), the code predictor's once per pass and
    one pass per codebook, the first pass two rows."""
    f = runtime.model.talker_file
    cp = runtime.code_predictor
    return {
        "talker": matrix_macs((f.tensor_type(n), f.tensor_shape(n)) for n in _talker_reads(runtime)),
        "code_predictor": {qtype: (cp.n_groups + 1) * macs for qtype, macs in cp.macs_per_pass.items()},
    }


def costs(runtime: Runtime, macs: dict[str, dict[QType, int]] | None = None) -> dict[str, dict[str, int]]:
    """Bytes of weights read and multiply-adds per frame, per stage. The talker reads its tensors
    once per step (`_talker_reads`); the code predictor its
    layers and one head per pass, one pass per codebook after the first (the first pass has
    two rows); the decoder every weight of its matrix products once per push of a frame.
    `macs`: `generator_macs(runtime)`, where the caller has it already."""
    f = runtime.model.talker_file
    cp = runtime.code_predictor
    macs = macs or generator_macs(runtime)
    return {
        "talker": {
            "bytes": sum(f.span(n)[1] for n in _talker_reads(runtime)),
            "macs": sum(macs["talker"].values()),
        },
        "code_predictor": {
            "bytes": cp.n_groups * cp.bytes_per_pass,
            "macs": sum(macs["code_predictor"].values()),
        },
        "decoder": {
            "bytes": sum(m.array.nbytes for m, _ in runtime.codec.products()),
            "macs": runtime.codec.macs_per_frame,
        },
    }


def pipeline_floor_ms(
    generator_bytes: float, decoder_ms: float, beside_gb_s: float, alone_gb_s: float
) -> float:
    """A frame's floor in the pipeline: the decoder's products on one core while the generator
    reads its weights beside it (`beside_gb_s`, the bandwidth of its threads then), and the
    rest of the weights on all its threads once the decoder is done (`alone_gb_s`), as the
    shared cores let it (`SharedCores`)."""
    beside = beside_gb_s * 1e6 * decoder_ms  # bytes read while the decoder runs
    if generator_bytes <= beside:
        return decoder_ms
    return decoder_ms + (generator_bytes - beside) / (alone_gb_s * 1e6)


def floors(runtime: Runtime, measured: dict[str, Any]) -> dict[str, Any]:
    """What this machine allows, measured now, beside the figures `measured` (`_figures`) of
    the run just made (each run is compared with its own, see the module's docstring, and
    `median` takes the runs' ratios): the talker and the code
    predictor read their weights at the memory bandwidth of their threads, the decoder's matrix
    products run alone on its kernels and shapes (one frame per push, as measured); the
    pipeline's floor is `pipeline_floor_ms` (the stages one after the other where the decoder's
    thread leaves no core beside it). `x_floor` is each figure over its floor. The
    decoder's floor has each product's weights in the caches; the same products one after the
    other as a decode runs them (`decoder_products_in_order_ms`) read their weights from
    memory, as a decode does (a frame's are several times the caches).

    The talker's and the code predictor's multiply-adds imply a second floor, their products'
    arithmetic (`compute_floor_ms_per_frame`: at the rate of each weight type's product with
    its weight in the caches, `macs_g_per_s`, on the same threads). Reported beside the first,
    not in it: where it is the higher (Zen 1's int8 multiplies at one thread), the bandwidth's
    floor is the lower bound the ratios keep, as they always have."""
    macs = generator_macs(runtime)
    cost = costs(runtime, macs)
    threads = runtime.threads.talker
    with runtime.cores.lend(runtime.threads.decoder):
        beside = runtime.cores.threads(threads)  # the generator's threads beside the decoder
    bandwidth = read_gb_s({1, beside, threads})  # GB/s by thread count
    # where the decoder's thread leaves no core (one core), the generator waits for it
    beside_gb_s = bandwidth[beside] if available_cores() > runtime.threads.decoder else 0.0
    floor_ms = {
        stage: cost[stage]["bytes"] / bandwidth[threads] / 1e6 for stage in ("talker", "code_predictor")
    }
    floor_ms["decoder"] = 1e3 * runtime.codec.products_time(1)
    in_order_ms = 1e3 * runtime.codec.products_time(1, in_order=True)
    generator_bytes = cost["talker"]["bytes"] + cost["code_predictor"]["bytes"]
    frame_ms = 1e3 * runtime.codec.samples_per_frame / runtime.model.sample_rate
    floor = pipeline_floor_ms(generator_bytes, floor_ms["decoder"], beside_gb_s, bandwidth[threads])
    floor_rtf = floor / frame_ms
    ms = measured["ms_per_frame"]
    rates = product_rate.rates({qtype for stage in macs.values() for qtype in stage}, threads)
    return {
        "cost_per_frame": cost,
        "read_gb_s": {str(n): _digits(v) for n, v in bandwidth.items()},
        "macs_g_per_s": {qtype.name: _digits(rate / 1e9) for qtype, rate in rates.items()},
        "compute_floor_ms_per_frame": {
            stage: _digits(1e3 * sum(n / rates[qtype] for qtype, n in by_type.items()))
            for stage, by_type in macs.items()
        },
        "floor_ms_per_frame": {stage: _digits(v) for stage, v in floor_ms.items()},
        "floor_rtf": _digits(floor_rtf),
        "decoder_products_in_order_ms": _digits(in_order_ms),
        "x_floor": {
            **{stage: _digits(ms[stage] / v) for stage, v in floor_ms.items()},
            "rtf": _digits(measured["rtf"] / floor_rtf),
        },
    }


def _percentile_s(times: list[float], q: int) -> float:
    """A percentile of times in seconds, to the millisecond: every time figure is rounded
    alike, so that a median never prints above its 95th percentile."""
    return round(float(np.percentile(times, q)), 3)


def _digits(value: float) -> float:
    """Three significant digits (the tiny test models' floors are microseconds)."""
    return float(f"{value:.3g}")


def median(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over repeated runs (peak memory: the largest), the ratios to the
    floors included (the median of the runs' ratios, not a ratio of medians); shared machines
    move single runs by tens of percent. Of an even count, the mean of the middle two, to six
    significant digits (it printed 50.150000000000006 ms), a whole one as an integer (40 frames,
    not 40.0)."""

    def combine(key: str, values: list[Any]) -> Any:
        if isinstance(values[0], dict):
            return {k: combine(k, [v[k] for v in values]) for k in values[0]}
        if key == "peak_rss_mb":
            return max(values)
        middle = statistics.median(values)
        whole = all(isinstance(v, int) for v in values) and middle == int(middle)
        return int(middle) if whole else float(f"{middle:.6g}")

    return {k: combine(k, [r[k] for r in results]) for k in results[0]}


async def run_pipeline_bench(
    runtime: Runtime,
    frames: int,
    repeat: int = 1,
    voice: VoiceArg = None,
    seed: int = 0,
    live: bool = True,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The same figures measured through the actor pipeline (decoder overlapping the
    generator), for `repeat` utterances in one session, each with the floors measured right
    after it (`floors`) and a warm-up (see the module's docstring), plus each one's per-frame
    trace. `live`: spoken for a listener who hears it as it comes (`Session.speak`'s); else as
    for a file.
    `voice` defaults to the model's first built-in speaker."""
    results, traces = [], []
    voice = voice or runtime.model.default_voice
    async with runtime.open(voice=voice, seed=seed, max_frames=frames, ignore_eos=True) as tts:
        for _ in range(repeat):
            warm_up = tts.speak(BENCH_TEXT)
            async for _chunk in warm_up:
                warm_up.cancel()  # barge-in at its first audio
            busy = _busy_s(runtime)
            utterance = tts.speak(BENCH_TEXT, live=live)
            async for _chunk in utterance:
                pass
            m = utterance.metrics
            assert m.ttfa_s is not None and m.wall_s is not None
            shares = _busy_shares(_worked_s(runtime, busy), m.wall_s)
            figures = _figures(
                m.frames,
                m.audio_s,
                m.ttfa_s,
                m.wall_s,
                m.talker_s,
                m.talker_steps,
                m.code_predictor_s,
                m.decoder.busy,
            )
            results.append(figures | shares | await trio.to_thread.run_sync(floors, runtime, figures))
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


def run_bench(
    runtime: Runtime, frames: int, repeat: int = 1, voice: VoiceArg = None, seed: int = 0
) -> list[dict[str, Any]]:
    """The benchmark's figures for `repeat` utterances of `frames` frames, one after the other,
    each with the floors measured right after it (`floors`) and a warm-up (see the module's
    docstring): one frame of a throw-away utterance."""
    results = []
    for _ in range(repeat):
        _utterance(runtime, 1, voice, seed)
        figures = _utterance(runtime, frames, voice, seed)
        results.append(figures | floors(runtime, figures))
    return results


def _utterance(runtime: Runtime, frames: int, voice: VoiceArg, seed: int) -> dict[str, Any]:
    """One utterance of `frames` frames, each generated in the generator's thread, where the
    session's fixed rows are computed too (`Runtime.prepare`), then its decoder pushed a frame:
    its figures. Generated in this thread, the frames ran graphs on several threads beside a
    second pool of libgomp's threads whenever those rows were computed rather than read from
    the cache: the talker took 37-40 ms a frame instead of 27-28, the code predictor 89-105
    instead of 54-59 (see `engine/threads.py`)."""
    model = runtime.model
    voice = voice or model.default_voice
    runtime.prepare(runtime.probe(voice, "auto", None), voice)  # as a session does
    t_start = time.perf_counter()
    prompt = model.prompt(BENCH_TEXT, voice=voice, text_streaming=True)
    options = GenerationOptions(seed=seed, max_frames=frames, ignore_eos=True)
    generator = runtime.generator
    state = generator.start(prompt, model.text_feed(prompt), options, np.random.default_rng(seed))
    decoder = runtime.decoder_state(voice)
    ttfa = decoder_s = 0.0
    samples = 0
    asked = generator.next_frame_later(state)
    try:
        while (codes := asked.wait()) is not None:
            t0 = time.perf_counter()
            samples += len(runtime.codec.push(decoder, codes[None]))
            decoder_s += time.perf_counter() - t0
            if not ttfa:
                ttfa = time.perf_counter() - t_start
            asked = generator.next_frame_later(state)  # once decoded: the stages one after another
    finally:
        generator.forget(asked)  # an interrupted run leaves no frame asked for
        generator.finish(state)
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


async def _stream(
    runtime: Runtime, frames: int, voice: VoiceArg, seed: int, started: trio.Event | None = None
) -> UtteranceMetrics:
    """One utterance of exactly `frames` frames in its own session; sets `started` at its first
    audio."""
    async with runtime.open(voice=voice, seed=seed, max_frames=frames, ignore_eos=True) as tts:
        utterance = tts.speak(BENCH_TEXT)
        async for _chunk in utterance:
            if started is not None:
                started.set()
        return utterance.metrics


def _busy_s(runtime: Runtime) -> dict[str, float]:
    """Seconds each engine's thread has worked so far (`PassStats.busy_s`)."""
    return {"generator": runtime.generator.stats.busy_s, "decoder": runtime.decoder.stats.busy_s}


def _worked_s(runtime: Runtime, since: dict[str, float]) -> dict[str, float]:
    """Seconds each engine's thread worked since `since` (`_busy_s`), read once for all the
    figures of a round."""
    return {name: now - since[name] for name, now in _busy_s(runtime).items()}


def _busy_shares(worked: dict[str, float], wall: float) -> dict[str, float]:
    """The share of `wall` seconds each engine's thread `worked` (`_worked_s`): near 1 for the
    engine that limits the others, both near 1 when the cores do."""
    return {f"{name}_busy": round(s / wall, 3) for name, s in worked.items()}


def _ms_per_stream_frame(worked: dict[str, float], stream_frames: int) -> dict[str, float]:
    """Each engine thread's milliseconds of work (`_worked_s`) per frame of one stream: what a
    frame costs each engine when streams share its passes, which of the two limits the streams
    and by how much."""
    return {f"{name}_ms_per_stream_frame": round(1e3 * s / stream_frames, 1) for name, s in worked.items()}


async def _together(
    runtime: Runtime, frames: int, streams: int, voice: VoiceArg, seed: int
) -> dict[str, Any]:
    """`streams` utterances started at once: their time to first audio, real-time factor and
    the audio seconds made per wall second by all of them (over the round, and in its steady
    part: `_steady_audio_s_per_s`), and the engines' busy shares."""
    metrics: list[UtteranceMetrics] = []
    busy = _busy_s(runtime)

    async def one(i: int) -> None:
        metrics.append(await _stream(runtime, frames, voice, seed + i))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(one, i)
    wall = time.perf_counter() - start
    worked = _worked_s(runtime, busy)
    ttfa = [m.ttfa_s or 0.0 for m in metrics]
    return {
        "streams": streams,
        "frames": frames,
        "ttfa_s_p50": _percentile_s(ttfa, 50),
        "ttfa_s_p95": _percentile_s(ttfa, 95),
        "rtf_per_stream": round(statistics.median((m.wall_s or 0.0) / m.audio_s for m in metrics), 3),
        "aggregate_audio_s_per_s": round(sum(m.audio_s for m in metrics) / wall, 3),
        "steady_audio_s_per_s": _steady_audio_s_per_s(metrics),
        "wall_s": round(wall, 3),
        **_busy_shares(worked, wall),
        **_ms_per_stream_frame(worked, streams * frames),
    }


def _steady_audio_s_per_s(metrics: list[UtteranceMetrics]) -> float:
    """The audio seconds a second that the streams' frames were made at once every stream had
    been heard and until the first of them had its last frame made: each stream's frames
    over the time between the first and the last of them made then, summed. A round's streams
    begin and end together, and lose time there that a server's streams, which come and go, do
    not: the prefills and the first frames decoded alone as they begin, and the frames left to
    decode once the generator is done as they end. 0 where a stream had fewer than two frames
    made then (rounds of few frames)."""
    heard = max(m.first_audio or 0.0 for m in metrics)
    last = min(max(end for _, _, end in m.generator.spans) for m in metrics)
    rate = 0.0
    for m in metrics:
        made = [end for _, _, end in m.generator.spans if heard <= end <= last]
        if len(made) < 2 or made[-1] == made[0]:
            return 0.0
        rate += (len(made) - 1) / (made[-1] - made[0])
    return round(rate * metrics[0].audio_s / metrics[0].frames, 3)


async def _joining(runtime: Runtime, frames: int, streams: int, voice: VoiceArg, seed: int) -> list[float]:
    """Times to first audio of short streams (2 frames) that join `streams - 1` running ones,
    one after another, at spread moments (a joiner's wait depends on where the others' passes
    are when it asks), until the running ones end: from opening its session, as a server's
    request does, to its first audio."""
    times: list[float] = []
    rng = np.random.default_rng(seed)
    async with trio.open_nursery() as nursery:
        running = [trio.Event() for _ in range(streams - 1)]
        ended = trio.Event()

        async def runner(i: int) -> None:
            await _stream(runtime, frames, voice, seed + i, running[i])
            ended.set()

        for i in range(streams - 1):
            nursery.start_soon(runner, i)
        for event in running:
            await event.wait()
        while not (ended.is_set() and times):
            await trio.sleep(rng.uniform(0.0, 0.5))  # seconds between joiners
            heard, start = trio.Event(), time.perf_counter()
            async with trio.open_nursery() as joiner:  # ends with the joiner
                joiner.start_soon(_stream, runtime, 2, voice, seed + streams + len(times), heard)
                await heard.wait()
                times.append(time.perf_counter() - start)
    return times


async def run_streams_bench(
    runtime: Runtime, frames: int, streams: int, repeat: int = 1, voice: VoiceArg = None, seed: int = 0
) -> dict[str, Any]:
    """`streams` utterances of `frames` frames started together, `repeat` times (medians),
    after a warm-up round that leaves every talker slot holding the session's fixed rows; then
    the time to first audio of a stream alone and of streams that join `streams - 1` running
    ones (median and 95th percentile of all the joins of `repeat` rounds).
    With several streams, each round is followed by one stream alone on the same runtime, and
    `aggregate_x_solo` and `steady_x_solo` are the medians of the rounds' own ratios (see the
    module's docstring)."""
    voice = voice or runtime.model.default_voice
    await _together(runtime, 2, streams, voice, seed)
    results = []
    for _ in range(repeat):
        figures = await _together(runtime, frames, streams, voice, seed)
        if streams > 1:
            solo = await _together(runtime, frames, 1, voice, seed)
            figures["solo_audio_s_per_s"] = solo["aggregate_audio_s_per_s"]
            figures["aggregate_x_solo"] = _digits(
                figures["aggregate_audio_s_per_s"] / solo["aggregate_audio_s_per_s"]
            )
            steady = (figures["steady_audio_s_per_s"], solo["steady_audio_s_per_s"])
            figures["steady_x_solo"] = _digits(steady[0] / steady[1]) if all(steady) else 0.0
        results.append(figures)
    result = {**median(results), "streams": streams, "frames": frames}
    result["solo_ttfa_s"] = _percentile_s(
        [(await _stream(runtime, 2, voice, seed)).ttfa_s or 0.0 for _ in range(repeat)], 50
    )
    if streams > 1:
        joins = [t for _ in range(repeat) for t in await _joining(runtime, frames, streams, voice, seed)]
        result["join_ttfa_s"] = _percentile_s(joins, 50)
        result["join_ttfa_s_p95"] = _percentile_s(joins, 95)
        result["joins"] = len(joins)
    result["peak_rss_mb"] = round(peak_rss_mb(), 1)
    return result
