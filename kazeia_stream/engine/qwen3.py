"""A Qwen3 decoder stack fed embeddings, on graphs of our own (`ggml_graph`): the talker and
the code predictor are each one, with their own weights and KV cache.

Rows come in parts: a part is n consecutive rows of one sequence (a slot of the KV cache) from
a position on. A call's graph depends only on its parts' slots, row counts and attention spans
and on the head it applies: positions, KV cache rows and masks are inputs written at each call,
so a stream's steps replay one graph until its span grows past a bucket. Each part is its own
chain of products, and a one-row part multiplies by ggml's one-column kernels: a row's numbers
never depend on the other parts of its call (a stream's codes beside others are its solo ones,
at every weight type), while the products of several parts with one weight run back to back,
the weight in cache after the first. (ggml's several-column Q8_0 kernel cost 2.3x one column's
for two columns on this project's machine.)

The KV cache, per layer and slot, is K as one row per position and V transposed (each
channel's positions contiguous, as the attention's second product reads them), written by
ggml's set_rows at the rows' positions, in memory that is resident only where written
(`Memory`). A part attends over the first `span` positions of its slot (its end rounded up to a
bucket) with the cells after each row's own position masked, so a slot needs no clearing: a
later utterance overwrites the cells it uses.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QType

from ..ggml_lib import quantize
from ..model import gguf_layout as L
from ..model.config import LMConfig, layer_shapes
from ..model.gguf_file import GGUFFile
from .ggml_graph import Allocator, Graph, Memory, Tensor, Weights, dims, strides, view_of
from .threads import SharedCores

# the weights of layer `bid` are named f"{bid}.{role}" (the roles of config.layer_shapes); then
# "output_norm", and for a model that projects its inputs first (the 1.7B code predictor)
# "proj" and "proj_bias"
# graph nodes per part and layer (about 40), and per graph besides
_NODES_PER_LAYER, _NODES_EXTRA = 48, 64
# rows of one part at most: a longer prefill runs as several calls
MAX_PART = 512


def weight_names(layer: dict[str, str], n_layers: int) -> dict[str, str]:
    """Our names of a stack's layer weights (f"{bid}.{role}") -> the file's, from the file's
    pattern per role (`gguf_layout.TALKER_LAYER`, `CP_LAYER`)."""
    return {f"{bid}.{role}": name for (bid, role), name in L.layer_tensors(layer, n_layers).items()}


def weight_types(f: GGUFFile, sources: dict[str, str]) -> dict[str, QType]:
    """The type each weight takes (our name -> the file's tensor): the stored one, but F32 for
    vectors (norms, biases), which ggml's elementwise ops take in F32 only."""
    return {
        name: f.tensor_type(src) if len(f.tensor_shape(src)) > 1 else QType.F32
        for name, src in sources.items()
    }


def file_weights(f: GGUFFile, sources: dict[str, str], types: dict[str, QType]) -> Weights:
    """The weights (our name -> the file's tensor) as ggml tensors: in place in the file's
    mapping where `types` keeps the stored type, else converted (vectors to F32)."""
    converted = {name for name, src in sources.items() if types[name] != f.tensor_type(src)}
    return Weights(
        f,
        {name: src for name, src in sources.items() if name not in converted},
        {name: (types[name], _convert(f.read(sources[name]), types[name])) for name in converted},
    )


def _convert(values: np.ndarray, qtype: QType) -> np.ndarray:
    """float32 values as `qtype` stores them (F32, F16, or quantized rows of bytes)."""
    if qtype == QType.F32:
        return values
    if qtype == QType.F16:
        return values.astype(np.float16)
    return quantize(values, qtype)


Part = tuple[int, np.ndarray, int]  # (slot, rows [n, input width], first position)
_Shape = tuple[tuple[tuple[int, int, int, bool], ...], str]  # (slot, n, span, output) per part; head


@dataclass
class _Call:
    """A built graph and numpy views of its inputs and outputs."""

    graph: Graph
    x: np.ndarray  # [rows, input width]
    positions: np.ndarray  # [rows] int32, RoPE
    k_rows: np.ndarray  # [rows] int64: the K cache row of each
    v_cells: np.ndarray  # [rows, kv_dim] int64: the V cache cell of each channel
    masks: list[np.ndarray]  # per part [n, span]
    hidden: list[np.ndarray]  # per output part [hidden]
    logits: list[np.ndarray]  # per output part [head rows]
    head_index: np.ndarray | None  # [1] int32: which matrix of a stacked (3-D) head


@dataclass
class _Rows:
    """One part inside a graph being built: its slot, row count, span and input tensors."""

    slot: int
    n: int
    span: int
    positions: Tensor
    k_rows: Tensor
    v_cells: Tensor
    mask: Tensor


class Qwen3LM:
    """Feeds parts of embedding rows and returns the final-norm hidden state and the head's
    logits at each part's last row. Which positions a slot holds is the caller's to track."""

    def __init__(
        self,
        weights: Weights,
        cfg: LMConfig,
        *,
        input_width: int,
        slots: int,
        n_ctx: int,
        kv_f32: bool,
        threads: int,
        cores: SharedCores | None = None,
        bucket: int = 64,
        max_graphs: int = 16,
        down_scale: Sequence[float] | None = None,
    ) -> None:
        """`down_scale[bid]`: a power of two ffn_down's input is multiplied by (and its output
        divided by), for an F16 ffn_down whose input would overflow F16."""
        self.weights, self.config = weights, cfg
        self.input_width, self.slots, self.n_ctx, self.bucket = input_width, slots, n_ctx, bucket
        self.kv_f32, self.max_graphs = kv_f32, max_graphs
        self.threads = threads
        self.cores = cores or SharedCores(threads)
        self._down_scale = list(down_scale or [1.0] * cfg.num_layers)
        self.kv_dim = cfg.num_kv_heads * cfg.head_dim
        kv = QType.F32 if kv_f32 else QType.F16
        specs = {}
        for bid in range(cfg.num_layers):
            specs[f"{bid}.k"] = (kv, (slots, n_ctx, self.kv_dim))
            specs[f"{bid}.v"] = (kv, (slots, self.kv_dim, n_ctx))  # transposed
        self.cache = Memory(specs)
        self._channels = np.arange(self.kv_dim, dtype=np.int64) * n_ctx
        self._allocator = Allocator()  # one compute buffer for all the graphs
        self._graphs: OrderedDict[_Shape, _Call] = OrderedDict()

    def close(self) -> None:
        """Free the graphs and the KV cache (the weights are the caller's)."""
        for call in getattr(self, "_graphs", {}).values():
            call.graph.close()
        self._graphs = OrderedDict()
        if hasattr(self, "cache"):
            self.cache.close()
            self._allocator.close()

    __del__ = close

    def set_threads(self, threads: int) -> None:
        self.threads = threads

    def forward(self, embeds: np.ndarray, pos: int, slot: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Rows `embeds` [n, input width] of one slot at positions pos .. pos + n - 1, in parts
        of at most MAX_PART rows: (hidden [hidden], logits) at the last row."""
        out = None
        for start in range(0, len(embeds), MAX_PART):
            out = self.forward_many([(slot, embeds[start : start + MAX_PART], pos + start)])
        assert out is not None
        return out[0][0], out[1][0]

    def forward_many(
        self,
        parts: Sequence[Part],
        head: str = "output",
        head_index: int = 0,
        outputs: Sequence[bool] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """One graph over several parts (slot, rows [n, input width], first position), in
        order (a part may attend to the rows an earlier part of its slot writes): hidden
        [P, hidden] and logits [P, head rows] at the last row of each part whose `outputs` is
        true (every part by default). `head` names the weight applied; a 3-D one is a stack
        of heads, of which `head_index` is applied (an input: one graph serves them all)."""
        outputs = [True] * len(parts) if outputs is None else list(outputs)
        layout = []
        for (slot, rows, pos), out in zip(parts, outputs):
            end = pos + len(rows)
            if not 0 <= slot < self.slots:
                raise ValueError(f"slot {slot} outside 0..{self.slots - 1}")
            if not 0 < len(rows) <= MAX_PART or end > self.n_ctx:
                raise RuntimeError(f"context full: {pos} + {len(rows)} positions > n_ctx {self.n_ctx}")
            layout.append((slot, len(rows), min(self.n_ctx, -(-end // self.bucket) * self.bucket), out))
        call = self._call((tuple(layout), head))
        start = 0
        for (_, rows, pos), mask in zip(parts, call.masks):
            n = len(rows)
            at = np.arange(pos, pos + n)
            call.x[start : start + n] = rows
            call.positions[start : start + n] = at
            call.k_rows[start : start + n] = at
            call.v_cells[start : start + n] = self._channels + at[:, None]
            mask[...] = np.where(np.arange(mask.shape[1]) <= at[:, None], np.float32(0), np.float32(-np.inf))
            start += n
        if call.head_index is not None:
            call.head_index[0] = head_index
        call.graph.compute(self.cores.threads(self.threads))
        return np.stack(call.hidden), np.stack(call.logits)

    def _call(self, shape: _Shape) -> _Call:
        """The graph of a shape: built at its first use, then replayed (the `max_graphs` last
        used are kept; built again if a larger graph moved the compute buffer since)."""
        call = self._graphs.get(shape)
        if call is None or not call.graph.placed:
            if call is not None:
                call.graph.close()
            call = self._graphs[shape] = self._build(*shape)
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)[1].graph.close()
        self._graphs.move_to_end(shape)
        return call

    def _build(self, layout: tuple[tuple[int, int, int, bool], ...], head: str) -> _Call:
        cfg, w = self.config, self.weights
        total = sum(n for _, n, _, _ in layout)
        g = Graph(_NODES_PER_LAYER * cfg.num_layers * len(layout) + _NODES_EXTRA)
        x = g.input(QType.F32, (total, self.input_width))
        positions = g.input(QType.I32, (total,))
        k_rows = g.input(QType.I64, (total,))
        v_cells = g.input(QType.I64, (total, self.kv_dim))
        masks = [g.input(QType.F32, (n, span)) for _, n, span, _ in layout]
        parts, xs, start = [], [], 0
        x_row, v_row = strides(x)[1], strides(v_cells)[1]
        for (slot, n, span, _), mask in zip(layout, masks):
            xs.append(g.view(x, (self.input_width, n), (x_row,), start * x_row))
            parts.append(
                _Rows(
                    slot,
                    n,
                    span,
                    g.view(positions, (n,), offset=4 * start),
                    g.view(k_rows, (n,), offset=8 * start),
                    g.view(v_cells, (self.kv_dim * n,), offset=v_row * start),
                    mask,
                )
            )
            start += n
        if "proj" in w.tensors:
            xs = [g.add(g.mul_mat(w["proj"], row), w["proj_bias"]) for row in xs]
        for bid in range(cfg.num_layers):
            xs = self._layer(g, bid, xs, parts)
        stacked = dims(w[head])[2] > 1
        index = g.input(QType.I32, (1, 1)) if stacked else None
        hidden, logits = [], []
        for y, part, (*_, out) in zip(xs, parts, layout):
            if out:
                row = strides(y)[1]
                last = y if part.n == 1 else g.view(y, (cfg.hidden_size, 1), (row,), (part.n - 1) * row)
                h = g.output(g.mul(g.rms_norm(last, cfg.rms_norm_eps), w["output_norm"]))
                if index is None:
                    logits.append(g.output(g.mul_mat(w[head], h)))
                else:
                    logits.append(g.output(g.mul_mat_id(w[head], g.reshape(h, cfg.hidden_size, 1, 1), index)))
                hidden.append(h)
        g.allocate(self._allocator)
        n_logits = dims(w[head])[1]
        return _Call(
            g,
            view_of(x, QType.F32, (total, self.input_width)),
            view_of(positions, QType.I32, (total,)),
            view_of(k_rows, QType.I64, (total,)),
            view_of(v_cells, QType.I64, (total, self.kv_dim)),
            [view_of(m, QType.F32, (n, span)) for m, (_, n, span, _) in zip(masks, layout)],
            [view_of(h, QType.F32, (cfg.hidden_size,)) for h in hidden],
            [view_of(lg, QType.F32, (n_logits,)) for lg in logits],
            None if index is None else view_of(index, QType.I32, (1,)),
        )

    def _layer(self, g: Graph, bid: int, xs: list[Tensor], parts: list[_Rows]) -> list[Tensor]:
        """One Qwen3 layer (q/k RMSNorm, NeoX RoPE, GQA) over the parts, each op for every part
        before the next op."""
        cfg = self.config
        w = {role: self.weights[f"{bid}.{role}"] for role in layer_shapes(cfg)}
        hd, heads, kvh, eps = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
        k_cache, v_cache = self.cache[f"{bid}.k"], self.cache[f"{bid}.v"]
        knb, vnb = strides(k_cache), strides(v_cache)  # [kv_dim, n_ctx, slot], [n_ctx, kv_dim, slot]

        def normed(x: Tensor, weight: str) -> Tensor:
            return g.mul(g.rms_norm(x, eps), w[weight])

        def roped(x: Tensor, n_heads: int, weight: str, part: _Rows) -> Tensor:
            heads_rows = g.reshape(x, hd, n_heads, part.n)
            return g.rope_neox(normed(heads_rows, weight), part.positions, cfg.rope_theta)

        hs = [normed(x, "attn_norm") for x in xs]
        qs = [g.mul_mat(w["q"], h) for h in hs]
        ks = [g.mul_mat(w["k"], h) for h in hs]
        vs = [g.mul_mat(w["v"], h) for h in hs]
        qs = [roped(q, heads, "q_norm", p) for q, p in zip(qs, parts)]
        ks = [roped(k, kvh, "k_norm", p) for k, p in zip(ks, parts)]
        for k, v, p in zip(ks, vs, parts):
            k_plane = g.view(k_cache, (self.kv_dim, self.n_ctx), (knb[1],), p.slot * knb[2])
            g.set_rows(k_plane, g.reshape(k, self.kv_dim, p.n), p.k_rows)
            v_cells = g.view(v_cache, (1, self.n_ctx * self.kv_dim), (vnb[0],), p.slot * vnb[2])
            g.set_rows(v_cells, g.reshape(v, 1, self.kv_dim * p.n), p.v_cells)
        attended = []
        for q, p in zip(qs, parts):
            keys = g.view(k_cache, (hd, p.span, kvh), (knb[1], hd * knb[0]), p.slot * knb[2])
            values = g.view(v_cache, (p.span, hd, kvh), (vnb[1], hd * vnb[1]), p.slot * vnb[2])
            # [hd, rows, heads]: a kv head serves `heads / kvh` query heads (ggml broadcasts)
            q = g.reshape(q, hd, 1, heads) if p.n == 1 else g.permute(q, 0, 2, 1, 3)
            scores = g.soft_max(g.mul_mat(keys, q), p.mask, 1.0 / math.sqrt(hd))
            out = g.mul_mat(values, scores)  # [hd, rows, heads]
            if p.n > 1:
                out = g.cont(g.permute(out, 0, 2, 1, 3))
            attended.append(g.reshape(out, hd * heads, p.n))
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
