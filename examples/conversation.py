"""A conversational loop: speak an LLM's reply while it is being written, and barge in.

    python examples/conversation.py --model MODEL_DIR [--barge-in-after 1.5] [--out-dir DIR]

The "LLM" is simulated: it yields a reply a few characters at a time, at about the pace of a
local model. Speech starts after its first words. The second reply is interrupted (barge-in)
after `--barge-in-after` seconds of audio, and the session goes straight on with the third.
Audio is written as WAV files, so this runs without a sound card.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import soundfile as sf
import trio

import kazeia_stream

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


async def main(model_dir: str, barge_in_after: float, out_dir: Path) -> None:
    model = kazeia_stream.load_model(model_dir)
    runtime = await kazeia_stream.Runtime.create(model)  # loads the engines off the event loop
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


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default=os.environ.get("KAZEIA_MODEL"), required="KAZEIA_MODEL" not in os.environ
    )
    ap.add_argument("--barge-in-after", type=float, default=1.5, help="seconds of audio before barge-in")
    ap.add_argument("--out-dir", type=Path, default=Path("conversation-out"))
    args = ap.parse_args()
    trio.run(main, args.model, args.barge_in_after, args.out_dir)
