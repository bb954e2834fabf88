"""CPU threads: how many each engine uses (one type, one place for the defaults), and the
cores the ggml graphs' calls lend to the codec decoder running beside them."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError

# The codec decoder's GEMMs are many and small: OpenBLAS threads spinning after each one take
# the core that ggml's threads need beside it (a second BLAS thread made the next talker
# step ~2x slower), so it runs on one core, except for the first frame's decode, which runs
# alone on every core.
DECODER_THREADS = 1

# libgomp (the bundled ggml's OpenMP) keeps a pool of worker threads for each OS thread that has
# run a graph on several threads, for as long as that thread lives; once the pools' threads
# outnumber the cores it stops spinning at barriers, and ggml's threads meet at one after every
# operation: each barrier then sleeps and wakes (on 2 cores, the code predictor's passes took 2x
# as long beside a second pool, 4x beside a third). So one thread runs graphs on several
# threads, the generator's (talker and code predictor); the codec decoder's graphs run on one
# whatever its BLAS threads.
DECODER_GGML_THREADS = 1


def _affinity() -> set[int]:
    """The CPUs this process may run on; empty where the system does not say (not Linux)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, not the host's count)."""
    return len(_affinity()) or os.cpu_count() or 1


@dataclass(frozen=True)
class Threads:
    """CPU threads per engine. The talker and the code predictor alternate, so both can use
    every core; the codec decoder overlaps with them in the streaming pipeline."""

    talker: int
    code_predictor: int
    decoder: int = DECODER_THREADS

    def __post_init__(self) -> None:
        cores = available_cores()
        for name in ("talker", "code_predictor", "decoder"):
            n = getattr(self, name)
            if not 1 <= n <= cores:
                raise UsageError(
                    f"{name} threads must be between 1 and {cores} (this machine's cores), not {n}"
                )

    @classmethod
    def default(cls) -> Threads:
        """Every core for the talker and the code predictor."""
        n = available_cores()
        return cls(talker=n, code_predictor=n)

    @classmethod
    def uniform(cls, n: int) -> Threads:
        """`n` threads for the talker and the code predictor (`--threads N`)."""
        return cls(talker=n, code_predictor=n)

    @property
    def cores(self) -> int:
        """The cores the engines were given."""
        return max(self.talker, self.code_predictor)


class OthersLoad:
    """How many of this process's cores others kept busy lately (other processes, and on a
    virtual machine the host's steal): the kernel's busy time on those cores (Linux'
    /proc/stat) less this process's own CPU time, per second of wall time, over windows of at
    least `WINDOW_S`. Processes niced more than this one barely take a core from it and are
    not counted (unless it is niced itself: its own time is then counted there). Where
    /proc/stat cannot be read nothing is known: 0."""

    WINDOW_S = 0.25

    def __init__(self) -> None:
        self._cpus = {f"cpu{i}".encode() for i in _affinity()}
        self._nice = hasattr(os, "getpriority") and os.getpriority(os.PRIO_PROCESS, 0) > 0
        self._lock = threading.Lock()
        self._last = self._sample()
        self.cores = 0.0

    def _sample(self) -> tuple[float, float, float] | None:
        """(wall s, the cores' busy s, this process's CPU s), or None where unknown."""
        try:
            with open("/proc/stat", "rb") as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        busy = 0
        for line in lines:
            fields = line.split()
            if fields and fields[0] in self._cpus:
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
                busy += user + system + irq + softirq + steal + (nice if self._nice else 0)
        return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), time.process_time()

    def refresh(self) -> float:
        """The cores others used in the latest window, a new window begun if the last is
        `WINDOW_S` old (cheap otherwise: a clock read)."""
        last = self._last
        if last is None or time.monotonic() - last[0] < self.WINDOW_S or not self._lock.acquire(False):
            return self.cores
        try:
            now = self._sample()
            if now is not None:
                wall, busy, own = (b - a for a, b in zip(last, now))
                self.cores, self._last = max(0.0, (busy - own) / wall), now
        finally:
            self._lock.release()
        return self.cores


