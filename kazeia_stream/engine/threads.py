"""CPU threads: how many each engine uses (one type, one place for the defaults), and the
cores the ggml graphs' calls lend to the codec decoder running beside them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

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


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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


class SharedCores:
    """The cores that the ggml graphs' calls (talker, code predictor) share with the codec
    decoder running beside them.

    ggml's threads meet at a barrier after every operation, so one thread waiting for a core
    that the decoder holds stalls all the others; while the decoder works, each call runs with
    as many threads fewer as it holds cores (measured on 2 cores, one core lent: ~7% less wall
    time per frame in the pipeline). A decode asked for and not yet begun holds its cores too
    (`asked`): the graph call that starts meanwhile (the next frame's talker step, asked for at
    the same moment) would otherwise run its whole step on too many threads beside the decode.
    """

    def __init__(self, count: int) -> None:
        self.count = count  # the cores the engines were given
        self.lent = 0  # held by the decoder's pass running
        self.asked = 0  # set aside for a decode that waits for its pass

    def threads(self, wanted: int) -> int:
        return max(1, wanted - max(self.lent, self.asked))

    @contextmanager
    def lend(self, n: int) -> Iterator[None]:
        """Take `n` cores away from the graphs' calls while the block runs."""
        self.lent += n
        try:
            yield
        finally:
            self.lent -= n
