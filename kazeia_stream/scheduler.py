"""The engines' schedule: every stream's frames generated and decoded in shared passes.

A runtime's streams (utterances being spoken, from any session, thread or server request) do
not take turns for a whole utterance: each asks for its next frame, and a generator thread runs
one pass (`FrameLoop.next_frames`: one talker decode and one set of code-predictor passes) over
every stream that asked since the last pass; a decoder thread likewise decodes the next frame of
every stream that has one in one `CodecDecoder.push_many`. A pass over several streams reads
each weight from memory once for all of them (the first stream's product leaves it in the cache
for the others', see `Qwen3LM._product`), and no stream waits for another's whole utterance.

- Admission: at most `max_streams` streams hold talker slots; the others wait in order (FIFO).
- Continuous batching: a stream joins or leaves between passes; a pass waits up to `GATHER_S`
  for the streams of the previous pass to ask again, so that they stay in step.
- First audio first: a stream that has not begun does not wait for the pass running to end:
  it begins at that pass's next engine call boundary (after the talker's step, or between two
  code-predictor passes), with one prefill piece and, when that was its last, its first frame;
  that frame is decoded in a pass of its own, ahead of other streams' later frames (or, when
  the decoder is in a pass over later frames, at its next boundary: between two of its
  streams' frames, whose later blocks run stream by stream), on every core, so that its time
  to first audio stays short. Until it is asked for, such a pass waits at that boundary and
  its cores go to the generator (`SharedCores.give_way`).
- Calls that need the engines alone (a session's prefix rows, a voice's decoder priming) run
  between passes, in the engines' thread.

Callers wait in a thread (`*_sync`) or in a trio task; a cancelled task withdraws its request
(a pass that already took it finishes, and its result is dropped). Each engine's thread lives
as long as its engine (`_serve`), and ends at interpreter exit once its pass in flight has
ended (`_stop_all`).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import trio

from .engine.codec import CodecDecoder, DecoderState
from .engine.frames import FrameLoop, FrameState
from .engine.threads import SharedCores
from .model.prompt import Prompt

# How long a pass waits for the streams of the previous pass to ask again (their tasks hand the
# frame on first): much less than a pass (>= 0.1 s), enough for a thread or task switch.
GATHER_S = 0.004
IDLE_CHECK_S = 1.0  # how often an idle engine thread looks whether its engine is still held

T = TypeVar("T")
R = TypeVar("R")
Item = TypeVar("Item")


@dataclass
class PassStats:
    """How full the passes were: passes run, streams served over all of them, the most in one;
    and the seconds the thread worked, in passes and in the calls between them (against wall
    time: whether this engine is the one that limits the others)."""

    passes: int = 0
    served: int = 0
    widest: int = 0
    busy_s: float = 0.0

    def add(self, n: int) -> None:
        self.passes += 1
        self.served += n
        self.widest = max(self.widest, n)


class _Result(Generic[T]):
    """A value handed from an engine thread to a caller waiting in a thread or a trio task."""

    def __init__(self, in_trio: bool) -> None:
        self._done = threading.Event()
        self._trio = (trio.lowlevel.current_trio_token(), trio.Event()) if in_trio else None
        self.value: T | None = None
        self.error: BaseException | None = None

    def set(self, value: T | None = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error
        self._done.set()
        if self._trio is not None:
            token, event = self._trio
            with contextlib.suppress(trio.RunFinishedError):  # the waiter's event loop has gone
                token.run_sync_soon(event.set)

    def _get(self) -> T:
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]

    def wait(self) -> T:
        self._done.wait()
        return self._get()

    async def wait_async(self) -> T:
        assert self._trio is not None
        await self._trio[1].wait()
        return self._get()


_Call = tuple[Callable[[], Any], _Result[Any]]  # a call between passes, and where its result goes


class _Passes(Generic[Item, T]):
    """A thread that runs passes over the items queued since the last pass, and calls that
    need the engines alone between them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition()
        self._queue: list[tuple[Item, _Result[T]]] = []
        self._calls: deque[_Call] = deque()
        self._running: list[Item] = []
        self._expected: Sequence[object] = []  # streams of the last pass that go on
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.stats = PassStats()
        _live.add(self)

    # -- callers --------------------------------------------------------------------------------
    # Those that take the thread's lock from trio's thread are KI-protected: a Ctrl-C (or the
    # CLI's SIGTERM, raised as one) between taking a lock and entering its `with` block would
    # leave it held for good, and the engine thread, then the exit, would wait on it forever
    # (seen: a SIGTERM while writing a file hung the CLI at exit, in one CI run of six).

    @trio.lowlevel.enable_ki_protection
    def _submit(self, item: Item, result: _Result[T]) -> None:
        with self._cond:
            self._queue.append((item, result))
            self._wake()

    @trio.lowlevel.enable_ki_protection
    def _withdraw(self, result: _Result[T]) -> None:
        with self._cond:
            self._queue = [(i, r) for i, r in self._queue if r is not result]

    async def _ask(self, item: Item) -> T:
        result: _Result[T] = _Result(in_trio=True)
        self._submit(item, result)
        try:
            return await result.wait_async()
        except BaseException:
            self._withdraw(result)
            raise

    def _ask_later(self, item: Item) -> _Result[T]:
        """Ask from a thread without waiting: `wait()` for the result later, or withdraw it."""
        result: _Result[T] = _Result(in_trio=False)
        self._submit(item, result)
        return result

    def call(self, fn: Callable[[], R]) -> R:
        """Run `fn` in the engines' thread between passes, and wait for it (from a thread)."""
        return self.start_call(fn).wait()

    def start_call(self, fn: Callable[[], R]) -> _Result[R]:
        """Run `fn` in the engines' thread between passes; its result, to wait for later."""
        result: _Result[R] = _Result(in_trio=False)
        with self._cond:
            self._calls.append((fn, result))
            self._wake()
        return result

    def _wake(self) -> None:
        if self._thread is None and not self._stopping:
            serve = threading.Thread(target=_serve, args=(weakref.ref(self),), name=self.name, daemon=True)
            self._thread = serve
            serve.start()
        self._cond.notify_all()

    # -- the thread -----------------------------------------------------------------------------

    def _work(self) -> _Call | list[tuple[Item, _Result[T]]] | None:
        """The next call, or the next pass's batch; None when there is nothing to do (under the
        lock)."""
        if self._calls:
            return self._calls.popleft()
        if not self._queue:
            return None
        self._gather()
        batch = self._take()
        self._running = [item for item, _ in batch]
        self.stats.add(len(batch))
        return batch

    def _run(self, work: _Call | list[tuple[Item, _Result[T]]]) -> None:
        """Run a call or a pass; its error goes to its caller, or to every stream of the pass."""
        start = time.perf_counter()
        try:
            if isinstance(work, tuple):
                fn, result = work
                result.set(fn())
            else:
                self._pass(work)
        except BaseException as exc:
            for result in [work[1]] if isinstance(work, tuple) else [r for _, r in work]:
                result.set(error=exc)
        finally:
            with self._cond:
                self._running = []
                self.stats.busy_s += time.perf_counter() - start

    def stop(self) -> None:
        """Run no more passes or calls, and wait for the one in flight to end."""
        with self._cond:
            self._stopping = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None:
            thread.join()

    def _gather(self) -> None:
        """Wait (briefly) for the streams of the last pass that go on to ask again."""
        deadline = time.monotonic() + GATHER_S
        while (left := deadline - time.monotonic()) > 0:
            queued = {id(self._stream(item)) for item, _ in self._queue}
            if all(id(stream) in queued for stream in self._expected):
                return
            self._cond.wait(left)

    def _stream(self, item: Item) -> object:
        """The stream an item belongs to."""
        return item

    def _take(self) -> list[tuple[Item, _Result[T]]]:
        batch, self._queue = self._queue, []
        return batch

    def _pass(self, batch: list[tuple[Item, _Result[T]]]) -> None:
        raise NotImplementedError


