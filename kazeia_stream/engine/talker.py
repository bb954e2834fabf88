"""The talker: a Qwen3 LM on libllama emitting codebook 0 of one frame per step."""

from __future__ import annotations

from dataclasses import dataclass

import llama_cpp
import numpy as np

from ..model.config import TalkerConfig
from .llm import EmbeddingLM, LMOptions
from .threads import SharedCores

# The qwen3tts architecture uses 4-component M-RoPE; with equal components it is plain RoPE.
POSITIONS_PER_TOKEN = 4


@dataclass
class TalkerState:
    """One utterance's place in the talker: its sequence (slot) and the next position to write."""

    pos: int = 0
    seq: int = 0


class Talker:
    """Prefill, then one step per frame, for up to `options.n_seq` utterances at once, each in
    its own sequence of the context (a slot). A slot keeps the KV cache of the leading rows that
    every utterance of a session shares (instruction, role, voice) after its utterance ends, so
    that the next utterance with the same rows in that slot only computes the rows after them."""

    def __init__(
        self,
        model: llama_cpp.llama_model_p,
        cfg: TalkerConfig,
        options: LMOptions,
        cores: SharedCores | None = None,
    ) -> None:
        self.lm = EmbeddingLM(model, cfg, cfg.codec_vocab_size, POSITIONS_PER_TOKEN, options, cores)
        self.n_ctx, self.n_seq = options.n_ctx, options.n_seq
        self._fixed: list[np.ndarray | None] = [None] * self.n_seq  # each slot's kept rows

    def slot_for(self, fixed: np.ndarray, free: list[int]) -> int:
        """Of the `free` slots, one that keeps the rows `fixed` if any, else the first."""
        return next((seq for seq in free if self.holds(seq, fixed)), free[0])

    def holds(self, seq: int, fixed: np.ndarray) -> bool:
        """Whether slot `seq` keeps the rows `fixed`."""
        kept = self._fixed[seq]
        return kept is not None and np.array_equal(kept, fixed)

    def begin(self, state: TalkerState, embeds: np.ndarray, n_fixed: int) -> list[tuple[int, np.ndarray]]:
        """Start an utterance in slot `state.seq`: the pieces (first position, rows) its prefill
        still has to compute, in order; `prefill` or `FrameLoop` feeds them.

        The first `n_fixed` rows (`Prompt.n_fixed`) are a piece of their own and stay in the
        slot's cache; when the slot already holds them, only the rows after them are left. Either
        way the arithmetic is the same, so results do not depend on what ran before."""
        fixed = embeds[:n_fixed]
        pieces = []
        if self.holds(state.seq, fixed):
            self.lm.keep(n_fixed, state.seq)
        else:
            self._fixed[state.seq] = None
            self.lm.keep(0, state.seq)
            if n_fixed:
                pieces.append((0, fixed))
                self._fixed[state.seq] = fixed.copy()
        pieces.append((n_fixed, embeds[n_fixed:]))
        state.pos = len(embeds)
        return pieces

    def prefill(
        self, state: TalkerState, embeds: np.ndarray, n_fixed: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Start an utterance alone: (final-norm hidden [H], codec logits [codec vocab]) at the
        last row."""
        out = None
        for pos, rows in self.begin(state, embeds, n_fixed):
            out = self.lm.forward(rows, pos, seq=state.seq)
        assert out is not None
        return out

    def step(self, state: TalkerState, embed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Feed one input embedding [H]; returns the next (hidden, logits)."""
        out = self.lm.forward(embed[None], state.pos, seq=state.seq)
        state.pos += 1
        return out

    def room(self, state: TalkerState) -> int:
        """Positions left in the context for this utterance."""
        return self.n_ctx - state.pos

    def set_threads(self, threads: int) -> None:
        self.lm.set_threads(threads)
