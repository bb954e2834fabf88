"""The talker's prompt: prefill embeddings and the text embeddings that trail behind them.

This mirrors `Qwen3TTSForConditionalGeneration.generate` in the official package (non-ICL path).
Every vector is a sum of rows of the talker's `token_embd`: text rows already carry the folded
`text_projection`, codec rows follow the text vocabulary.

`TextFeed` is the one home of the streaming-text rule: which text row joins each generated
frame's talker input, when PAD follows, when EOS closes the text.
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
    """What the talker starts from: prefill rows, trailing text rows (the official
    `trailing_text_hidden`), the text's length, whether the text is complete, and how many
    leading prefill rows do not depend on the text (instruction, role and voice rows, the same
    for every utterance of a session, so their KV cache can be kept)."""

    prefill: np.ndarray
    trailing: np.ndarray
    n_text_tokens: int
    n_fixed: int
    text_complete: bool = True


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


class TextFeed:
    """The text rows that join the generated frames' talker inputs, one per frame.

    The input that follows frame t is the sum of its code embeddings and `row(t)`: the t-th
    trailing row while there is one; once the text is complete and its rows (EOS last) are
    used up, PAD. A row of text still to come is None: the frame loop waits for it, since PAD
    would tell the model that the text has ended."""

    def __init__(
        self,
        emb: Embeddings,
        text_ids: TextIds,
        rows: np.ndarray | None = None,
        n_tokens: int = 0,
        complete: bool = False,
    ) -> None:
        self._emb = emb
        self.pad, self.eos = emb.text([text_ids.tts_pad, text_ids.tts_eos])
        self.rows: list[np.ndarray] = [] if rows is None else list(rows)
        self.n_tokens = n_tokens
        self.complete = complete

    def add(self, ids: list[int], complete: bool) -> None:
        """More text tokens; the text's end adds the EOS row."""
        if self.complete:
            raise ValueError("the text is already complete")
        if ids:
            self.rows.extend(self._emb.text(ids))
        if complete:
            self.rows.append(self.eos)
        self.n_tokens += len(ids)
        self.complete = complete

    def row(self, t: int) -> np.ndarray | None:
        """The text row that joins frame t's codes in the next talker input."""
        if t < len(self.rows):
            return self.rows[t]
        return self.pad if self.complete else None

    @property
    def trailing(self) -> np.ndarray:
        """The rows so far [N, H]."""
        if not self.rows:
            return np.zeros((0, len(self.pad)), np.float32)
        return np.stack(self.rows).astype(np.float32, copy=False)


# The chat templates around the text to speak and a voice instruction (the official
# `_build_assistant_text` and `_build_instruct_text`): "<|im_start|>" ROLE TEXT TAIL.
IM_START = "<|im_start|>"
ASSISTANT, ASSISTANT_TAIL = "assistant\n", "<|im_end|>\n<|im_start|>assistant\n"
USER, USER_TAIL = "user\n", "<|im_end|>\n"
# The official code slices the assistant template's tokens: the first 3 are the role, the last 5
# the tail, the rest the text.
ROLE_TOKENS, TAIL_TOKENS = 3, 5


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
    as the official code slices the tokens of the assistant template; `speaker` is a codec row
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
        feed = TextFeed(emb, text_ids, body_rows[1:], len(body_ids) - 1)
        if text_complete:
            feed.add([], complete=True)  # the EOS row
        trailing = feed.trailing
    else:
        codec_pad = emb.codec([codec_ids.pad])
        parts.append(np.concatenate([body_rows, eos[None]]) + codec_pad)
        parts.append(pad[None] + codec_rows[-1:])
        trailing = pad[None].copy()
    return Prompt(
        np.concatenate(parts).astype(np.float32, copy=False),
        trailing.astype(np.float32, copy=False),
        len(body_ids),
        n_fixed,
        text_complete,
    )
