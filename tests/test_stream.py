"""The actor pipeline: streaming == offline, text pieces, barge-in, backpressure, overlap."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import trio

import kazeia_stream
from kazeia_stream import UsageError
from kazeia_stream.channels import UtteranceMetrics
from kazeia_stream.engine.codec import CodecDecoder
from kazeia_stream.engine.frames import FrameLoop, GenerationOptions
from kazeia_stream.engine.ggml_graph import Graph
from kazeia_stream.session import AUDIO_BUFFER, FRAME_BUFFER
from kazeia_stream.stages.decoder import LISTENER_MARGIN_S, MAX_PUSH, _hold_until

TEXT = "Hello there, this is a tiny test of the streaming pipeline."


@pytest.fixture(scope="module")
def runtime(tiny_runtime) -> kazeia_stream.Runtime:
    return tiny_runtime("custom_voice")


@pytest.fixture(scope="module")
def offline(runtime) -> np.ndarray:
    return runtime.synthesize(TEXT, voice="ryan", seed=5, text_streaming=True)[0]


async def llm_tokens(text: str, delay: float):
    """A simulated LLM: the text in 3-character pieces, one every `delay` seconds."""
    for i in range(0, len(text), 3):
        await trio.sleep(delay)
        yield text[i : i + 3]


def same_audio(a: np.ndarray, b: np.ndarray) -> bool:
    """The same samples, bit for bit, whatever the timing: the decoder's numbers do not depend
    on how many frames a push takes (offline synthesis pushes one at a time)."""
    return a.shape == b.shape and np.array_equal(a, b)


async def collect(utterance) -> np.ndarray:
    return np.concatenate([chunk.pcm async for chunk in utterance])


async def test_streamed_chunks_equal_the_offline_synthesis(runtime, offline):
    async with runtime.open(voice="ryan", seed=5) as tts:
        utterance = tts.speak(TEXT)
        chunks = [c async for c in utterance]
        assert all(c.sample_rate == 24000 for c in chunks)
        assert [c.frame_index for c in chunks] == sorted({c.frame_index for c in chunks})
        assert same_audio(np.concatenate([c.pcm for c in chunks]), offline)
        m = utterance.metrics
        assert m.frames == len(offline) // 1920 and m.audio_s == pytest.approx(len(offline) / 24000)
        assert 0 < m.ttfa_s < m.wall_s and m.rtf == pytest.approx(m.wall_s / m.audio_s)
        # Several utterances in a row reuse the engines and give the same audio.
        assert same_audio(await collect(tts.speak(TEXT)), offline)


async def test_sessions_with_different_voices_share_a_runtime_one_utterance_at_a_time(runtime, offline):
    eric = runtime.synthesize(TEXT, voice="eric", seed=5, text_streaming=True)[0]
    results = {}

    async def converse(voice: str) -> None:
        async with runtime.open(voice=voice, seed=5) as tts:
            results[voice] = [await collect(tts.speak(TEXT)) for _ in range(2)]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(converse, "ryan")
        nursery.start_soon(converse, "eric")
    assert all(same_audio(pcm, offline) for pcm in results["ryan"])
    assert all(same_audio(pcm, eric) for pcm in results["eric"])


@pytest.mark.parametrize("delay", [0.0, 0.05])
async def test_text_pieces_from_an_llm_give_the_same_speech(runtime, offline, delay):
    async with runtime.open(voice="ryan", seed=5) as tts:
        utterance = tts.speak(llm_tokens(TEXT, delay))
        first = None
        pcm = []
        async for chunk in utterance:
            first = first or time.perf_counter()
            pcm.append(chunk.pcm)
        assert same_audio(np.concatenate(pcm), offline)
        if delay:  # speech started long before the text was complete
            text_done = utterance.metrics.started + delay * len(range(0, len(TEXT), 3))
            assert first < text_done - 0.5


async def test_frames_queued_behind_a_slow_decoder_go_in_one_push_same_audio(runtime, offline, slow_decoder):
    pushes = slow_decoder(runtime, 0.05)
    async with runtime.open(voice="ryan", seed=5) as tts:
        utterance = tts.speak(TEXT)
        chunks = [c async for c in utterance]
    assert pushes[0] == 1 and 1 < max(pushes) <= MAX_PUSH  # the first frame alone, then more
    assert [c.frame_index for c in chunks] == list(range(len(chunks)))  # a chunk a frame
    assert utterance.metrics.frames == len(chunks) == sum(pushes)
    assert same_audio(np.concatenate([c.pcm for c in chunks]), offline)


async def test_an_utterance_for_a_file_goes_max_push_frames_a_push_after_its_first(
    runtime, offline, slow_decoder
):
    """Nobody hears it as it comes (`live=False`): the decoder waits for `MAX_PUSH` frames,
    except for the first, which comes alone, and the last ones."""
    pushes = slow_decoder(runtime, 0.0)
    async with runtime.open(voice="ryan", seed=5) as tts:
        chunks = [c async for c in tts.speak(TEXT, live=False)]
    assert pushes == held_pushes(len(offline) // 1920)
    assert [c.frame_index for c in chunks] == list(range(len(chunks)))  # a chunk a frame
    assert same_audio(np.concatenate([c.pcm for c in chunks]), offline)


def test_offline_synthesis_goes_max_push_frames_a_push_after_its_first(runtime, offline, slow_decoder):
    """`synthesize` speaks through a session's actors (`Runtime.audio`), as an utterance that
    nobody hears as it comes; `audio` live, as one heard as it comes (the tiny model is faster
    than real time: pushes held while the listener has enough left)."""
    pushes = slow_decoder(runtime, 0.0)
    audio, _ = runtime.synthesize(TEXT, voice="ryan", seed=5, text_streaming=True)
    assert pushes == held_pushes(len(offline) // 1920)
    assert same_audio(audio, offline)
    pushes.clear()
    streamed = np.concatenate(
        list(runtime.audio(TEXT, voice="ryan", text_streaming=True, options=GenerationOptions(seed=5)))
    )
    assert pushes[0] == 1 and sum(pushes) == len(offline) // 1920 and same_audio(streamed, offline)


def held_pushes(frames: int) -> list[int]:
    """The frames of each push of an utterance of `frames` frames that nobody hears as it
    comes: the first alone, then `MAX_PUSH` at a time."""
    rest, last = divmod(frames - 1, MAX_PUSH)
    return [1] + [MAX_PUSH] * rest + ([last] if last else [])


@pytest.mark.parametrize("ahead", [None, 0.0, 0.1, 10.0])
async def test_a_live_listener_of_a_slow_generator_gets_frames_four_at_a_time_unless_it_has_a_little_left(
    runtime, offline, slow_decoder, slow_generator, ahead
):
    """A generator slower than real time: the audio made never leads a listener who hears it
    in real time from its first chunk (`ahead` None), nor one that says it has nothing left
    (0 s): it has run dry, and after the first frame gets them four at a time, as a player
    rebuffers. One that says it has a little left (0.1 s, less than a push and the margin)
    gets each frame at once (the decoder keeps up: none queues); one that says it has 10 s
    left to hear (a player's long queue) gets them four at a time."""
    pushes = slow_decoder(runtime, 0.0)
    slow_generator(runtime, 0.12)
    async with runtime.open(voice="ryan", seed=5, max_frames=8) as tts:
        pcm = await collect(tts.speak(TEXT, ahead=None if ahead is None else lambda: ahead))
    if not ahead:  # (a frame made late by the machine's load may cut a push short)
        assert pushes[0] == 1 and len(pushes) <= 4
    else:
        assert pushes == ([1] * 8 if ahead == 0.1 else held_pushes(8))
    assert same_audio(pcm, offline[: 8 * 1920])


async def test_a_push_waits_for_more_frames_while_a_live_listener_has_enough_to_hear_or_ran_dry():
    m = UtteranceMetrics(sample_rate=24000)
    assert _hold_until(m, False, 0.05) == math.inf  # nobody listens as it comes
    m.first_audio, m.samples = time.perf_counter() - 1.0, 2 * 24000  # 2 s made, 1 s heard
    waits = _hold_until(m, True, 0.05) - trio.current_time()
    assert waits == pytest.approx(1.0 - MAX_PUSH * 0.05 - LISTENER_MARGIN_S, abs=0.02)
    m.samples = 24000  # all heard: a push goes at once
    assert _hold_until(m, True, 0.05) < trio.current_time()
    now = time.perf_counter()  # ... unless the generator is making frames: a frame in 0.1 s,
    m.generator.add(0, now - 0.15, now - 0.05)  # made 0.05 s ago: MAX_PUSH more by then
    waits = _hold_until(m, True, 0.05) - trio.current_time()
    assert waits == pytest.approx(MAX_PUSH * 0.1 - 0.05, abs=0.02)
    m.generator.spans[-1] = (0, now - 1.0, now - 0.9)  # made long ago (it waits for text)
    assert _hold_until(m, True, 0.05) < trio.current_time()
    waits = _hold_until(m, True, 0.05, ahead=lambda: 3.0) - trio.current_time()  # a player's queue
    assert waits == pytest.approx(3.0 - MAX_PUSH * 0.05 - LISTENER_MARGIN_S, abs=0.02)
    m.samples = 2 * 24000  # `ahead` is what is left at least: less does not cut the hold
    waits = _hold_until(m, True, 0.05, ahead=lambda: 0.0) - trio.current_time()
    assert waits == pytest.approx(1.0 - MAX_PUSH * 0.05 - LISTENER_MARGIN_S, abs=0.02)


@pytest.mark.serial
async def test_barge_in_stops_within_100_ms_and_the_session_goes_on(runtime, offline):
    async with runtime.open(voice="ryan", seed=5) as tts:
        utterance = tts.speak(TEXT)
        got = 0
        async for _chunk in utterance:
            got += 1
            if got == 2:
                t0 = time.perf_counter()
                tts.cancel()
        stopped = time.perf_counter() - t0
        assert got == 2 and stopped < 0.1 and utterance.metrics.cancelled
        await utterance.done.wait()
        assert same_audio(await collect(tts.speak(TEXT)), offline)


async def test_a_slow_consumer_holds_the_producers_back(runtime):
    async with runtime.open(voice="ryan", seed=5) as tts:
        utterance = tts.speak(TEXT)
        consumed = 0
        ahead = []
        async for chunk in utterance:
            consumed += len(chunk.pcm) // 1920
            ahead.append(len(utterance.metrics.generator.spans) - consumed)
            await trio.sleep(0.02)
        # Frames generated but not consumed stay within the channel buffers, plus one in
        # flight in the generator and one push in the decoder (the frame that came and those
        # queued behind it or waited for), whatever the consumer's pace.
        assert max(ahead) <= FRAME_BUFFER + AUDIO_BUFFER + MAX_PUSH + 1


@pytest.mark.skipif(kazeia_stream.Threads.default().cores < 2, reason="lends a core: needs 2")
async def test_the_decoder_overlaps_the_generator_after_the_first_frame(runtime, monkeypatch):
    threads = []  # the thread count of each graph the talker and the code predictor ran
    several = set()  # the OS threads that ran a graph on several threads (libgomp pools)
    compute = Graph.compute

    def counted(graph: Graph, n: int) -> None:
        if threading.current_thread().name != "kazeia-decoder":
            threads.append(n)
        if n > 1:
            several.add(threading.get_native_id())
        compute(graph, n)

    monkeypatch.setattr(Graph, "compute", counted)
    monkeypatch.setattr(runtime.cores, "taken", lambda: 0)  # whatever else the machine runs
    async with runtime.open(voice="ryan", seed=5) as tts:
        utterance = tts.speak(TEXT)
        await collect(utterance)
        gen = utterance.metrics.generator.spans
        dec = utterance.metrics.decoder.spans
        assert gen[1][1] >= dec[0][2]  # the first decode ran alone
        overlapping = sum(1 for _, d0, d1 in dec for _, g0, g1 in gen if d0 < g1 and g0 < d1)
        assert overlapping > 0
        # the graphs' calls gave a core to the decoder beside them, and took it back (during
        # the utterance only where the decoder was idle: rare with the tiny model's fast steps)
        cores = runtime.threads.cores
        assert cores - 1 in threads
        assert runtime.cores.lent == runtime.cores.asked == 0 and runtime.cores.threads(cores) == cores
        # one thread runs graphs on several threads, the decoder's first frame alone included
        assert len(several) == 1


@pytest.mark.skipif(kazeia_stream.Threads.default().cores < 2, reason="lends a core: needs 2")
def test_a_decode_holds_its_core_from_the_moment_it_is_asked_for(runtime, monkeypatch):
    """A graph call that starts while a decode waits for its pass runs beside that pass: it
    must not take the decoder's core (the next frame's talker step is asked for at once)."""
    cores, wanted = runtime.cores, runtime.threads.cores
    monkeypatch.setattr(cores, "taken", lambda: 0)  # whatever else the machine runs
    busy, release = threading.Event(), threading.Event()
    blocker = threading.Thread(target=runtime.decoder.call, args=(lambda: busy.set() or release.wait(),))
    blocker.start()
    assert busy.wait(10)  # the decoder's thread is inside a call: a decode asked now waits
    codes = np.zeros((1, runtime.codec.num_groups), dtype=np.int64)
    state = runtime.codec.new_state()
    decode = threading.Thread(target=trio.run, args=(runtime.decoder.decode, state, codes))
    decode.start()
    try:
        deadline = time.monotonic() + 10
        while not runtime.decoder._queue and time.monotonic() < deadline:
            time.sleep(0.001)
        assert cores.threads(wanted) == wanted - runtime.threads.decoder
    finally:
        release.set()
        blocker.join(10)
        decode.join(10)
    assert cores.threads(wanted) == wanted and cores.asked == 0 and cores.lent == 0


def test_offline_audio_generates_the_next_frames_while_a_push_decodes(
    runtime, offline, engine_spans, monkeypatch
):
    """`Runtime.audio` (and so `synthesize`) overlaps the engines as a session's actors do: while
    a push of `MAX_PUSH` frames decodes, the generator makes the next ones (as many as the frame
    channel holds, and one more in flight), not only the one asked for before the push. The
    decoder is slowed so that its pushes outlast the tiny model's frames whatever the load."""
    push_many = runtime.codec.push_many
    monkeypatch.setattr(runtime.codec, "push_many", lambda *a, **k: time.sleep(0.2) or push_many(*a, **k))
    spans = engine_spans(runtime)
    options = GenerationOptions(seed=5)
    pcm = np.concatenate(
        list(runtime.audio(TEXT, voice="ryan", text_streaming=True, options=options, live=False))
    )
    assert same_audio(pcm, offline)
    begun = [sum(start < g0 < end for g0, _ in spans["generator"]) for start, end in spans["decoder"]]
    assert len(begun) == len(held_pushes(len(offline) // 1920))
    # (one frame ahead, a push's frames would begin one at most; a frame made late by the
    # machine's load may leave a push fewer)
    assert max(begun) >= FRAME_BUFFER


def test_offline_audio_left_early_frees_its_stream(runtime, offline):
    """An `audio` iteration its caller leaves after a frame gives its talker slot back: the
    runtime's next utterance is the same as on a fresh one."""
    free = sorted(runtime.frames.free)
    frames = runtime.audio(TEXT, voice="ryan", text_streaming=True, options=GenerationOptions(seed=5))
    assert len(next(frames)) == 1920
    assert len(runtime.frames.free) == len(free) - 1
    frames.close()
    assert sorted(runtime.frames.free) == free
    assert same_audio(runtime.synthesize(TEXT, voice="ryan", seed=5, text_streaming=True)[0], offline)


def test_a_frame_asked_ahead_and_forgotten_leaves_the_queue(runtime):
    """`Generator.forget` withdraws a frame asked for ahead that nobody will wait for (an
    offline iteration its caller left): no pass takes it."""
    busy, release = threading.Event(), threading.Event()
    blocker = threading.Thread(target=runtime.generator.call, args=(lambda: busy.set() or release.wait(),))
    blocker.start()
    assert busy.wait(10)  # the generator's thread is inside a call: a frame asked now waits
    prompt = runtime.model.prompt(TEXT, voice="ryan")
    options, rng = GenerationOptions(seed=5), np.random.default_rng(5)
    state = runtime.generator.start(prompt, runtime.model.text_feed(prompt), options, rng)
    try:
        asked = runtime.generator.next_frame_later(state)
        assert [s for s, _ in runtime.generator._queue] == [state]
        runtime.generator.forget(asked)
        assert not runtime.generator._queue
    finally:
        release.set()
        blocker.join(10)
        runtime.generator.finish(state)


async def test_errors_surface_in_the_iteration_and_the_session_survives(runtime, offline):
    async with runtime.open(voice="ryan", seed=5) as tts:
        with pytest.raises(UsageError, match="empty"):
            await collect(tts.speak(llm_tokens("   ", 0)))
        assert same_audio(await collect(tts.speak(TEXT)), offline)


async def test_bad_voice_fails_at_open(runtime):
    with pytest.raises(UsageError, match="unknown voice"):
        async with runtime.open(voice="nobody"):
            pass


def test_busy_time_and_overlap_of_the_stages():
    from kazeia_stream.channels import UtteranceMetrics

    m = UtteranceMetrics()
    m.generator.add(0, 0.0, 1.0)
    m.generator.add(1, 1.0, 2.0)
    m.decoder.add(0, 1.0, 1.5)  # beside generator frame 1
    m.decoder.add(1, 2.0, 2.5)  # alone
    assert m.frames == 2
    assert m.decoder.busy == pytest.approx(1.0) and m.generator.busy == pytest.approx(2.0)
    assert m.overlap_s == pytest.approx(0.5)


async def test_cancel_stops_the_utterance_speaking_not_the_one_queued_after_it(runtime, offline):
    async with runtime.open(voice="ryan", seed=5) as tts:
        speaking = tts.speak(TEXT)
        queued = tts.speak(TEXT)
        first = await speaking.__aiter__().__anext__()
        assert first.frame_index == 0
        tts.cancel()
        assert speaking.metrics.cancelled and not queued.metrics.cancelled
        assert same_audio(await collect(queued), offline)
        await speaking.done.wait()
        assert speaking.metrics.frames < len(offline) // 1920


async def test_utterances_are_spoken_in_the_order_asked(runtime):
    texts = ["One.", "Two, two.", "Three, three, three."]
    expected = [runtime.synthesize(t, voice="ryan", seed=5, text_streaming=True)[0] for t in texts]
    async with runtime.open(voice="ryan", seed=5) as tts:
        utterances = [tts.speak(t) for t in texts]  # all asked for at once
        spoken = [await collect(utterance) for utterance in utterances]
    assert all(same_audio(pcm, e) for pcm, e in zip(spoken, expected))
    starts = [u.metrics.generator.spans[0][1] for u in utterances]
    assert starts == sorted(starts)


async def test_errors_inside_a_session_come_out_as_themselves(runtime):
    with pytest.raises(kazeia_stream.EmptyTextError):
        async with runtime.open(voice="ryan") as tts:
            await collect(tts.speak("  "))
    with pytest.raises(KeyError):
        async with runtime.open(voice="ryan"):
            raise KeyError("from the caller")


@pytest.mark.serial
async def test_a_runtime_is_built_off_the_event_loop(tiny_gguf):
    model = kazeia_stream.load_model(tiny_gguf("custom_voice")[0])
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            ticks += 1
            await trio.sleep(0.005)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(tick)
        start = time.perf_counter()
        runtime = await kazeia_stream.Runtime.create(model)
        took = time.perf_counter() - start
        nursery.cancel_scope.cancel()
    assert isinstance(runtime, kazeia_stream.Runtime)
    assert ticks >= 0.3 * took / 0.005  # the loop ran while the engines were made


async def test_a_first_utterance_is_generated_while_the_decoder_loads(tiny_gguf, runtime, monkeypatch):
    """The codec decoder loads in a thread of its own: a runtime is usable at once, and only
    the first decode waits for it. Its audio is the same."""
    loaded, generated = threading.Event(), threading.Event()
    make, frames = CodecDecoder.__init__, FrameLoop.next_frames

    def slow(self, *args):
        assert loaded.wait(30)
        make(self, *args)

    def noted(self, *args, **kwargs):
        out = frames(self, *args, **kwargs)
        generated.set()
        return out

    monkeypatch.setattr(CodecDecoder, "__init__", slow)
    monkeypatch.setattr(FrameLoop, "next_frames", noted)
    fresh = await kazeia_stream.Runtime.create(kazeia_stream.load_model(tiny_gguf("custom_voice")[0]))
    async with fresh.open(voice="ryan", seed=5) as tts:
        utterance = tts.speak(TEXT)
        with trio.fail_after(30):
            while not generated.is_set():
                await trio.sleep(0.01)
        assert not loaded.is_set() and utterance.metrics.first_audio is None
        loaded.set()
        pcm = await collect(utterance)
    async with runtime.open(voice="ryan", seed=5) as tts:
        assert same_audio(pcm, await collect(tts.speak(TEXT)))


class _Watched:
    """A lock that notes, when trio's thread takes it, whether a Ctrl-C would wait meanwhile."""

    def __init__(self, lock, protected: list[bool]) -> None:
        self.lock, self.protected = lock, protected

    def __enter__(self):
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:  # an engine thread
            pass
        else:
            self.protected.append(trio.lowlevel.currently_ki_protected())
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)

    def __getattr__(self, name):  # wait, notify_all: the engine threads'
        return getattr(self.lock, name)


async def test_trio_s_thread_holds_the_engines_locks_only_where_a_ctrl_c_waits(runtime, monkeypatch):
    """A KeyboardInterrupt between taking a lock and entering its block would leave it held
    and hang the engine thread and the exit (a SIGTERM while writing a file did)."""
    protected: list[bool] = []
    for passes in (runtime.generator, runtime.decoder):
        monkeypatch.setattr(passes, "_cond", _Watched(passes._cond, protected))
    monkeypatch.setattr(runtime.admission, "_lock", _Watched(runtime.admission._lock, protected))
    async with runtime.open(voice="ryan", seed=5) as tts:
        await collect(tts.speak(TEXT))
        with trio.move_on_after(0.05):  # cancelled while it waits: its request is withdrawn
            await collect(tts.speak(TEXT))
    assert len(protected) > 10 and all(protected)


def test_synthesize_from_the_event_loop_thread_while_a_session_speaks_is_refused(runtime):
    async def main():
        async with runtime.open(voice="ryan", seed=5) as tts:
            utterance = tts.speak(TEXT)
            await utterance.__aiter__().__anext__()
            with pytest.raises(UsageError, match="busy"):
                runtime.synthesize("Hi.", voice="ryan")
            utterance.cancel()

    trio.run(main)


async def test_iterating_an_utterance_cancels_the_earlier_ones_nobody_iterates(runtime, offline):
    async with runtime.open(voice="ryan", seed=5) as tts:
        abandoned = tts.speak(TEXT * 3)
        with trio.fail_after(30):
            assert same_audio(await collect(tts.speak(TEXT)), offline)
        assert abandoned.metrics.cancelled and abandoned.done.is_set()


async def test_cancelling_a_finished_utterance_changes_nothing(runtime):
    async with runtime.open(voice="ryan", seed=5) as tts:
        utterance = tts.speak("Hi.")
        await collect(utterance)
        utterance.cancel()
        tts.cancel()  # nothing is speaking
        assert not utterance.metrics.cancelled
