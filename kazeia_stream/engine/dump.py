"""Teacher-forced outputs of every engine along a given code sequence, for parity checks.

In the spirit of llama.cpp's validation tools: the same numbers the official implementation
gives for the same prompt and codes, so any two implementations can be compared array by array.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..model.prompt import Prompt
    from .synthesis import Engines


def teacher_forced_talker(engines: Engines, prompt: Prompt, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(logits [N, codec vocab], hidden [N, H]): row 0 from the prefill, row t after feeding
    frame t-1 with its trailing text row (or the pad row), as the official decode loop does."""
    talker, cp = engines.talker, engines.code_predictor
    pad = engines.model.pad_embedding
    hidden, logits = talker.prefill(prompt.prefill, prompt.n_fixed)
    hs, ls = [hidden], [logits]
    for t in range(1, len(codes)):
        text = prompt.trailing[t - 1] if t - 1 < len(prompt.trailing) else pad
        hidden, logits = talker.step(cp.embed(codes[t - 1]) + text)
        hs.append(hidden)
        ls.append(logits)
    return np.stack(ls), np.stack(hs)


def dump(engines: Engines, prompt: Prompt, codes: np.ndarray, chunk: int) -> dict[str, np.ndarray]:
    """Every array of `kazeia-stream dump`, keyed as in its output file."""
    codes = np.asarray(codes, dtype=np.int64)
    talker_logits, talker_hidden = teacher_forced_talker(engines, prompt, codes)
    cp_logits = np.stack([engines.code_predictor.teacher_forced_logits(h, c)
                          for h, c in zip(talker_hidden, codes)])
    codec = engines.codec
    audio = codec.decode(codes)
    codec.reset()
    streamed = np.concatenate([codec.push(codes[i:i + chunk]) for i in range(0, len(codes), chunk)])
    return {
        "prefill": prompt.prefill, "trailing": prompt.trailing,
        "talker_logits": talker_logits, "talker_hidden": talker_hidden, "cp_logits": cp_logits,
        "audio": audio, "audio_streamed": streamed,
    }
