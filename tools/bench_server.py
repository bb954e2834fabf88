#!/usr/bin/env python3
"""Load a running `kazeia-stream serve` with 1, 2, 4... concurrent clients.

Each client sends `--requests` OpenAI speech requests one after the other (pcm, streamed) and
times the first audio byte from the moment it sent the request (queueing included). Prints one
JSON line per concurrency: clients, requests, ttfa_s_p50, ttfa_s_p95, aggregate_audio_s_per_s
(all the audio received / the wall time of the round), rtf_per_stream (median wall / audio of a
request), errors.

    kazeia-stream serve --model M --port 8000 &
    python tools/bench_server.py http://127.0.0.1:8000 --clients 1,2,4 --requests 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import httpx
import trio

TEXT = "The quick brown fox jumps over the lazy dog, and then it rests."
BYTES_PER_SECOND = 24000 * 2  # pcm: s16le, 24 kHz, mono


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_request(
    client: httpx.AsyncClient, url: str, voice: str | None, seed: int
) -> tuple[float, float, float]:
    """(time to first audio, audio seconds, wall seconds) of one streamed request."""
    body = {"model": "tts-1", "input": TEXT, "response_format": "pcm", "seed": seed}
    if voice:
        body["voice"] = voice
    start = time.perf_counter()
    ttfa, size = None, 0
    async with client.stream("POST", url + "/v1/audio/speech", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')}")
        async for piece in r.aiter_bytes():
            if ttfa is None and piece:
                ttfa = time.perf_counter() - start
            size += len(piece)
    wall = time.perf_counter() - start
    return ttfa or wall, size / BYTES_PER_SECOND, wall


async def round_of(url: str, clients: int, requests: int, voice: str | None) -> dict[str, object]:
    results: list[tuple[float, float, float]] = []
    errors: list[str] = []

    async def client_loop(i: int) -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            for k in range(requests):
                try:
                    results.append(await one_request(client, url, voice, 100 * i + k))
                except (httpx.HTTPError, RuntimeError) as e:
                    errors.append(str(e))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(clients):
            nursery.start_soon(client_loop, i)
    wall = time.perf_counter() - start
    ttfas = [r[0] for r in results]
    return {
        "clients": clients,
        "requests": len(results),
        "ttfa_s_p50": round(percentile(ttfas, 0.5), 3) if ttfas else None,
        "ttfa_s_p95": round(percentile(ttfas, 0.95), 3) if ttfas else None,
        "aggregate_audio_s_per_s": round(sum(r[1] for r in results) / wall, 3),
        "rtf_per_stream": round(statistics.median(r[2] / r[1] for r in results if r[1]), 2)
        if results
        else None,
        "errors": len(errors),
    }


async def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    ap.add_argument(
        "--clients", default="1,2,4", help="concurrencies to run, comma-separated (default 1,2,4)"
    )
    ap.add_argument("--requests", type=int, default=2, help="requests per client (default 2)")
    ap.add_argument("--voice", help="voice name (default: the server's first)")
    args = ap.parse_args(argv)
    async with httpx.AsyncClient() as client:
        await one_request(client, args.url.rstrip("/"), args.voice, 0)  # warm the server up
    for clients in (int(c) for c in args.clients.split(",")):
        print(
            json.dumps(await round_of(args.url.rstrip("/"), clients, args.requests, args.voice)), flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(main))
