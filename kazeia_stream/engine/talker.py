"""The talker: a Qwen3 LM on libllama emitting codebook 0 of one frame per step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .llm import EmbeddingLM, LMOptions

if TYPE_CHECKING:
    from ..model import Model

# The qwen3tts architecture uses 4-component M-RoPE; with equal components it is plain RoPE.
POSITIONS_PER_TOKEN = 4


class Talker:
    """Prefill, then one step per frame; the KV cache lives across the steps of an utterance."""

    def __init__(self, model: Model, options: LMOptions = LMOptions()) -> None:
        cfg = model.config.talker
        self.lm = EmbeddingLM(model.llama_model.ptr, cfg.hidden_size, cfg.codec_vocab_size,
                              POSITIONS_PER_TOKEN, options)

    def prefill(self, embeds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Start an utterance: (final-norm hidden [H], codec logits [3072]) at the last row."""
        self.lm.reset()
        return self.lm.forward(embeds)

    def step(self, embed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Feed one input embedding [H]; returns the next (hidden, logits)."""
        return self.lm.forward(embed[None])

    def set_threads(self, threads: int) -> None:
        self.lm.set_threads(threads)