_live: weakref.WeakSet[_Passes[Any, Any]] = weakref.WeakSet()


def _serve(ref: weakref.ref[_Passes[Any, Any]]) -> None:
    """An engine's thread: its calls and passes, for as long as the engine is held or stopped.
    It holds the engine only while it works, so that an engine nobody holds is collected (its
    thread then ends within `IDLE_CHECK_S`). One thread for the engine's life keeps the C heap's
    arena its buffers come from: a decoder thread started anew for each utterance took another
    thread's arena, and its first frame faulted in 4,500 pages of buffers (5-9 ms of the first
    audio on Zen 4) that the arena it had kept (`heap`) held already."""
    engine = ref()
    if engine is None:
        return
    cond = engine._cond
    del engine
    while True:
        with cond:
            while True:
                engine = ref()
                if engine is None:
                    return
                if engine._stopping:
                    engine._thread = None
                    return
                work = engine._work()
                if work is not None:
                    break
                del engine
                cond.wait(IDLE_CHECK_S)
        engine._run(work)
        del engine, work


@atexit.register
def _stop_all() -> None:
    """At interpreter exit, before daemon threads are frozen and the C libraries torn down:
    an engine thread still in a pass is inside libggml or BLAS, and the process would crash
    (SIGSEGV in libggml-cpu, seen when a `--pipe` reader closed stdout mid-utterance) if their
    state went away under it. So each ends its pass first."""
    for passes in list(_live):
        passes.stop()


