"""The code predictor: codebooks 1..15 of a frame from the talker's hidden state and codebook 0.

Its 5-layer Qwen3 LM runs as graphs of our own on the bundled libggml (`ggml_graph`), one per
step of a frame, built once and replayed: a step is one `ggml_graph_compute`, no graph building,
scheduling or output copies (libllama did all three at each of the 15 decodes per frame). The
weights are the mmproj's `a.gen.code.*` tensors in their stored types, copied once into memory
we own; each head is applied in the graph from the stacked head tensor.

Per frame (positions restart at 0): the inputs are h and C_talker(c0) at positions 0 and 1, then
`codec_embedding[j-1](cb_j)` at position j + 1 for j = 1..14; every input goes through
small_to_mtp_projection when the model has one (1.7B). Codebook j comes from `lm_head[j-1]` at
the last row of step j. Every row is its own chain of matrix-vector products (ggml's one-column
kernels), so a row's numbers never depend on which other rows or streams share its graph;
several rows' products with one weight run back to back while it is in cache (libggml's
several-column Q8_0 path cost 2.3x one column for two columns here). Two rows of one frame in
one graph (positions 0 and 1) are the causal prefill: row 1 attends to the K/V row 0 wrote.

Weight types (`exact=False`, the default): the stored ones, except the F32 `ffn_down` that
converters keep because its input peaks near 1.5e5, beyond F16 (ggml casts a product's input to
the weight's type). In an F16 file it becomes F16, with its input scaled down by 2^-6 and its
output scaled back (powers of two: exact); in a Q8_0 file it becomes Q8_0 (per-block scales, no
range issue). Bytes read per pass at 0.6B: F16 file 189 -> 157 MB, Q8_0 file 130 -> 84 MB.
`exact=True` keeps every stored type (hidden states within ~1e-6 of float32). An all-F32 file
is the same either way. The KV cache is F32, 16 positions per stream (640 KiB at 0.6B).

No state survives a frame: each frame's steps restart at position 0. `predict_many` runs the
steps of up to `max_streams` streams together, each in its own KV slot; between two of its
steps, another call may run in the slots it does not use. One CodePredictor serves one thread
at a time (the runtime's generator thread): its KV cache and graphs are that thread's scratch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from ..errors import ModelFileError
from ..ggml_lib import quantize
from ..model import gguf_layout as L
from ..model.config import CodePredictorConfig
from ..model.gguf_file import GGUFFile
from .ggml_graph import GGML_TYPE_F32, GGML_TYPE_I32, Graph, State, Tensor, Weights, f32_view, nb, type_nbytes
from .threads import SharedCores

# Positions per frame: h, C_talker(c0) and 14 codebook inputs.
_N_POS = 16
# ffn_down's input is multiplied by this before its F16 cast (and the output by the inverse).
_FFN_DOWN_INPUT_SCALE = 2.0**-6
# graph nodes per row (about 40 per layer, the head) and per graph
_NODES_PER_ROW, _NODES_PER_GRAPH = 48, 64

_PLAIN = {QType.F32: np.float32, QType.F16: np.float16}
_LAYER_TENSORS = {
    "attn_norm": L.CP_ATTN_NORM,
    "q": L.CP_ATTN_Q,
    "k": L.CP_ATTN_K,
    "v": L.CP_ATTN_V,
    "o": L.CP_ATTN_OUT,
    "q_norm": L.CP_ATTN_Q_NORM,
    "k_norm": L.CP_ATTN_K_NORM,
    "ffn_norm": L.CP_FFN_NORM,
    "gate": L.CP_FFN_GATE,
    "up": L.CP_FFN_UP,
    "down": L.CP_FFN_DOWN,
}


class _Plan:
    """Which mmproj tensor becomes each weight, in which type, and ffn_down's input scales."""

    def __init__(self, f: GGUFFile, cfg: CodePredictorConfig, exact: bool) -> None:
        self.file = f
        self.sources = {"output_norm": L.CP_OUTPUT_NORM, "head": L.CP_HEAD}
        for bid in range(cfg.num_layers):
            for role, src in _LAYER_TENSORS.items():
                self.sources[f"{bid}.{role}"] = src.format(bid=bid)
        if cfg.has_projection:
            self.sources["proj"] = L.CP_PROJ_IN + ".weight"
            self.sources["proj_bias"] = L.CP_PROJ_IN + ".bias"
        for src in self.sources.values():
            if not f.has_tensor(src):
                raise ModelFileError(f"{f.path}: code predictor tensor {src!r} is missing")
        # vectors (norms, bias) are F32 for ggml's elementwise ops
        self.types = {
            name: f.tensor_type(src) if len(f.tensor_shape(src)) > 1 else QType.F32
            for name, src in self.sources.items()
        }
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

    def data(self, name: str) -> np.ndarray:
        """The stored data of a weight (converted if planned)."""
        src = self.sources[name]
        stored, wanted = self.file.tensor_type(src), self.types[name]
        if wanted == stored:
            return self.file.raw(src)
        if wanted == QType.F32:
            return self.file.read(src)
        if wanted == QType.F16:
            return self.file.read(src).astype(np.float16)
        return quantize(self.file.read(src), wanted)

    def nbytes(self, name: str) -> int:
        return type_nbytes(self.types[name], self.shape(name))


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
        self.threads = threads
        self.cores = cores or SharedCores(threads)
        self._embd = _Table(f, L.CP_EMBD)  # [15, 2048, talker hidden]
        self._talker_embd = _Table(f, L.CP_OUT_EMBD)  # [codec vocab, talker hidden]
        self.talker_hidden = f.tensor_shape(L.CP_EMBD)[-1]
        plan = _Plan(f, cfg, exact)
        self._down_scale = plan.down_scale
        self._weights = Weights(
            [(name, plan.types[name], plan.shape(name), plan.data(name)) for name in plan.sources]
        )
        # what a pass reads: every weight but the heads, and one head
        n_heads = plan.shape("head")[0]
        self.bytes_per_pass = sum(plan.nbytes(n) for n in plan.sources if n != "head")
        self.bytes_per_pass += plan.nbytes("head") // n_heads
        self.params_per_pass = sum(int(np.prod(plan.shape(n))) for n in plan.sources if n != "head")
        self.params_per_pass += int(np.prod(plan.shape("head"))) // n_heads
        hd, kvh = cfg.head_dim, cfg.num_kv_heads
        shapes = {
            "positions": (GGML_TYPE_I32, (_N_POS,)),
            "input": (GGML_TYPE_F32, (2 * max_streams, self.talker_hidden)),
        }
        for bid in range(cfg.num_layers):
            shapes[f"{bid}.k"] = (GGML_TYPE_F32, (max_streams, kvh, _N_POS, hd))
            shapes[f"{bid}.v"] = (GGML_TYPE_F32, (max_streams, kvh, hd, _N_POS))  # transposed
        self._state = State(shapes)
        self._state.arrays["positions"][:] = np.arange(_N_POS)
        self._input = self._state.arrays["input"]
        self._graphs: dict[tuple[int, int, int], tuple[Graph, list[np.ndarray]]] = {}

    def close(self) -> None:
        """Free the graphs, the KV cache and the weights (once; also when collected)."""
        for graph, _ in getattr(self, "_graphs", {}).values():
            graph.close()
        self._graphs = {}
        for part in ("_state", "_weights"):
            if hasattr(self, part):
                getattr(self, part).close()

    __del__ = close

    def set_threads(self, threads: int) -> None:
        self.threads = threads

    def _graph(self, step: int, first_seq: int, n: int) -> tuple[Graph, list[np.ndarray]]:
        """The graph of codebook `step` for the streams in KV slots first_seq .. + n - 1, and
        views of their logits: built at its first use, then replayed."""
        key = (step, first_seq, n)
        if key not in self._graphs:
            self._graphs[key] = self._build(step, first_seq, n)
        return self._graphs[key]

    @staticmethod
    def _input_row(seq: int, pos: int) -> int:
        """Slot `seq`'s input row for position `pos`: two rows per slot, h and C_talker(c0)
        at positions 0 and 1, then the first row again for each later position."""
        return 2 * seq + (pos if pos < 2 else 0)

    def _build(self, step: int, first_seq: int, n: int) -> tuple[Graph, list[np.ndarray]]:
        cfg, w = self.config, self._weights
        positions = (0, 1) if step == 1 else (step,)
        rows = [(seq, p) for seq in range(first_seq, first_seq + n) for p in positions]
        g = Graph(_NODES_PER_ROW * cfg.num_layers * len(rows) + _NODES_PER_GRAPH)
        inp = self._state["input"]
        row_bytes = nb(inp)[1]
        xs = [
            g.view(inp, (self.talker_hidden, 1), (row_bytes,), self._input_row(seq, p) * row_bytes)
            for seq, p in rows
        ]
        if "proj" in w.tensors:
            xs = [g.add(g.mul_mat(w["proj"], x), w["proj_bias"]) for x in xs]
        for bid in range(cfg.num_layers):
            xs = self._layer(g, bid, xs, rows)
        head = g.matrix(w["head"], step - 1)
        logits = [
            g.output(g.mul_mat(head, g.mul(g.rms_norm(x, cfg.rms_norm_eps), w["output_norm"])))
            for x, (_, p) in zip(xs, rows)
            if p == positions[-1]
        ]
        g.allocate()
        return g, [f32_view(t, (self.vocab_size,)) for t in logits]

    def _layer(self, g: Graph, bid: int, xs: list[Tensor], rows: list[tuple[int, int]]) -> list[Tensor]:
        """One Qwen3 layer (q/k RMSNorm, NeoX RoPE, GQA) over rows (KV slot, position), each
        op for every row before the next op."""
        cfg, st = self.config, self._state
        w = {role: self._weights[f"{bid}.{role}"] for role in _LAYER_TENSORS}
        hd, heads, kvh, eps = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
        k_cache, v_cache = st[f"{bid}.k"], st[f"{bid}.v"]  # [hd, pos, kvh, slot], [pos, hd, kvh, slot]
        knb, vnb = nb(k_cache), nb(v_cache)

        def normed(x: Tensor, weight: str) -> Tensor:
            return g.mul(g.rms_norm(x, eps), w[weight])

        def roped(x: Tensor, n_heads: int, weight: str, pos: int) -> Tensor:
            position = g.view(st["positions"], (1,), offset=4 * pos)
            return g.rope_neox(normed(g.reshape(x, hd, n_heads, 1), weight), position, cfg.rope_theta)

        hs = [normed(x, "attn_norm") for x in xs]
        qs = [g.mul_mat(w["q"], h) for h in hs]
        ks = [g.mul_mat(w["k"], h) for h in hs]
        vs = [g.mul_mat(w["v"], h) for h in hs]
        qs = [roped(q, heads, "q_norm", p) for q, (_, p) in zip(qs, rows)]
        ks = [roped(k, kvh, "k_norm", p) for k, (_, p) in zip(ks, rows)]
        for k, v, (seq, p) in zip(ks, vs, rows):
            g.cpy(
                g.reshape(k, hd, 1, kvh), g.view(k_cache, (hd, 1, kvh), knb[1:3], seq * knb[3] + p * knb[1])
            )
            g.cpy(
                g.reshape(v, 1, hd, kvh), g.view(v_cache, (1, hd, kvh), vnb[1:3], seq * vnb[3] + p * vnb[0])
            )
        attended = []
        for q, (seq, p) in zip(qs, rows):
            keys = g.view(k_cache, (hd, p + 1, kvh), knb[1:3], seq * knb[3])
            values = g.view(v_cache, (p + 1, hd, kvh), vnb[1:3], seq * vnb[3])
            weights = g.soft_max(g.mul_mat(keys, g.reshape(q, hd, 1, heads)), 1.0 / math.sqrt(hd))
            attended.append(g.reshape(g.mul_mat(values, weights), hd * heads, 1))
        xs = [g.add(x, g.mul_mat(w["o"], a)) for x, a in zip(xs, attended)]
        hs = [normed(x, "ffn_norm") for x in xs]
        gates = [g.mul_mat(w["gate"], h) for h in hs]
        ups = [g.mul_mat(w["up"], h) for h in hs]
        acts = [g.swiglu(a, b) for a, b in zip(gates, ups)]
        scale = self._down_scale[bid]
        if scale != 1.0:
            acts = [g.scale(a, scale) for a in acts]
        downs = [g.mul_mat(w["down"], a) for a in acts]
        if scale != 1.0:
            downs = [g.scale(d, 1.0 / scale) for d in downs]
        return [g.add(x, d) for x, d in zip(xs, downs)]

    def _step(self, step: int, first_seq: int, n: int) -> list[np.ndarray]:
        """Run codebook `step`'s graph on its input rows: each stream's logits [vocab] (views,
        valid until the graph runs again)."""
        graph, logits = self._graph(step, first_seq, n)
        graph.compute(self.cores.threads(self.threads))
        return logits

    def _start(self, first_seq: int, hidden: np.ndarray, code0: Sequence[int]) -> None:
        """Write each stream's first two input rows: h and C_talker(code0)."""
        for seq, h, c in zip(range(first_seq, first_seq + len(code0)), hidden, code0):
            self._input[self._input_row(seq, 0)] = h
            self._input[self._input_row(seq, 1)] = self._talker_embd.row(int(c))

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
        frames in the slots from `seq` on."""
        n = len(code0)
        if first_seq + n > self.max_streams:
            raise ValueError(f"{first_seq + n} sequences > the code predictor's {self.max_streams}")
        codes = np.empty((n, self.n_groups + 1), dtype=np.int64)
        codes[:, 0] = code0
        self._start(first_seq, hidden, code0)
        for j in range(1, self.n_groups + 1):
            logits = self._step(j, first_seq, n)
            for s in range(n):
                code = int(samplers[s](logits[s]))
                if not 0 <= code < self.vocab_size:
                    raise ValueError(
                        f"sampled code {code} of codebook {j} is outside 0..{self.vocab_size - 1}"
                    )
                codes[s, j] = code
                self._input[self._input_row(first_seq + s, j + 1)] = self._embd.row(j - 1, code)
            if between is not None and j < self.n_groups:
                between(first_seq + n)
        return codes, np.stack([self.embed(c) for c in codes])

    def teacher_forced_logits(self, hidden: np.ndarray, codes: np.ndarray) -> np.ndarray:
        """[15, vocab]: codebook j's logits given codes 0..j-1 of the frame (the same steps as
        `predict`, fed the given codes)."""
        codes = np.asarray(codes)
        logits = np.empty((self.n_groups, self.vocab_size), dtype=np.float32)
        self._start(0, np.asarray(hidden, np.float32)[None], [int(codes[0])])
        for j in range(1, self.n_groups + 1):
            logits[j - 1] = self._step(j, 0, 1)[0]
            self._input[self._input_row(0, j + 1)] = self._embd.row(j - 1, int(codes[j]))
        return logits

    def embed(self, codes: np.ndarray) -> np.ndarray:
        """The talker's next input for a frame's 16 codes: C_talker(c0) + sum_i cp.embd[i-1](cb_i)."""
        total = self._talker_embd.row(int(codes[0])).copy()
        for j in range(1, self.n_groups + 1):
            total += self._embd.row(j - 1, int(codes[j]))
        return total
