"""The talker: a Qwen3 LM emitting codebook 0 of one frame per step.

It is a `Qwen3LM` on the talker file's weights, used in place in the file's mapping (the text
embedding is never read there: we feed embeddings, and read a text's rows from the prompt). The
qwen3tts architecture uses 4-component M-RoPE; TTS gives the components equal positions, which
makes it plain NeoX RoPE, as the graphs apply it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QType

from ..model import gguf_layout as L
from ..model.config import TalkerConfig
from ..model.gguf_file import GGUFFile
from .qwen3 import Qwen3LM, file_weights, weight_names, weight_types
from .rows_cache import RowsCache
from .threads import SharedCores

# positions per slot: 164 s of frames, and long texts are split into segments that fit
N_CTX = 2048
# a step attends over its slot's positions rounded up to this: one graph per 5 s of frames
ATTENTION_BUCKET = 64


def kv_f32_for(weights: QType) -> bool:
    """The KV cache type that goes with the weights: F32 beside F32 weights (hidden states
    within ~1e-6 of a float32 reference), else F16, llama.cpp's default: half the memory, and
    its rounding is far below that of F16 or quantized weights."""
    return weights == QType.F32


@dataclass
class TalkerState:
    """One utterance's place in the talker: its sequence (slot) and the next position to write."""

    pos: int = 0
    seq: int = 0


class Talker:
    """Prefill, then one step per frame, for up to `slots` utterances at once, each in its own
    slot of the KV cache. A slot keeps the KV cache of the leading rows that every utterance of
    a session shares (instruction, role, voice) after its utterance ends, so that the next
    utterance with the same rows only computes the rows after them: in that slot, or in another
    that takes a copy of the cells (several streams of one voice at once)."""

    def __init__(
        self,
        f: GGUFFile,
        cfg: TalkerConfig,
        threads: int,
        slots: int = 1,
        n_ctx: int = N_CTX,
        cores: SharedCores | None = None,
    ) -> None:
        sources = {
            **weight_names(L.TALKER_LAYER, cfg.num_layers),
            "output_norm": L.TALKER_OUTPUT_NORM,
            "output": L.TALKER_OUTPUT,
        }
        self.weights = file_weights(f, sources, weight_types(f, sources))
        self.lm = Qwen3LM(
            self.weights,
            cfg,
            input_width=cfg.hidden_size,
            slots=slots,
            n_ctx=n_ctx,
            kv_f32=kv_f32_for(f.tensor_type(L.TALKER_FFN_UP.format(bid=0))),
            threads=threads,
            cores=cores,
            bucket=ATTENTION_BUCKET,
        )
        self.n_ctx, self.n_seq = n_ctx, slots
        self._fixed: list[np.ndarray | None] = [None] * slots  # each slot's kept rows
        self._saved = RowsCache(f.path)

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

        The first `n_fixed` rows (`Prompt.n_fixed`) stay in the slot's cache. When the slot
        holds them already, or their cells are known (`_known`) and written into it, only the
        rows after them are left; else they are a piece of their own. Either way the arithmetic
        is the same, so results do not depend on what ran before."""
        fixed = embeds[:n_fixed]
        pieces = [] if self._put(state.seq, fixed) else [(0, fixed)]
        if len(embeds) > n_fixed:
            pieces.append((n_fixed, embeds[n_fixed:]))
        state.pos = len(embeds)
        return pieces

    def _put(self, seq: int, fixed: np.ndarray) -> bool:
        """Make slot `seq` keep the rows `fixed`: whether their cells are in it now (kept
        already, or written), or are still to be computed from position 0."""
        if self.holds(seq, fixed):
            return True
        self._fixed[seq] = None  # the slot's cells are overwritten from position 0
        if not len(fixed):
            return True
        cells = self._known(fixed)
        self._fixed[seq] = fixed.copy()
        if cells is None:
            return False
        self.lm.set_cells(seq, *cells)
        return True

    def _known(self, fixed: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The KV cells of rows `fixed` without computing them: those of another slot that
        keeps them (a session's second stream), else saved ones (`RowsCache`); else None. A
        slot's kept cells are the same numbers wherever they were computed (each row is
        summed in one order whatever rows run beside it)."""
        n, lm = len(fixed), self.lm
        other = next((seq for seq in range(self.n_seq) if self.holds(seq, fixed)), None)
        if other is not None:
            return lm.cells(other, n)
        return self._saved.load(fixed, (lm.config.num_layers, n, lm.kv_dim), lm.kv_dtype)

    def prefill(
        self, state: TalkerState, embeds: np.ndarray, n_fixed: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Start an utterance alone: (final-norm hidden [H], codec logits [codec vocab]) at the
        last row."""
        out = None
        for pos, rows in self.begin(state, embeds, n_fixed):
            out = self.lm.forward(rows, pos, slot=state.seq)
        assert out is not None
        return out

    def keep(self, seq: int, fixed: np.ndarray) -> None:
        """Put a prompt's fixed rows into slot `seq` (when it does not hold them), ahead of
        the utterances that start with them: their KV cells where known (`_known`), else
        computed, and saved."""
        computed = self.begin(TalkerState(seq=seq), fixed, len(fixed))
        for pos, rows in computed:
            self.lm.forward(rows, pos, slot=seq)
        if computed:
            self._saved.save(fixed, *self.lm.cells(seq, len(fixed)))

    def build_graphs(self, seq: int) -> None:
        """Build the graph of slot `seq`'s steps over its first ATTENTION_BUCKET positions
        ahead of them."""
        self.lm.build([(seq, np.zeros((1, self.lm.input_width), np.float32), 0)])

    def step(self, state: TalkerState, embed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Feed one input embedding [H]; returns the next (hidden, logits)."""
        out = self.lm.forward(embed[None], state.pos, slot=state.seq)
        state.pos += 1
        return out

    def populate(self, slot: int) -> None:
        """Make resident now what a first utterance in `slot` would fault in (`Qwen3LM.populate`)."""
        self.lm.populate(slot)

    def release(self, state: TalkerState) -> None:
        """The utterance has ended: its slot gives back the memory of every cell but the fixed
        rows it keeps (`Qwen3LM.release`)."""
        kept = self._fixed[state.seq]
        self.lm.release(state.seq, 0 if kept is None else len(kept))

    def room(self, state: TalkerState) -> int:
        """Positions left in the context for this utterance."""
        return self.n_ctx - state.pos

    def set_threads(self, threads: int) -> None:
        self.lm.set_threads(threads)
