"""Offline synthesis end to end on the tiny model, through the API and the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

import kazeia_stream
from kazeia_stream.bandwidth import BUFFER_BYTES, read_gb_s
from kazeia_stream.bench import costs, median, pipeline_floor_ms
from kazeia_stream.engine.frames import frame_cap
from kazeia_stream.engine.threads import available_cores
from kazeia_stream.model import gguf_layout as L
from kazeia_stream.pcm import pcm_bytes

REFS = Path(__file__).parent / "data" / "refs"
TEXT = "Hello there, this is a tiny test."


@pytest.fixture(scope="module")
def runtime(tiny_runtime) -> kazeia_stream.Runtime:
    return tiny_runtime("custom_voice")


def run_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kazeia_stream", *args], capture_output=True, timeout=300, **kw
    )


def test_synthesize_is_seeded_and_capped(runtime):
    audio, rate = runtime.synthesize(TEXT, voice="ryan", seed=3)
    again, _ = runtime.synthesize(TEXT, voice="ryan", seed=3)
    other, _ = runtime.synthesize(TEXT, voice="ryan", seed=4)
    assert rate == 24000 and audio.dtype == np.float32
    assert len(audio) % 1920 == 0 and len(audio) > 0
    n_tokens = runtime.model.count_tokens(TEXT)
    assert len(audio) // 1920 <= frame_cap(n_tokens, 8192)
    assert np.array_equal(audio, again)
    assert not (len(audio) == len(other) and np.array_equal(audio, other))
    assert np.abs(audio).max() <= 1.0 and np.sqrt(np.mean(audio**2)) > 1e-3


def test_ignore_eos_gives_exactly_max_frames(runtime):
    audio, _ = runtime.synthesize(TEXT, voice="ryan", seed=0, max_frames=7, ignore_eos=True)
    assert len(audio) == 7 * 1920


@pytest.mark.subprocess
def test_cli_writes_a_wav_equal_to_the_api(runtime, tiny_gguf, tmp_path):
    out = tmp_path / "out.wav"
    r = run_cli(
        TEXT, "-o", str(out), "--model", str(tiny_gguf("custom_voice")[0]), "--voice", "ryan", "--seed", "3"
    )
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout == b""
    info = sf.info(str(out))
    assert info.samplerate == 24000 and info.channels == 1 and info.format == "WAV"
    pcm, _ = sf.read(str(out), dtype="int16")
    audio, _ = runtime.synthesize(TEXT, voice="ryan", seed=3)
    assert len(pcm) == len(audio) > 0
    assert pcm.astype("<i2").tobytes() == pcm_bytes(audio, "s16le")  # the samples of --pipe


@pytest.mark.parametrize(
    "args, message",
    [
        (["   "], "the text is empty"),
        (["Hi.", "--voice", "nobody"], "unknown voice 'nobody'"),
        (["Hi.", "--language", "klingon"], "unknown language 'klingon'"),
    ],
)
@pytest.mark.subprocess
def test_cli_bad_input_is_one_line_and_writes_nothing(args, message, tiny_gguf, tmp_path):
    out = tmp_path / "out.wav"
    r = run_cli(*args, "-o", str(out), "--model", str(tiny_gguf("custom_voice")[0]))
    assert r.returncode != 0
    err = r.stderr.decode().strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.subprocess
def test_cli_without_a_model_says_how_to_make_one(tmp_path):
    r = run_cli("Hi.", "-o", str(tmp_path / "x.wav"), env={"PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and b"kazeia-stream convert" in r.stderr


@pytest.mark.subprocess
def test_dump_matches_the_official_references(tiny_gguf, tmp_path):
    ref = np.load(REFS / "talker_custom_voice.npz")
    case = json.loads(str(ref["case_json"]))
    codes = tmp_path / "codes.npy"
    np.save(codes, ref["codes"])
    out = tmp_path / "dump.npz"
    r = run_cli(
        "dump",
        "--model",
        str(tiny_gguf("custom_voice")[0]),
        "--text",
        case["text"],
        "--voice",
        case["voice"],
        "--language",
        case["language"],
        "--codes",
        str(codes),
        "--chunk",
        "5",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr.decode()
    d = np.load(out)
    assert sorted(d.files) == sorted(
        ["prefill", "trailing", "talker_logits", "talker_hidden", "cp_logits", "audio", "audio_streamed"]
    )
    assert np.abs(d["prefill"] - ref["prefill"]).max() < 1e-5
    assert np.abs(d["talker_logits"] - ref["talker_logits"]).max() < 1e-3
    assert np.abs(d["cp_logits"] - ref["cp_logits"]).max() < 1e-3
    n = len(ref["codes"])
    assert d["audio"].shape == d["audio_streamed"].shape == (n * 1920,)
    assert np.abs(d["audio"] - d["audio_streamed"]).max() <= 1e-5


@pytest.mark.subprocess
def test_bench_json_has_exactly_the_documented_keys(tiny_gguf):
    r = run_cli("bench", "--model", str(tiny_gguf("custom_voice")[0]), "--frames", "6", "--json")
    assert r.returncode == 0, r.stderr.decode()
    result = json.loads(r.stdout.decode().strip().splitlines()[-1])
    assert set(result) == {
        *("frames", "audio_s", "ttfa_s", "wall_s", "rtf", "ms_per_frame", "peak_rss_mb"),
        *("cost_per_frame", "read_gb_s", "floor_ms_per_frame", "floor_rtf", "x_floor"),
        *("decoder_products_in_order_ms", "macs_g_per_s", "compute_floor_ms_per_frame"),
    }
    stages = {"talker", "code_predictor", "decoder"}
    for key in ("ms_per_frame", "floor_ms_per_frame", "cost_per_frame"):
        assert set(result[key]) == stages
    assert result["frames"] == 6 and result["audio_s"] == pytest.approx(6 * 0.08)
    assert 0 < result["ttfa_s"] < result["wall_s"]
    # wall_s is rounded to the millisecond and rtf to three decimals: a tiny model's 6 frames
    # take under 50 ms on a fast CPU, where 1% of the ratio is less than their rounding
    rounding = 0.0005 + 0.0005 / result["audio_s"]
    assert abs(result["rtf"] - result["wall_s"] / result["audio_s"]) <= rounding
    assert all(c["bytes"] > 0 and c["macs"] > 0 for c in result["cost_per_frame"].values())
    assert set(result["read_gb_s"]) == {"1", str(available_cores())} and min(result["read_gb_s"].values()) > 0
    assert result["decoder_products_in_order_ms"] > 0
    # the tiny model's matrices are all of one type: each stage's multiply-adds at its rate
    (rate,) = result["macs_g_per_s"].values()
    compute = result["compute_floor_ms_per_frame"]
    assert set(compute) == {"talker", "code_predictor"}
    for stage, ms in compute.items():
        assert ms == pytest.approx(result["cost_per_frame"][stage]["macs"] / rate / 1e6, rel=0.01)
    x = result["x_floor"]
    assert set(x) == {*stages, "rtf"} and min(x.values()) > 0
    assert x["rtf"] == pytest.approx(result["rtf"] / result["floor_rtf"], rel=0.02)  # one run: its own


def test_the_pipeline_floor_lets_the_generator_take_the_cores_the_decoder_leaves():
    """1 GB/s is 1 MB per ms. Beside a 50 ms decode the generator reads 50 MB at 1 GB/s, then
    the rest at 3 GB/s: never faster than all its threads' bandwidth, never under the decode."""
    assert pipeline_floor_ms(40e6, 50.0, 1.0, 3.0) == 50.0  # the decoder is the slower side
    assert pipeline_floor_ms(80e6, 50.0, 1.0, 3.0) == pytest.approx(60.0)
    for generator_bytes in (1e6, 60e6, 500e6):
        floor = pipeline_floor_ms(generator_bytes, 50.0, 1.0, 3.0)
        assert floor >= max(50.0, generator_bytes / 3e6)
        assert floor <= 50.0 + generator_bytes / 3e6  # one after the other would take this