_Frames = list[tuple[FrameState, _Result["np.ndarray | None"]]]  # streams and their waiters


class Generator(_Passes[FrameState, "np.ndarray | None"]):
    """Frames of every stream, in shared passes of the frame loop."""

    def __init__(self, frames: FrameLoop, cores: SharedCores) -> None:
        super().__init__("kazeia-generator")
        self.frames, self.cores = frames, cores
        self._others = False  # the pass being taken leaves other streams waiting
        self._going: list[FrameState] = []  # streams of the pass that go on

    @trio.lowlevel.enable_ki_protection
    def _submit(self, item: FrameState, result: _Result[np.ndarray | None]) -> None:
        self.cores.generating(True)
        super()._submit(item, result)
        if item.prefill is None:  # it has not begun: a pass's steps in C let it in (`_between`)
            self.cores.changed()

    @trio.lowlevel.enable_ki_protection  # called from trio's thread too (`_Passes._submit`)
    def start(self, *args: Any) -> FrameState:
        """`FrameLoop.start` (takes a talker slot)."""
        with self._cond:
            return self.frames.start(*args)

    @trio.lowlevel.enable_ki_protection
    def finish(self, state: FrameState) -> None:
        """The stream has ended or left: its slot is free at once (a pass that holds it still
        ends it; the slot's next stream starts from its prefill in a later pass)."""
        with self._cond:
            self.frames.finish(state)

    def prepare(self, prompt: Prompt) -> None:
        """Compute a session's fixed rows ahead, between passes, in a slot free at that moment
        (none: its utterances will); at once when a free slot keeps them already, without
        waiting for the pass running to end. A stream that takes the slot meanwhile begins in
        a later pass, which keeps or recomputes the rows."""
        with self._cond:
            if self.frames.prepared(prompt):
                return

        def prepare() -> None:
            with self._cond:
                seq = self.frames.slot_for(prompt, take=False)
            if seq is not None:
                self.frames.prepare(prompt, seq)

        self.call(prepare)

    async def next_frame(self, state: FrameState) -> np.ndarray | None:
        """The stream's next frame (`FrameLoop.next_frame`), from the next pass it is in."""
        return await self._ask(state)

    def next_frame_later(self, state: FrameState) -> _Result[np.ndarray | None]:
        """Ask for the stream's next frame from a thread without waiting for it, so that it is
        generated while the caller decodes the last one: `wait()` for it, or `forget` it."""
        return self._ask_later(state)

    def forget(self, asked: _Result[np.ndarray | None]) -> None:
        """Withdraw a frame asked for and no longer wanted (a pass that took it ends it)."""
        self._withdraw(asked)

    def _work(self) -> _Call | _Frames | None:
        work = super()._work()
        self.cores.generating(work is not None)  # none: the decoder may take its cores
        return work

    def _take(self) -> _Frames:
        """Streams that have begun, whose pass takes the others in at its first call boundary
        (`_between`); streams that have not begun alone, when no other stream is queued."""
        begun, self._queue = self._partition()
        if not begun:
            begun, self._queue = self._queue, []
            self._others = bool(self._expected)
        return begun

    def _partition(self) -> tuple[_Frames, _Frames]:
        """The queued streams that have begun, and those that have not."""
        begun = [(s, r) for s, r in self._queue if s.prefill is not None]
        return begun, [(s, r) for s, r in self._queue if s.prefill is None]

    def _pass(self, batch: _Frames) -> None:
        self._going = []
        states = [state for state, _ in batch]
        self._serve(batch, self.frames.next_frames(states, self._others, self._between))
        self._others = False
        with self._cond:
            self._expected = self._going

    def _between(self, first_seq: int) -> None:
        """Between two engine calls of a pass: streams that have not begun yet begin, so that
        their first frame comes ahead of the others' later ones (a pass over them there: one
        prefill piece each and, when that was the last, their first frame), in the code
        predictor's sequences from `first_seq` on (a stream that left during the pass may have
        handed its talker slot on: the ones that do not fit wait)."""
        room = self.frames.code_predictor.max_streams - first_seq
        with self._cond:
            begun, new = self._partition()
            if not new[:room]:
                return
            new, self._queue = new[:room], begun + new[room:]
        states = [state for state, _ in new]
        self._serve(new, self.frames.next_frames(states, others=True, first_seq=first_seq))

    def _serve(self, batch: _Frames, codes: list[np.ndarray | None]) -> None:
        """Hand each stream its frame; a stream still prefilling goes back to the queue's head."""
        with self._cond:
            for (state, result), c in zip(batch, codes):
                if state.prefilling and not state.done:  # no frame yet: in the next pass again
                    self._queue.insert(0, (state, result))
                else:
                    result.set(c)
                    if c is not None:
                        self._going.append(state)


