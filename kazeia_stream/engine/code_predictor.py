"""The code predictor: codebooks 1..15 of a frame from the talker's hidden state and codebook 0.

Its 5-layer Qwen3 LM is a `Qwen3LM` (graphs of our own on the bundled libggml) on the mmproj's
`a.gen.code.*` tensors, used in place in the file's mapping: one graph per codebook step, built
once and replayed, each applying its head from the stacked head tensor.

Per frame (positions restart at 0): the inputs are h and C_talker(c0) at positions 0 and 1, then
`codec_embedding[j-1](cb_j)` at position j + 1 for j = 1..14; every input goes through
small_to_mtp_projection when the model has one (1.7B). Codebook j comes from `lm_head[j-1]` at
the last row of step j. Every row is a part of its own (h and C_talker(c0) too: two one-row
parts, the second attending to the first), so that its numbers are the same whatever rows run
beside it (see `qwen3.Qwen3LM._product`).

Weight types (`exact=False`, the default): the stored ones, except the F32 `ffn_down` that
converters keep because its input peaks near 1.5e5, beyond F16 (ggml casts a product's input to
the weight's type). In an F16 file it becomes F16, with its input scaled down by 2^-6 and its
output scaled back (powers of two: exact); in a Q8_0 file of llama.cpp's converter it becomes
Q8_0 (per-block scales, no range issue; ours stores it so). Bytes read per pass at 0.6B: F16
file 189 -> 157 MB, Q8_0 file 84 MB (130 -> 84 for llama.cpp's).
`exact=True` keeps every stored type (hidden states within ~1e-6 of float32). An all-F32 file
is the same either way. The KV cache is F32, 16 positions per stream (640 KiB at 0.6B).

No state survives a frame: each frame's steps restart at position 0. `predict_many` runs the
steps of up to `max_streams` streams together, each in its own KV slot; between two of its
steps, another call may run in the slots it does not use. One CodePredictor serves one thread
at a time (the runtime's generator thread): its KV cache and graphs are that thread's scratch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from ..model import gguf_layout as L
from ..model.config import CodePredictorConfig
from ..model.gguf_file import GGUFFile
from . import code_step
from .ggml_graph import Weights, nbytes
from .qwen3 import Part, Qwen3LM, file_weights, matrix_macs, weight_names, weight_types
from .sampler import CodeSampler
from .threads import SharedCores

# Positions per frame: h, C_talker(c0) and 14 codebook inputs.
_N_POS = 16
# ffn_down's input is multiplied by this before its F16 cast (and the output by the inverse).
_FFN_DOWN_INPUT_SCALE = 2.0**-6

_PLAIN = {QType.F32: np.float32, QType.F16: np.float16}


class _Plan:
    """Which mmproj tensor becomes each weight, in which type, and ffn_down's input scales."""

    def __init__(self, f: GGUFFile, cfg: CodePredictorConfig, exact: bool) -> None:
        self.file = f
        self.sources = {
            **weight_names(L.CP_LAYER, cfg.num_layers),
            "output_norm": L.CP_OUTPUT_NORM,
            "head": L.CP_HEAD,
        }
        if cfg.has_projection:
            self.sources["proj"] = L.CP_PROJ_IN + ".weight"
            self.sources["proj_bias"] = L.CP_PROJ_IN + ".bias"
        self.types = weight_types(f, self.sources)
        self.down_scale = [1.0] * cfg.num_layers
        if not exact:
            for bid in range(cfg.num_layers):
                down, up = self.types[f"{bid}.down"], self.types[f"{bid}.up"]
                if down == QType.F32 and up in (QType.F16, QType.Q8_0):
                    self.types[f"{bid}.down"] = up
                    if up == QType.F16:
                        self.down_scale[bid] = _FFN_DOWN_INPUT_SCALE

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file.tensor_shape(self.sources[name])

    def weights(self) -> Weights:
        """The weights: stored ones in place in the file's mapping, the others converted."""
        return file_weights(self.file, self.sources, self.types)

    def nbytes(self, name: str) -> int:
        return nbytes(self.types[name], self.shape(name))