@pytest.mark.parametrize("cores", [1, 2])
def test_on_one_core_the_pipeline_floor_is_the_stages_one_after_the_other(runtime, monkeypatch, cores):
    """Where the decoder's thread takes the only core, the generator reads nothing beside it."""
    from kazeia_stream import bench

    monkeypatch.setattr(bench, "available_cores", lambda: cores)
    ms = {"talker": 1.0, "code_predictor": 1.0, "decoder": 1.0}
    result = bench.floors(runtime, {"ms_per_frame": ms, "rtf": 1.0})
    floor, cost = result["floor_ms_per_frame"], result["cost_per_frame"]
    generator_bytes = cost["talker"]["bytes"] + cost["code_predictor"]["bytes"]
    all_threads = result["read_gb_s"][str(runtime.threads.talker)]
    after = floor["decoder"] + generator_bytes / all_threads / 1e6  # ms
    frame_ms = 1e3 * runtime.codec.samples_per_frame / runtime.model.sample_rate
    if cores == 1:
        assert result["floor_rtf"] * frame_ms == pytest.approx(after, rel=0.02)
    else:
        assert result["floor_rtf"] * frame_ms < 0.98 * after


def test_costs_count_the_bytes_the_engines_read(tiny_runtime):
    runtime = tiny_runtime("custom_voice")
    cost = costs(runtime)
    cp = runtime.code_predictor
    assert cost["talker"]["bytes"] == runtime.talker.weights.nbytes  # all but the text embedding
    mmproj = runtime.model.mmproj_file  # F32: the code predictor keeps the stored types
    layers = [n for n in mmproj.tensor_names if n.startswith("a.gen.code.blk.")]
    head = mmproj.span(L.CP_HEAD)[1] // cp.n_groups  # one per pass
    projection = [n for n in mmproj.tensor_names if n == L.CP_PROJ_IN + ".weight"]
    read = [*layers, L.CP_OUTPUT_NORM, *projection]
    assert cp.bytes_per_pass == sum(mmproj.span(n)[1] for n in read) + head
    assert cost["code_predictor"]["bytes"] == cp.n_groups * cp.bytes_per_pass
    assert cost["decoder"]["macs"] == runtime.codec.macs_per_frame
    # multiply-adds: every matrix of the talker but the text embedding; the code predictor's
    # per pass (one head), one pass per codebook and the first pass's second row
    talker = runtime.model.talker_file
    matrices = [talker.tensor_shape(n) for n in talker.tensor_names if n != L.TALKER_TOKEN_EMBD]
    assert cost["talker"]["macs"] == sum(math.prod(s) for s in matrices if len(s) > 1)
    per_pass = [mmproj.tensor_shape(n) for n in [*layers, *projection]]
    one_head = math.prod(mmproj.tensor_shape(L.CP_HEAD)[1:])
    expected = sum(math.prod(s) for s in per_pass if len(s) > 1) + one_head
    assert cost["code_predictor"]["macs"] == (cp.n_groups + 1) * expected


