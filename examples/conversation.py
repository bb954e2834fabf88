"""A conversational loop: speak an LLM's reply while it is being written, and barge in; then
two agents talking at once.

    python examples/conversation.py --model MODEL_DIR [--barge-in-after 1.5] [--out-dir DIR]

The "LLM" is simulated: it yields a reply a few characters at a time, at about the pace of a
local model. Speech starts after its first words. The second reply is interrupted (barge-in)
after `--barge-in-after` seconds of audio, and the session goes straight on with the third.
Then two sessions with two voices (a CustomVoice model's first two speakers) speak over each
other, generated together on the one runtime, into the two channels of `duet.wav`. Audio is
written as WAV files, so this runs without a sound card.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import soundfile as sf
import trio

import kazeia_stream
from kazeia_stream.channels import UtteranceMetrics

REPLIES = [
    "Sure! The weather tomorrow looks sunny, with a light breeze in the afternoon.",
    "Let me tell you a long story about a lighthouse keeper who collected every shell on the "
    "beach, one for each ship that passed, until the shelves of the tower were full.",
    "Okay, stopping there. What else would you like to know?",
]


async def llm_reply(text: str, chars_per_piece: int = 4, delay: float = 0.03):
    """A stand-in for an LLM's token stream."""
    for i in range(0, len(text), chars_per_piece):
        await trio.sleep(delay)
        yield text[i : i + chars_per_piece]


DUET = [
    "I think we should leave early, before the traffic on the bridge gets heavy.",
    "Early? The concert does not start until eight, we have plenty of time.",
]


async def speak(tts: kazeia_stream.Session, text: str) -> tuple[np.ndarray, UtteranceMetrics]:
    utterance = tts.speak(llm_reply(text))
    pcm = [chunk.pcm async for chunk in utterance]
    return np.concatenate(pcm), utterance.metrics


async def duet(runtime: kazeia_stream.Runtime, voices: list[str], path: Path) -> None:
    """Two agents at once: each its own session and voice, both speaking at the same time."""
    spoken: dict[int, tuple[np.ndarray, UtteranceMetrics]] = {}

    async def agent(k: int) -> None:
        async with runtime.open(voice=voices[k], seed=10 + k) as tts:
            spoken[k] = await speak(tts, DUET[k])

    async with trio.open_nursery() as nursery:
        for k in range(2):
            nursery.start_soon(agent, k)
    n = max(len(spoken[k][0]) for k in range(2))
    stereo = np.zeros((n, 2), np.float32)
    for k in range(2):
        stereo[: len(spoken[k][0]), k] = spoken[k][0]
    sf.write(path, stereo, runtime.model.sample_rate)
    (_, a), (_, b) = spoken[0], spoken[1]
    assert a.first_audio and b.first_audio and a.finished and b.finished
    together = min(a.finished, b.finished) - max(a.first_audio, b.first_audio)
    print(f"duet: {voices[0]} and {voices[1]} spoke together for {max(together, 0):.2f} s -> {path}")


async def main(model_dir: str, barge_in_after: float, out_dir: Path) -> None:
    model = kazeia_stream.load_model(model_dir)
    # two streams at once for the duet; loads the engines off the event loop
    runtime = await kazeia_stream.Runtime.create(model, max_streams=2)
    out_dir.mkdir(parents=True, exist_ok=True)
    async with runtime.open(voice=model.default_voice, seed=1) as tts:
        for turn, reply in enumerate(REPLIES):
            utterance = tts.speak(llm_reply(reply))
            pcm = []
            async for chunk in utterance:
                pcm.append(chunk.pcm)
                heard = sum(len(p) for p in pcm) / chunk.sample_rate
                if turn == 1 and heard >= barge_in_after:
                    print(f"  [user interrupts after {heard:.2f} s of audio]")
                    tts.cancel()
            m = utterance.metrics
            audio = np.concatenate(pcm) if pcm else np.zeros(0, np.float32)
            path = out_dir / f"turn{turn}.wav"
            sf.write(path, audio, model.sample_rate)
            print(
                f"turn {turn}: {len(audio) / model.sample_rate:.2f} s of audio, first audio after "
                f"{m.ttfa_s:.2f} s, {'cancelled' if m.cancelled else 'complete'} -> {path}"
            )
    if len(model.voices) >= 2:
        await duet(runtime, model.voices[:2], out_dir / "duet.wav")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default=os.environ.get("KAZEIA_MODEL"), required="KAZEIA_MODEL" not in os.environ
    )
    ap.add_argument("--barge-in-after", type=float, default=1.5, help="seconds of audio before barge-in")
    ap.add_argument("--out-dir", type=Path, default=Path("conversation-out"))
    args = ap.parse_args()
    trio.run(main, args.model, args.barge_in_after, args.out_dir)