class _Decode:
    """One stream's request: its decoder state and next frames' codes [n, groups]."""

    def __init__(self, state: DecoderState, codes: np.ndarray, first: bool) -> None:
        self.state, self.codes, self.first = state, codes, first


class Decoder(_Passes[_Decode, np.ndarray]):
    """PCM of every stream's next frames, in shared passes of the codec decoder (`codec()`,
    which a pass waits for while it loads). While a pass runs, it holds `threads` of the cores
    that the graphs' calls share (`SharedCores`)."""

    def __init__(
        self, codec: Callable[[], CodecDecoder], threads: int, cores: SharedCores, streams: Callable[[], int]
    ) -> None:
        super().__init__("kazeia-decoder")
        self.codec, self.threads, self.cores, self.streams = codec, threads, cores, streams

    async def decode(self, state: DecoderState, codes: np.ndarray, first: bool = False) -> np.ndarray:
        """The audio of the stream's next frames (codes [n, groups]); `first`: its first,
        decoded ahead of others."""
        return await self._ask(_Decode(state, codes, first))

    @trio.lowlevel.enable_ki_protection
    def _submit(self, item: _Decode, result: _Result[np.ndarray]) -> None:
        with self._cond:
            self.cores.asked = self.threads
            super()._submit(item, result)
        if item.first:  # a pass giving way to beginning utterances decodes it (`give_way`)
            self.cores.wake()

    @trio.lowlevel.enable_ki_protection
    def _withdraw(self, result: _Result[np.ndarray]) -> None:
        with self._cond:
            super()._withdraw(result)
            self._unask()

    def _take(self) -> list[tuple[_Decode, _Result[np.ndarray]]]:
        """First frames alone when there are any, else every queued frame."""
        return self._take_firsts() or super()._take()

    def _take_firsts(self) -> list[tuple[_Decode, _Result[np.ndarray]]]:
        """The queued first frames, out of the queue (under the lock)."""
        firsts = [(d, r) for d, r in self._queue if d.first]
        if firsts:
            self._queue = [(d, r) for d, r in self._queue if not d.first]
        return firsts

    def _first_asked(self) -> bool:
        """Whether a first frame waits for its decode. Read under the cores' lock, not the
        queue's (`give_way`): a first frame appended meanwhile is seen at the `wake` that
        follows it."""
        return any(d.first for d, _ in self._queue)

    def _unask(self) -> None:
        """No cores set aside for a decode that waits for its pass, when none does (under the
        lock)."""
        if not self._queue:
            self.cores.asked = 0

    def _pass(self, batch: list[tuple[_Decode, _Result[np.ndarray]]]) -> None:
        # a first frame with no other stream running gets every core, the generator waiting:
        # nothing else can be heard before it
        alone = all(d.first for d, _ in batch) and self.streams() <= len(batch)
        codec = self.codec()
        served = list(batch)
        with (
            self.cores.alone() if alone else self.cores.lend(self.threads) as threads,
            self.cores.spare(threads) as spare,
        ):
            with self._cond:
                self._unask()

            def between(use: Callable[[int], None]) -> None:
                """At the start of a pass over later frames and between two of its streams'
                frames: it gives way while an utterance begins (`SharedCores.give_way`), and
                first frames asked for since it began are decoded now, not after it (a stream
                joining others is heard up to a pass sooner; the pass's later streams wait that
                long), on its own threads meanwhile (a helper of its products would spin beside
                the cores it leaves to others); its next frames on more while the generator has
                no work (`SharedCores.spare`). A pass of first frames leaves them to the next,
                which takes every core when they are all the streams there are."""
                use(threads)
                self.cores.give_way(self._first_asked)
                with self._cond:
                    firsts = self._take_firsts()
                    self._unask()
                if firsts:
                    try:
                        with self.cores.alone() as every:
                            pcm = self._decode(codec, firsts, every)
                    except BaseException as exc:  # the pass's own frames get it from `_run`
                        for _, result in firsts:
                            result.set(error=exc)
                        raise
                    self._hand(firsts, pcm)
                    served.extend(firsts)
                use(spare())

            later = not any(d.first for d, _ in batch)
            pcm = self._decode(codec, batch, threads, between if later else None)
        self._hand(batch, pcm)  # once the cores are given back
        with self._cond:
            self._expected = [d.state for d, _ in served]

    @staticmethod
    def _decode(
        codec: CodecDecoder,
        batch: list[tuple[_Decode, _Result[np.ndarray]]],
        threads: int,
        between: Callable[[Callable[[int], None]], None] | None = None,
    ) -> list[np.ndarray]:
        """The batch's audio: its streams that push as many frames together (`push_many`'s
        rule), each such group after the other."""
        groups: dict[int, list[int]] = {}
        for i, (d, _) in enumerate(batch):
            groups.setdefault(len(d.codes), []).append(i)
        pcm: list[np.ndarray] = [np.empty(0, np.float32)] * len(batch)
        for group in groups.values():
            states, codes = [batch[i][0].state for i in group], [batch[i][0].codes for i in group]
            for i, audio in zip(group, codec.push_many(states, codes, threads, between)):
                pcm[i] = audio
        return pcm

    def _hand(self, batch: list[tuple[_Decode, _Result[np.ndarray]]], pcm: list[np.ndarray]) -> None:
        """Each frame of the batch its audio."""
        with self._cond:
            for (_, result), p in zip(batch, pcm):
                result.set(p)

    def _stream(self, item: _Decode) -> object:
        return item.state


