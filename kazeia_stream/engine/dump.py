"""Teacher-forced outputs of every engine along a given code sequence, for parity checks.

In the spirit of llama.cpp's validation tools: the same numbers the official implementation
gives for the same prompt and codes, so any two implementations can be compared array by array.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..model.prompt import Prompt, TextFeed
from .code_predictor import CodePredictor
from .codec import CodecDecoder, DecoderState
from .talker import Talker, TalkerState


def teacher_forced_talker(
    talker: Talker, code_predictor: CodePredictor, prompt: Prompt, text: TextFeed, codes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(logits [N, codec vocab], hidden [N, H]): row 0 from the prefill, row t after feeding
    frame t-1 with its text row (`TextFeed.row`), as the official decode loop does."""
    state = TalkerState()
    hidden, logits = talker.prefill(state, prompt.prefill, prompt.n_fixed)
    hs, ls = [hidden], [logits]
    for t in range(1, len(codes)):
        row = text.row(t - 1)
        if row is None:
            raise ValueError("teacher forcing needs the whole text")
        hidden, logits = talker.step(state, code_predictor.embed(codes[t - 1]) + row)
        hs.append(hidden)
        ls.append(logits)
    return np.stack(ls), np.stack(hs)


def dump(
    talker: Talker,
    code_predictor: CodePredictor,
    codec: CodecDecoder,
    new_state: Callable[[], DecoderState],
    prompt: Prompt,
    text: TextFeed,
    codes: np.ndarray,
    chunk: int,
) -> dict[str, np.ndarray]:
    """Every array of `kazeia-stream dump`, keyed as in its output file. The audio is decoded
    from `new_state()` (an in-context voice's: primed with its reference, so the audio is what
    follows it), in one push and in pushes of `chunk` frames."""
    codes = np.asarray(codes, dtype=np.int64)
    talker_logits, talker_hidden = teacher_forced_talker(talker, code_predictor, prompt, text, codes)
    cp_logits = np.stack([code_predictor.teacher_forced_logits(h, c) for h, c in zip(talker_hidden, codes)])
    state = new_state()
    streamed = np.concatenate([codec.push(state, codes[i : i + chunk]) for i in range(0, len(codes), chunk)])
    return {
        "prefill": prompt.prefill,
        "trailing": prompt.trailing,
        "talker_logits": talker_logits,
        "talker_hidden": talker_hidden,
        "cp_logits": cp_logits,
        "audio": codec.push(new_state(), codes),
        "audio_streamed": streamed,
    }
