"""The talker: a Qwen3 LM on libllama emitting codebook 0 of one frame per step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .llm import EmbeddingLM, LMOptions, SharedCores

if TYPE_CHECKING:
    from ..model import Model

# The qwen3tts architecture uses 4-component M-RoPE; with equal components it is plain RoPE.
POSITIONS_PER_TOKEN = 4


class Talker:
    """Prefill, then one step per frame; the KV cache lives across the steps of an utterance."""

    def __init__(self, model: Model, options: LMOptions = LMOptions(),
                 cores: SharedCores | None = None) -> None:
        cfg = model.config.talker
        self.lm = EmbeddingLM(model.llama_model.ptr, cfg.hidden_size, cfg.codec_vocab_size,
                              POSITIONS_PER_TOKEN, options, cores)
        self._fixed: np.ndarray | None = None  # the leading rows whose KV cache is kept

    def prefill(self, embeds: np.ndarray, n_fixed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Start an utterance: (final-norm hidden [H], codec logits [codec vocab]) at the last row.

        The first `n_fixed` rows (instruction, role, voice: `Prompt.n_fixed`) run as their own
        batch and stay in the KV cache; when the next utterance starts with the same rows, only
        the rows after them are computed (most of the prefill of a streaming prompt). Either way
        the arithmetic is the same, so results do not depend on what ran before.
        """
        fixed = embeds[:n_fixed]
        if self._fixed is not None and np.array_equal(self._fixed, fixed):
            self.lm.truncate(n_fixed)
        else:
            self._fixed = None
            self.lm.reset()
            if n_fixed:
                self.lm.forward(fixed)
                self._fixed = fixed.copy()
        return self.lm.forward(embeds[n_fixed:])

    def step(self, embed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Feed one input embedding [H]; returns the next (hidden, logits)."""
        return self.lm.forward(embed[None])

    def set_threads(self, threads: int) -> None:
        self.lm.set_threads(threads)
