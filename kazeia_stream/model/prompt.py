"""The talker's prompt: prefill embeddings and the text embeddings that trail behind them.

This mirrors `Qwen3TTSForConditionalGeneration.generate` in the official package (non-ICL path).
Every vector is a sum of rows of the talker's `token_embd`: text rows already carry the folded
`text_projection`, codec rows follow the text vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


class Embeddings(Protocol):
    """Row lookup in the talker's input table."""

    def text(self, ids: list[int]) -> np.ndarray: ...

    def codec(self, ids: list[int]) -> np.ndarray: ...


@dataclass(frozen=True)
class Prompt:
    """What the talker starts from: prefill rows, trailing text rows, the text's length, and how
    many leading prefill rows do not depend on the text (instruction, role and voice rows, the
    same for every utterance of a session, so their KV cache can be kept)."""

    prefill: np.ndarray
    trailing: np.ndarray
    n_text_tokens: int
    n_fixed: int


@dataclass(frozen=True)
class CodecIds:
    """The control rows of the codec vocabulary that frame a prompt."""

    pad: int
    bos: int
    eos: int
    think: int
    nothink: int
    think_bos: int
    think_eos: int


@dataclass(frozen=True)
class TextIds:
    """Special text tokens the prompt is built from."""

    im_start: int
    im_end: int
    tts_pad: int
    tts_bos: int
    tts_eos: int


def assistant_text(text: str) -> str:
    """The chat template around the text to speak (the official `_build_assistant_text`)."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def instruct_text(instruct: str) -> str:
    """The chat template around a voice instruction (the official `_build_instruct_text`)."""
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


def build_prompt(
    emb: Embeddings,
    text_ids: TextIds,
    codec_ids: CodecIds,
    role_ids: list[int],
    body_ids: list[int],
    *,
    instruct_ids: list[int] | None,
    language_id: int | None,
    speaker: np.ndarray | None,
    text_streaming: bool,
    text_complete: bool = True,
) -> Prompt:
    """The prompt: prefill [T, H] and trailing [N, H] rows.

    `role_ids` are the 3 tokens of "<|im_start|>assistant\n" and `body_ids` the text's tokens,
    as the official code slices the tokens of `assistant_text(text)`; `speaker` is a codec row
    (CustomVoice) or an x-vector (Base). With `text_complete=False` (streaming text still
    arriving) the trailing rows stop short of the closing EOS row.
    """
    if not body_ids:
        raise ValueError("the text has no tokens to speak")
    if not (text_streaming or text_complete):
        raise ValueError("the whole text must be known when it all goes in the prefill")
    pad, bos, eos = emb.text([text_ids.tts_pad, text_ids.tts_bos, text_ids.tts_eos])

    if language_id is None:
        prefix = [codec_ids.nothink, codec_ids.think_bos, codec_ids.think_eos]
    else:
        prefix = [codec_ids.think, codec_ids.think_bos, language_id, codec_ids.think_eos]
    codec = [emb.codec(prefix)]
    if speaker is not None:
        codec.append(speaker.reshape(1, -1).astype(np.float32))
    codec.append(emb.codec([codec_ids.pad, codec_ids.bos]))
    codec_rows = np.concatenate(codec)

    # Control block: PAD under every codec row but the last two, BOS under codec_pad.
    n = len(codec_rows)
    control = codec_rows[:-1] + np.concatenate([np.repeat(pad[None], n - 2, 0), bos[None]])
    parts = []
    if instruct_ids:
        parts.append(emb.text(instruct_ids))
    parts += [emb.text(role_ids), control]
    n_fixed = sum(len(part) for part in parts)

    body_rows = emb.text(body_ids)
    if text_streaming:
        parts.append(body_rows[:1] + codec_rows[-1:])
        trailing = np.concatenate([body_rows[1:], eos[None]] if text_complete else [body_rows[1:]])
    else:
        codec_pad = emb.codec([codec_ids.pad])
        parts.append(np.concatenate([body_rows, eos[None]]) + codec_pad)
        parts.append(pad[None] + codec_rows[-1:])
        trailing = pad[None].copy()
    return Prompt(np.concatenate(parts).astype(np.float32, copy=False),
                  trailing.astype(np.float32, copy=False), len(body_ids), n_fixed)
