"""Many utterances through one session: resident memory, open files and threads must stay flat.

    python tools/soak.py MODEL [--utterances 1000] [--every 100]

Each utterance is a short sentence capped at a few frames (the cost is in the session's
machinery, not in the model); every `--every` utterances one line gives the count, RSS (MB),
open file descriptors and threads of this process, and the rate.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import trio

import kazeia_stream

TEXTS = ["Hello there.", "How are you today?", "The weather is nice, isn't it?", "Goodbye!"]


def figures() -> tuple[float, int, int]:
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return (
        rss_pages * os.sysconf("SC_PAGE_SIZE") / 1e6,
        len(os.listdir("/proc/self/fd")),
        threading.active_count(),
    )


async def soak(runtime: kazeia_stream.Runtime, utterances: int, every: int) -> None:
    start = time.perf_counter()
    async with runtime.open(voice=runtime.model.default_voice, seed=0, max_frames=4) as tts:
        for i in range(1, utterances + 1):
            async for _chunk in tts.speak(TEXTS[i % len(TEXTS)]):
                pass
            if i % every == 0 or i == 1:
                rss, fds, threads = figures()
                rate = i / (time.perf_counter() - start)
                line = f"{i:6d} utterances  RSS {rss:8.1f} MB  fds {fds:3d}  threads {threads:3d}"
                print(f"{line}  {rate:6.1f}/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--utterances", type=int, default=1000)
    ap.add_argument("--every", type=int, default=100)
    args = ap.parse_args()
    runtime = kazeia_stream.Runtime(kazeia_stream.load_model(args.model))
    trio.run(soak, runtime, args.utterances, args.every)


if __name__ == "__main__":
    main()