class Admission:
    """At most `n` streams at once; the others wait in the order they asked (trio tasks, of
    any loop: a synchronous caller's runs on a loop of its own, `blocking`)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.active = 0
        self._lock = threading.Lock()
        self._waiting: deque[_Result[None]] = deque()

    @trio.lowlevel.enable_ki_protection  # its lock, like the passes' (`_Passes._submit`)
    def _try(self, result: _Result[None]) -> bool:
        """A place now, if one is free and nobody waits for one; else `result` waits in line."""
        with self._lock:
            if self.active < self.n and not self._waiting:
                self.active += 1
                return True
            self._waiting.append(result)
            return False

    def free(self) -> bool:
        """Whether a place is free now and nobody waits for one."""
        with self._lock:
            return self.active < self.n and not self._waiting

    @trio.lowlevel.enable_ki_protection
    async def acquire(self) -> None:
        result: _Result[None] = _Result(in_trio=True)
        if self._try(result):
            return
        try:
            await result.wait_async()
        except BaseException:
            with self._lock:
                granted = result not in self._waiting
                if not granted:
                    self._waiting.remove(result)
            if granted:
                self.release()
            raise

    @trio.lowlevel.enable_ki_protection
    def release(self) -> None:
        """A stream ended: the longest-waiting one takes its place."""
        with self._lock:
            if self._waiting:
                self._waiting.popleft().set()
            else:
                self.active -= 1
