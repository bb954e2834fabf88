"""The talker's prompt: prefill embeddings and the text embeddings that trail behind them.

This mirrors `Qwen3TTSForConditionalGeneration.generate` in the official package, with its
`generate_icl_prompt` for in-context cloning. Every vector is a sum of rows of the talker's
`token_embd` (text rows already carry the folded `text_projection`, codec rows follow the text
vocabulary), of the code predictor's input tables (a reference frame's codebooks 1..15), or an
x-vector.

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
class InContext:
    """An in-context (ICL) reference: its transcript's text tokens and the talker rows of its
    frames [R, H] (each the sum of its 16 code embeddings)."""

    text_ids: list[int]
    frame_rows: np.ndarray

    def text_needed(self) -> int:
        """Text tokens a streaming prompt takes before the first frame, unless the text ends
        sooner: the reference's text and frames are aligned row by row, the text to speak
        continuing the transcript's tokens under the reference frames (and codec BOS)."""
        return max(1, len(self.frame_rows) + 1 - len(self.text_ids))


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


# The chat templates around the text to speak, a reference transcript and a voice instruction
# (the official `_build_assistant_text`, `_build_ref_text`, `_build_instruct_text`):
# "<|im_start|>" ROLE TEXT TAIL.
IM_START = "<|im_start|>"
ASSISTANT, ASSISTANT_TAIL = "assistant\n", "<|im_end|>\n<|im_start|>assistant\n"
USER, TURN_END = "user\n", "<|im_end|>\n"
# The official code slices the templates' tokens: the first 3 are the role, the last 5 (the
# text to speak) or 2 (a reference transcript) the tail, the rest the text.
ROLE_TOKENS, TAIL_TOKENS, TURN_END_TOKENS = 3, 5, 2


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
    reference: InContext | None = None,
) -> Prompt:
    """The prompt: prefill [T, H] and trailing [N, H] rows.

    `role_ids` are the 3 tokens of "<|im_start|>assistant\n" and `body_ids` the text's tokens,
    as the official code slices the tokens of the assistant template; `speaker` is a codec row
    (CustomVoice) or an x-vector (Base). With `text_complete=False` (streaming text still
    arriving) the trailing rows stop short of the closing EOS row. A `reference` makes it the
    in-context cloning prompt (its streaming form needs `reference.text_needed()` tokens, or
    the whole text).
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

    if reference is not None:
        tail, trailing, n_ref_fixed = _in_context(
            emb,
            reference,
            body_ids,
            codec_rows[-1],
            pad,
            eos,
            emb.codec([codec_ids.pad])[0],
            text_streaming,
            text_complete,
        )
        parts.append(tail)
        n_fixed += n_ref_fixed
    elif text_streaming:
        body_rows = emb.text(body_ids)
        parts.append(body_rows[:1] + codec_rows[-1:])
        feed = TextFeed(emb, text_ids, body_rows[1:], len(body_ids) - 1)
        if text_complete:
            feed.add([], complete=True)  # the EOS row
        trailing = feed.trailing
    else:
        codec_pad = emb.codec([codec_ids.pad])
        parts.append(np.concatenate([emb.text(body_ids), eos[None]]) + codec_pad)
        parts.append(pad[None] + codec_rows[-1:])
        trailing = pad[None].copy()
    return Prompt(
        np.concatenate(parts).astype(np.float32, copy=False),
        trailing.astype(np.float32, copy=False),
        len(body_ids),
        n_fixed,
        text_complete,
    )


def _in_context(
    emb: Embeddings,
    reference: InContext,
    body_ids: list[int],
    codec_bos: np.ndarray,
    pad: np.ndarray,
    eos: np.ndarray,
    codec_pad: np.ndarray,
    text_streaming: bool,
    text_complete: bool,
) -> tuple[np.ndarray, np.ndarray, int]:
    """The official `generate_icl_prompt`: (prompt rows after the control block, trailing rows,
    how many of those rows depend on the voice alone).

    Text side Tx = [T(transcript ++ text), EOS once complete]; codec side Cx = [C(codec_bos),
    reference frames]. Without streaming: Tx + C(codec_pad), then Cx + PAD, trailing [PAD].
    Streaming: Tx and Cx summed row by row over Cx's length (Tx padded with PAD when shorter),
    the rest of Tx trailing (or [PAD])."""
    n_ref = len(reference.text_ids)
    text = emb.text(reference.text_ids + body_ids)
    if text_complete:
        text = np.concatenate([text, eos[None]])
    codec = np.concatenate([codec_bos[None], reference.frame_rows])
    if not text_streaming:
        rows = np.concatenate([text + codec_pad, codec + pad])
        return rows, pad[None].copy(), n_ref
    if len(text) > len(codec) or (len(text) == len(codec) and not text_complete):
        return text[: len(codec)] + codec, text[len(codec) :], min(n_ref, len(codec))
    if not text_complete:
        raise ValueError(f"a streaming in-context prompt needs {reference.text_needed()} text tokens")
    text = np.concatenate([text, np.repeat(pad[None], len(codec) - len(text), 0)])
    return text + codec, pad[None].copy(), min(n_ref, len(codec))