class _Table:
    """Rows of a stacked [groups, rows, width] tensor as float32, dequantized on demand."""

    def __init__(self, f: GGUFFile, name: str) -> None:
        self.raw = np.asarray(f.raw(name))  # a plain view: a memmap's indexing costs ~10 us
        self.qtype = f.tensor_type(name)

    def row(self, *index: int) -> np.ndarray:
        data = self.raw[index]
        if self.qtype in _PLAIN:
            return data.astype(np.float32)
        if self.qtype == QType.Q8_0:  # blocks of an F16 scale and 32 int8: 2.5x gguf's generic path
            blocks = np.asarray(data).reshape(-1, 34)
            scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
            return (blocks[:, 2:].view(np.int8) * scale).reshape(-1)
        return dequantize(np.asarray(data)[None], self.qtype)[0].astype(np.float32, copy=False)


class CodePredictor:
    """Codebooks 1..15 of each frame, and the talker's next input embedding."""

    def __init__(
        self,
        f: GGUFFile,
        cfg: CodePredictorConfig,
        threads: int,
        exact: bool = False,
        cores: SharedCores | None = None,
        max_streams: int = 1,
    ) -> None:
        self.config = cfg
        self.max_streams = max_streams
        self.n_groups = cfg.num_code_groups - 1
        self.vocab_size = cfg.vocab_size
        self._embd = _Table(f, L.CP_EMBD)  # [15, 2048, talker hidden]
        self._talker_embd = _Table(f, L.CP_OUT_EMBD)  # [codec vocab, talker hidden]
        self.talker_hidden = f.tensor_shape(L.CP_EMBD)[-1]
        plan = _Plan(f, cfg, exact)
        self.weights = plan.weights()
        # what a pass reads: every weight but the heads, and one head
        n_heads = plan.shape("head")[0]
        self.bytes_per_pass = sum(plan.nbytes(n) for n in plan.sources if n != "head")
        self.bytes_per_pass += plan.nbytes("head") // n_heads
        self.macs_per_pass = matrix_macs(  # by weight type; one head of the stacked ones
            (plan.types[n], plan.shape(n)[1:] if n == "head" else plan.shape(n)) for n in plan.sources
        )
        self.lm = Qwen3LM(
            self.weights,
            cfg,
            input_width=self.talker_hidden,
            slots=max_streams,
            n_ctx=_N_POS,
            kv_f32=True,
            threads=threads,
            cores=cores,
            bucket=_N_POS,
            # two graphs (codebook 1's two rows per stream, one row after) per run of slots
            # (first, count) a pass may use: the head applied is an input
            max_graphs=max_streams * (max_streams + 1),
            down_scale=plan.down_scale,
        )

    def close(self) -> None:
        """Free the graphs and the KV cache (once; also when collected)."""
        if hasattr(self, "lm"):
            self.lm.close()
            self.weights.close()

    __del__ = close

    def set_threads(self, threads: int) -> None:
        self.lm.set_threads(threads)

    def build_graphs(self, seq: int) -> None:
        """Build slot `seq`'s graphs of a frame's passes ahead of its first frame: codebook 1's
        (h and C_talker(c0), `_step`'s outputs), then the later codebooks' (one row; only after
        the larger first one, which would make it stale)."""
        row = np.zeros((1, self.lm.input_width), np.float32)
        if self.lm.build([(seq, row, 0), (seq, row, 1)], "head", [False, True]):
            self.lm.build([(seq, row, 2)], "head")

    def _step(self, codebook: int, parts: list[Part]) -> np.ndarray:
        """Feed each stream's rows after its frame's earlier inputs: one-row parts (slot, row,
        position), codebook 1's two (h, C_talker(c0)) per stream; the logits of `codebook` at
        each stream's last row [streams, vocab]."""
        outputs = [codebook > 1 or pos == 1 for _, _, pos in parts]
        return self.lm.forward_many(parts, "head", codebook - 1, outputs)[1]

    def predict(
        self, hidden: np.ndarray, code0: int, sample: Callable[[np.ndarray], int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Codes [16] (code0 then cb1..cb15) and the talker's next input embedding
        C_talker(code0) + sum_i cp.embd[i-1](cb_i) [talker hidden]; `sample(logits) -> code`."""
        codes, embeds = self.predict_many(hidden[None], [code0], [sample])
        return codes[0], embeds[0]

    def predict_many(
        self,
        hidden: np.ndarray,
        code0: Sequence[int],
        samplers: Sequence[Callable[[np.ndarray], int]],
        between: Callable[[int], None] | None = None,
        first_seq: int = 0,
    ) -> tuple[np.ndarray, np.ndarray]:
        """`predict` for several streams at once (hidden [S, talker hidden], one code0 and one
        sampler each): codes [S, 16], embeddings [S, H]. Each stream has its own KV slot
        (`first_seq` onwards) and its own rows in each step's graph, so its codes do not depend
        on the others; `between(seq)` runs between two steps, and may predict other streams'
        frames in the slots from `seq` on. The steps after the first run in C where they can
        (`code_step`)."""
        n = len(code0)
        if first_seq + n > self.max_streams:
            raise ValueError(f"{first_seq + n} sequences > the code predictor's {self.max_streams}")
        codes = np.empty((n, self.n_groups + 1), dtype=np.int64)
        codes[:, 0] = code0
        seqs = range(first_seq, first_seq + n)
        sums = np.stack([self._talker_embd.row(int(c)) for c in code0])  # the talker's next inputs
        logits = self._step(1, self._first(seqs, hidden, sums))
        codes[:, 1] = [self._draw(1, sample, row) for sample, row in zip(samplers, logits)]
        last = codes[:, 1].copy()
        native = None
        ours = [s for s in samplers if isinstance(s, CodeSampler)]
        if code_step.kernel() is not None and self._embd.qtype in code_step.TYPES and len(ours) == n:
            # the steps' tables: the last one's rows are added after the frame's last draw
            native = code_step.CodeSteps(ours, last, sums, self._embd.raw[:-1], self._embd.qtype)
        cores, j = self.lm.cores, 2
        while j <= self.n_groups:
            if between is not None:
                between(first_seq + n)
            if native is not None:  # the steps left in one C call, until the cores' sharing changes
                seen = int(cores.changes[0])  # before the threads are chosen
                threads = cores.threads(self.lm.threads)
                left = [self.lm.replay(seqs, i, "head", i - 1, threads) for i in range(j, self.n_groups + 1)]
                replays = [r for r in left if r is not None]
                if len(replays) == len(left):  # none missing
                    done = native.run(replays, threads, j - 2, cores.changes, seen)
                    codes[:, j : j + done] = native.out[j - 2 : j - 2 + done].T
                    j += done
                    continue
            rows = np.stack([self._embd.row(j - 2, int(c)) for c in last])
            sums += rows
            logits = self._step(j, [(seq, row[None], j) for seq, row in zip(seqs, rows)])
            draws = samplers if native is None else [native.drawer(s, j - 2) for s in range(n)]
            last[:] = [self._draw(j, sample, row) for sample, row in zip(draws, logits)]
            codes[:, j] = last
            j += 1
        sums += np.stack([self._embd.row(self.n_groups - 1, int(c)) for c in last])
        return codes, sums

    def _first(self, seqs: range, hidden: np.ndarray, talker_rows: np.ndarray) -> list[Part]:
        """Codebook 1's parts: h and C_talker(code0) at positions 0 and 1 of each stream."""
        parts = []
        for seq, h, row in zip(seqs, hidden, talker_rows):
            parts += [(seq, np.asarray(h, np.float32)[None], 0), (seq, row[None], 1)]
        return parts

    def _draw(self, codebook: int, sample: Callable[[np.ndarray], int], logits: np.ndarray) -> int:
        code = int(sample(logits))
        if not 0 <= code < self.vocab_size:
            raise ValueError(
                f"sampled code {code} of codebook {codebook} is outside 0..{self.vocab_size - 1}"
            )
        return code

    def teacher_forced_logits(self, hidden: np.ndarray, codes: np.ndarray) -> np.ndarray:
        """[15, vocab]: codebook j's logits given codes 0..j-1 of the frame (the same steps as
        `predict`, fed the given codes)."""
        codes = np.asarray(codes)
        logits = np.empty((self.n_groups, self.vocab_size), dtype=np.float32)
        parts = self._first(range(1), np.asarray(hidden)[None], self._talker_embd.row(int(codes[0]))[None])
        for j in range(1, self.n_groups + 1):
            logits[j - 1] = self._step(j, parts)[0]
            parts = [(0, self._embd.row(j - 1, int(codes[j]))[None], j + 1)]
        return logits

    def embed(self, codes: np.ndarray) -> np.ndarray:
        """The talker's next input for a frame's 16 codes: C_talker(c0) + sum_i cp.embd[i-1](cb_i)."""
        total = self._talker_embd.row(int(codes[0])).copy()
        for j in range(1, self.n_groups + 1):
            total += self._embd.row(j - 1, int(codes[j]))
        return total
