#!/usr/bin/env python3
"""The most audio N streams can get from this machine's cores, from the engines' work alone:
what `kazeia-stream bench --streams N` measures through the schedule, against what any
schedule could reach.

A round is one generator pass over the N streams (a talker step and the code predictor's
passes, on N rows) and the decoder's passes over the same N stream-frames. The decoder runs on
its own threads (D seconds a round); the generator takes the other cores while it runs
(G_beside a round) and every core while it waits (G_all; or only the others, where they run it
faster, as two threads can be slower than one on a tiny model, and W would then come out
negative). With no core ever idle, a round takes at least W = G_all + D (1 - G_all /
G_beside): while the decoder works, the generator does D / G_beside of a round, and the rest
on every core (with no core beside the decoder's, G_beside is infinite: W = G_all + D). Each
engine is timed alone, in turn, on random inputs (the decoder pushes `MAX_PUSH` frames a
stream, as it does once behind); the engines slow each other where they share the memory, so
the bound is an upper one, to the host's noise.

    python tools/streams_bound.py --model M [--streams 4] [--repeat 5]

Prints a line a round (G_beside, G_all, D, W in ms; the bound in audio seconds a second) and
their medians.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import numpy as np

import kazeia_stream
from kazeia_stream.engine.sampler import CodeSampler
from kazeia_stream.model.config import Sampling
from kazeia_stream.runtime import Runtime
from kazeia_stream.stages.decoder import MAX_PUSH

POSITION = 64  # the talker's step position: a short prompt and a few frames in


def timed(run: Callable[[], object], times: int = 4) -> float:
    """The median seconds of `times` calls."""
    spent = []
    for _ in range(times):
        start = time.perf_counter()
        run()
        spent.append(time.perf_counter() - start)
    return statistics.median(spent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5, help="rounds of the three timings (default 5)")
    args = ap.parse_args()
    runtime = Runtime(kazeia_stream.load_model(args.model), max_streams=args.streams)
    talker, predictor, codec = runtime.talker, runtime.code_predictor, runtime.codec
    n, cores, decoder_threads = args.streams, runtime.threads.talker, runtime.threads.decoder
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((n, predictor.talker_hidden), dtype=np.float32)
    for seq in range(n):
        predictor.build_graphs(seq)

    def generate(threads: int) -> Callable[[], object]:
        def run() -> object:
            talker.set_threads(threads)
            predictor.set_threads(threads)
            talker.lm.forward_many([(seq, hidden[seq][None], POSITION) for seq in range(n)])
            samplers = [CodeSampler(Sampling(), np.random.default_rng(seq)) for seq in range(n)]
            return predictor.predict_many(hidden, list(range(n)), samplers)

        return run

    states = [codec.new_state() for _ in range(n)]
    shape = (n, MAX_PUSH, codec.num_groups)

    def decode() -> object:
        codes = rng.integers(0, codec.quantizer.codebook_size, shape)
        return codec.push_many(states, list(codes), threads=decoder_threads)

    beside = generate(cores - decoder_threads) if cores > decoder_threads else None
    every = generate(cores)
    for warm in (beside, every, decode):
        if warm is not None:
            warm()
    audio_s = n * codec.samples_per_frame / runtime.model.sample_rate
    rounds = []
    for _ in range(args.repeat):
        g_beside = timed(beside) if beside is not None else math.inf
        g_all, d = min(timed(every), g_beside), timed(decode) / MAX_PUSH
        w = g_all + d * (1 - g_all / g_beside)
        rounds.append((g_beside, g_all, d, w))
        print(f"{times_ms(*rounds[-1])} a round of {n} stream-frames: {bound(audio_s, w)}", flush=True)
    medians = [statistics.median(column) for column in zip(*rounds)]
    print(f"medians: {times_ms(*medians)}: {bound(audio_s, medians[-1])} ({cores} cores, {n} streams)")


def times_ms(g_beside: float, g_all: float, d: float, w: float) -> str:
    """A round's times (seconds) as the lines print them."""
    return f"G_beside {g_beside * 1e3:.0f}, G_all {g_all * 1e3:.0f}, D {d * 1e3:.0f}, W {w * 1e3:.0f} ms"


def bound(audio_s: float, w: float) -> str:
    """The audio a round of W seconds allows."""
    return f"at most {audio_s / w:.3f} audio s per s"


if __name__ == "__main__":
    main()