@pytest.mark.subprocess
def test_pipeline_bench_repeats_and_reports_medians(tiny_gguf, tmp_path):
    trace = tmp_path / "trace.json"
    r = run_cli(
        "bench",
        "--model",
        str(tiny_gguf("custom_voice")[0]),
        "--frames",
        "5",
        "--json",
        "--pipeline",
        "--repeat",
        "3",
        "--trace",
        str(trace),
    )
    assert r.returncode == 0, r.stderr.decode()
    result = json.loads(r.stdout.decode().strip().splitlines()[-1])
    assert result["frames"] == 5 and "medians of 3 runs" in r.stderr.decode()
    assert "pipeline (for a live listener): " in r.stderr.decode()
    # each engine's thread worked for part of its utterance's wall time, and the line says so
    assert 0 < result["generator_busy"] <= 1.05 and 0 < result["decoder_busy"] <= 1.05
    busy = f"threads busy: generator {result['generator_busy']:.0%}, decoder {result['decoder_busy']:.0%}"
    assert busy in r.stderr.decode()
    # the floors measured after the first runs read buffers larger than the caches, in a
    # process of their own: the tiny model's peak stays well under one of them
    assert result["peak_rss_mb"] < BUFFER_BYTES / 2**20
    traces = json.loads(trace.read_text())
    assert len(traces) == 3
    assert all(
        [f for f, *_ in t["generator"]] == [f for f, *_ in t["decoder"]] == list(range(5)) for t in traces
    )


@pytest.mark.subprocess
def test_pipeline_bench_offline_pushes_the_frames_after_the_first_four_at_a_time(tiny_gguf, tmp_path):
    """`--offline` speaks as for a file: the decoder's trace gives each frame its share of its
    push, so frames 1-4 of one push follow each other in equal shares."""
    trace = tmp_path / "trace.json"
    model = str(tiny_gguf("custom_voice")[0])
    r = run_cli("bench", "--model", model, "--frames", "5", "--pipeline", "--offline", "--trace", str(trace))
    assert r.returncode == 0, r.stderr.decode()
    assert "pipeline (as for a file): " in r.stderr.decode()
    spans = json.loads(trace.read_text())["decoder"]
    assert [f for f, *_ in spans] == list(range(5))
    shares = [end - start for _, start, end in spans[1:]]
    assert all(spans[i][2] == spans[i + 1][1] for i in range(1, 4))  # one push
    assert max(shares) - min(shares) <= 2e-4  # equal shares, to the trace's rounding