class SharedCores:
    """The cores that the ggml graphs' calls (talker, code predictor) share with the codec
    decoder running beside them, and with other processes.

    ggml's threads meet at a barrier after every operation, so one thread waiting for a core
    that someone else holds stalls all the others; each call runs with as many threads fewer as
    cores are held. The decoder's pass holds its cores while it runs (measured on 2 cores, one
    core lent: ~7% less wall time per frame in the pipeline); a decode asked for and not yet
    begun holds them too (`asked`): the graph call that starts meanwhile (the next frame's
    talker step, asked for at the same moment) would otherwise run its whole step on too many
    threads beside the decode. While an utterance's first frame is decoded with no other stream
    running, nothing else can be heard before it: its pass takes every core and the graph calls
    that start meanwhile wait for it (`alone`; on a 2-core AMD Zen 1, `bench
    --frames 20 --pipeline --repeat 3`, three alternated pairs: first audio 0.42 / 0.33 / 0.35
    s against 0.45 / 0.37 / 0.37 s, the same RTF). Cores that other processes keep busy are
    held likewise (`OthersLoad`): beside one process spinning on one of 2 cores, a 40-frame
    run took 2.4x its quiet time with the generator on 2 threads, 1.5-1.8x on one.

    A core is held from a reading of half a core, and given back only once the reading falls
    below `GIVE_BACK`: what others get is less than they ask while our threads run beside them
    (that spinning process read 0.53-1.02 of a core in 0.25 s windows beside the generator and
    the decoder, 0.0-0.1 once it stopped), and one window read under half a core would put the
    generator back on 2 threads, where the process then gets even less.
    """

    GIVE_BACK = 0.35  # of a core others held, the reading below which it is theirs no more
    # how long an utterance's beginning holds the decoder's passes back at most (`give_way`):
    # a joining stream's prefill step and first frame take 60-100 ms on 2 cores
    GIVE_WAY_S = 0.25

    def __init__(self, count: int, others: OthersLoad | None = None) -> None:
        self.count = count  # the cores the engines were given
        self.lent = 0  # held by the decoder's pass running
        self._asked = 0  # set aside for a decode that waits for its pass (`asked`)
        self.others = others or OthersLoad()
        self._taken = 0  # the cores others held at the last reading
        self._alone = 0  # passes running that the graphs' calls wait for
        self._beginnings: list[float] = []  # when each utterance now `beginning` began
        self._giving_way = False  # the decoder's pass holds no cores meanwhile (`give_way`)
        self._generating = False  # a graph call runs or is asked for (`generating`)
        self._changed = threading.Condition()
        # how often the cores were lent, given back, set aside or taken alone, or a stream came
        # to begin (`changed`): the code predictor's steps in C run until it moves (code_step)
        self.changes = np.zeros(1, np.int64)

    def changed(self) -> None:
        """Something that may change a graph call's threads, or a stream that waits to begin
        between the code predictor's steps (the generator's scheduler)."""
        self.changes[0] += 1

    @property
    def asked(self) -> int:
        return self._asked

    @asked.setter
    def asked(self, n: int) -> None:
        if n != self._asked:  # set again to the same (`Decoder._unask`): no change
            self._asked = n
            self.changed()

    def taken(self) -> int:
        """The cores other processes hold now, of those the engines were given (all but one)."""
        load = self.others.refresh()
        held = math.floor(load + 0.5)
        if held < self._taken:
            held = min(self._taken, math.floor(load + 1 - self.GIVE_BACK))
        self._taken = min(self.count - 1, held)
        return self._taken

    def threads(self, wanted: int) -> int:
        """Threads for a graph call that wants `wanted`, once no pass that runs alone does."""
        with self._changed:
            self._changed.wait_for(lambda: not self._alone)
        held = 0 if self._giving_way else max(self.lent, self.asked)
        return max(1, wanted - held - self.taken())

    @contextmanager
    def beginning(self) -> Iterator[None]:
        """While the block runs, an utterance's first frame is generated: the decoder's passes
        over other streams' later frames give way to it (`give_way`) for `GIVE_WAY_S` at most."""
        began = time.monotonic()
        with self._changed:
            self._beginnings.append(began)
        try:
            yield
        finally:
            with self._changed:
                self._beginnings.remove(began)
                self._changed.notify_all()

    def give_way(self, first_asked: Callable[[], bool]) -> None:
        """At a boundary of the decoder's pass over later frames (before it, between two of its
        streams' frames): while an utterance is `beginning`, for `GIVE_WAY_S` from its start,
        and no first frame is asked for decoding (`first_asked()`; its asking calls `wake`),
        the pass waits, and the graphs' calls take the cores it holds or has set aside. A
        stream joining three others on 2 cores otherwise made its first frame on one core, the
        prefill's step and the code predictor's passes taking 120 ms instead of about 65; a
        longer prefill (a cloned voice's reference frames) holds the others' audio back no
        longer than that."""

        def left() -> float:
            return max(self._beginnings, default=-math.inf) + self.GIVE_WAY_S - time.monotonic()

        with self._changed:
            if first_asked() or left() <= 0:
                return
            self._giving_way = True
            self.changed()
            try:
                while not first_asked() and (wait := left()) > 0:
                    self._changed.wait(wait)
            finally:
                self._giving_way = False
                self.changed()

    def wake(self) -> None:
        """Something a pass waits for in `give_way` may have changed."""
        with self._changed:
            self._changed.notify_all()

    def generating(self, busy: bool) -> None:
        """Whether the generator has work (a pass or a call, running or asked for); while it has
        none, a decoder's pass may take its cores (`spare`)."""
        self._generating = busy

    @contextmanager
    def spare(self, own: int) -> Iterator[Callable[[], int]]:
        """For the decoder's pass, which holds `own` cores: while the block runs, the callable,
        called at each of the pass's boundaries, holds every other core that others do not
        while the generator has no work, gives them back once it has, and returns the threads
        the pass may run until its next boundary. Four streams that end together left the
        generator idle while one core decoded the frames queued up for 0.36-0.41 s; on two
        threads 0.29-0.31 s (a throw-away trace, 2 cores). A graph call that starts before the
        boundary runs on a thread the fewer (`threads`)."""
        held = 0

        def now() -> int:
            nonlocal held
            wanted = 0 if self._generating else max(0, self.free() - own)
            if wanted != held:
                self._move(wanted - held)
                held = wanted
            return own + held

        try:
            yield now
        finally:
            if held:
                self._move(-held)

    def free(self) -> int:
        """The cores a pass alone may take: those that others do not hold."""
        return self.count - self.taken()

    def lend(self, n: int) -> AbstractContextManager[int]:
        """Take `n` cores away from the graphs' calls while the block runs (yields n)."""
        return self._hold(n, alone=False)

    def alone(self) -> AbstractContextManager[int]:
        """Take every core that others do not hold while the block runs, the graphs' calls
        that start meanwhile waiting for it to end (yields the cores taken)."""
        return self._hold(self.free(), alone=True)

    @contextmanager
    def _hold(self, n: int, alone: bool) -> Iterator[int]:
        self._move(n, alone)
        try:
            yield n
        finally:
            self._move(-n, -alone)

    def _move(self, lent: int, alone: int = 0) -> None:
        """The cores lent (and the passes that run alone) change by these: the graphs' calls,
        and the passes waiting for them, see it."""
        with self._changed:
            self.lent += lent
            self._alone += alone
            self.changed()
            self._changed.notify_all()
