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
    """One utterance's place in the talker: the next position to write."""

    pos: int = 0


class Talker:
    """Prefill, then one step per frame. The context holds the KV cache of the utterance being
    generated; the state says how far it goes. The leading rows that every utterance of a
    session shares stay cached between utterances."""

    def __init__(
        self,
        model: llama_cpp.llama_model_p,
        cfg: TalkerConfig,
        options: LMOptions,
        cores: SharedCores | None = None,
    ) -> None:
        self.lm = EmbeddingLM(
            model, cfg.hidden_size, cfg.codec_vocab_size, POSITIONS_PER_TOKEN, options, cores
        )
        self.n_ctx = options.n_ctx
        self._fixed: np.ndarray | None = None  # the leading rows whose KV cache is kept

    def prefill(
        self, state: TalkerState, embeds: np.ndarray, n_fixed: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Start an utterance: (final-norm hidden [H], codec logits [codec vocab]) at the last row.

        The first `n_fixed` rows (instruction, role, voice: `Prompt.n_fixed`) run as their own
        batch and stay in the KV cache; when the next utterance starts with the same rows, only
        the rows after them are computed (most of the prefill of a streaming prompt). Either way
        the arithmetic is the same, so results do not depend on what ran before.
        """
        fixed = embeds[:n_fixed]
        if self._fixed is not None and np.array_equal(self._fixed, fixed):
            self.lm.keep(n_fixed)
        else:
            self._fixed = None
            self.lm.clear()
            if n_fixed:
                self.lm.forward(fixed, 0)
                self._fixed = fixed.copy()
        out = self.lm.forward(embeds[n_fixed:], n_fixed)
        state.pos = len(embeds)
        return out

    def step(self, state: TalkerState, embed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Feed one input embedding [H]; returns the next (hidden, logits)."""
        out = self.lm.forward(embed[None], state.pos)
        state.pos += 1
        return out

    def room(self, state: TalkerState) -> int:
        """Positions left in the context for this utterance."""
        return self.n_ctx - state.pos

    def set_threads(self, threads: int) -> None:
        self.lm.set_threads(threads)