@pytest.mark.parametrize("pipeline", [False, True])
def test_each_bench_run_is_compared_with_a_floor_measured_right_after_it(tiny_runtime, monkeypatch, pipeline):
    """On a shared machine the floor moves with the neighbours' load: each run gets its own,
    measured after it and before the next run starts, and the median is of the runs' ratios.
    The floor evicts the caches: before the next run, a throw-away utterance reaches its first
    audio (one frame; through the pipeline, cut off once its audio comes); before the first
    too, which would otherwise wait for the runtime's codec decoder still loading."""
    import trio

    from kazeia_stream import bench
    from kazeia_stream.session import Session

    runtime, events = tiny_runtime("custom_voice"), []
    started, speak = bench._figures, Session.speak

    def figures(frames, *args):
        events.append(("run", frames))
        return started(frames, *args)

    def floors(_, measured):
        events.append("floor")
        return {"x_floor": {"rtf": 10.0 * len(events)}}

    def speaking(self, *args, **kw):
        events.append("speak")
        return speak(self, *args, **kw)

    monkeypatch.setattr(bench, "_figures", figures)
    monkeypatch.setattr(bench, "floors", floors)
    monkeypatch.setattr(Session, "speak", speaking)
    if pipeline:
        results, _ = trio.run(bench.run_pipeline_bench, runtime, 2, 3)
        run, warm_up = ["speak", ("run", 2)], ["speak"]  # the warm-up's figures are not taken
    else:
        results = bench.run_bench(runtime, 2, 3)
        run, warm_up = [("run", 2)], [("run", 1)]
    assert events == [*warm_up, *run, "floor", *warm_up, *run, "floor", *warm_up, *run, "floor"]
    floor_at = [i + 1 for i, e in enumerate(events) if e == "floor"]
    assert [r["x_floor"]["rtf"] for r in results] == [10.0 * n for n in floor_at]
    assert median(results)["x_floor"]["rtf"] == 10.0 * floor_at[1]


@pytest.mark.skipif(kazeia_stream.Threads.default().cores < 2, reason="graphs on several threads: needs 2")
def test_the_stage_bench_runs_its_graphs_of_several_threads_in_one_thread(tiny_gguf, monkeypatch):
    """A runtime computes a session's fixed rows in the generator's thread; a bench that
    generated its frames in another would run graphs on several threads from two OS threads,
    and libgomp keeps a pool for each: its threads then outnumber the cores."""
    from kazeia_stream import Runtime, bench, load_model
    from kazeia_stream.engine.ggml_graph import Graph

    monkeypatch.setenv("KAZEIA_CACHE", "0")  # the fixed rows computed, not read from a file
    several = set()  # the OS threads that ran a graph on several threads
    compute = Graph.compute

    def counted(graph: Graph, n: int) -> None:
        if n > 1:
            several.add(threading.get_native_id())
        compute(graph, n)

    monkeypatch.setattr(Graph, "compute", counted)
    monkeypatch.setattr(bench, "floors", lambda runtime, measured: {})
    runtime = Runtime(load_model(tiny_gguf("custom_voice")[0]))
    monkeypatch.setattr(runtime.cores, "taken", lambda: 0)  # whatever else the machine runs
    (figures,) = bench.run_bench(runtime, 2)
    assert figures["frames"] == 2
    assert len(several) == 1


def test_the_read_bandwidth_is_measured_for_each_thread_count_asked():
    gb_s = read_gb_s([2, 1, 2])
    assert list(gb_s) == [1, 2] and min(gb_s.values()) > 0.1


@pytest.mark.subprocess
def test_the_peak_rss_bench_reports_is_its_own_not_that_of_the_process_that_started_it():
    """Linux' getrusage carries the starting process's peak across exec (pytest's process holds
    a gigabyte by the end of the suite)."""
    parent = np.ones(2 * BUFFER_BYTES // 4, np.float32)  # 512 MiB resident here
    code = "from kazeia_stream.bench import peak_rss_mb; print(peak_rss_mb())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert 0 < float(r.stdout) < parent.nbytes / 2**20 / 2


def test_median_takes_each_figure_s_median_and_the_largest_peak():
    runs = [
        {"ttfa_s": t, "ms_per_frame": {"talker": m}, "peak_rss_mb": p}
        for t, m, p in [(0.5, 10.0, 3.0), (0.9, 30.0, 1.0), (0.4, 20.0, 2.0)]
    ]
    assert median(runs) == {"ttfa_s": 0.5, "ms_per_frame": {"talker": 20.0}, "peak_rss_mb": 3.0}
    # of two runs, the mean of each figure as it would print (counts stay whole)
    two = [{"frames": 40, "ms_per_frame": {"talker": t}} for t in (50.1, 50.2)]
    figures = median(two)
    assert figures == {"frames": 40, "ms_per_frame": {"talker": 50.15}}
    assert isinstance(figures["frames"], int) and repr(figures["ms_per_frame"]["talker"]) == "50.15"
