"""A Qwen3 decoder stack fed embeddings, on graphs of our own (`ggml_graph`): the talker and
the code predictor are each one, with their own weights and KV cache.

Rows come in parts: a part is n consecutive rows of one sequence (a slot of the KV cache) from
a position on. A call's graph depends only on its parts' slots, row counts and attention spans
and on the head it applies: positions, KV cache rows and masks are inputs written at each call,
so a stream's steps replay one graph until its span grows past a bucket. The call's rows go
through each layer together: the row-wise ops once, the attention per part (or, for parts of
one row in consecutive slots over one span, as one batch over the slots: `_batched`; for parts
of one row each, steps, as one operation of ours: `_attends`), and each product as `_product`
allows, so that a row's numbers never depend on the other parts of its call (a stream's codes
beside others are its solo ones, at every weight type).

The KV cache, per layer and slot, is K as one row per position and V transposed in blocks of
`V_BLOCK` positions (in a block, each channel's positions contiguous, as the attention's
second product reads them: one product per block), written by ggml's set_rows at the rows'
positions, in memory that is resident only where written (`Memory`): a slot holds the blocks
its positions reached, where whole transposed rows would put a page of every channel in
memory at its first position. A part attends over the first `span` positions of its slot (its
end rounded up to a bucket) with the cells after each row's own position masked, so a slot
needs no clearing: a later utterance overwrites the cells it uses.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
from gguf import GGMLQuantizationType as QType

from ..ggml_lib import quantize
from ..model import gguf_layout as L
from ..model.config import LMConfig, layer_shapes
from ..model.gguf_file import GGUFFile
from . import kquant_product, kv_product, q8_product
from .faster import Faster
from .ggml_graph import (
    Allocator,
    Graph,
    Memory,
    Tensor,
    Weights,
    columns_agree,
    dims,
    strides,
    view_of,
)
from .quantized_product import Kernel
from .threads import SharedCores

# the weights of layer `bid` are named f"{bid}.{role}" (the roles of config.layer_shapes); then
# "output_norm", and for a model that projects its inputs first (the 1.7B code predictor)
# "proj" and "proj_bias"
# a graph's tensors, at most, per layer (about 80) and per part and layer (about 40); as many
# again for the input projection, the final norm and the head
_NODES_PER_LAYER, _NODES_PER_PART = 96, 48
# rows of one part at most: a longer prefill runs as several calls
MAX_PART = 512
# positions per block of the transposed V cache: a block of a layer's channels is 0.5 MiB at
# the 0.6B's 1024 channels in F16 (all 2048 positions' rows: 4 MiB, resident from the first)
V_BLOCK = 256
# a graph's tensors per layer, part and V block after the first (two views, a copy, a product,
# a sum)
_NODES_PER_BLOCK = 5


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
        {name: (types[name], convert(f.read(sources[name]), types[name])) for name in converted},
    )


def convert(values: np.ndarray, qtype: QType) -> np.ndarray:
    """float32 values as `qtype` stores them (F32, F16, or quantized rows of bytes)."""
    if qtype == QType.F32:
        return values
    if qtype == QType.F16:
        return values.astype(np.float16)
    return quantize(values, qtype)


def matrix_macs(weights: Iterable[tuple[QType, Sequence[int]]]) -> dict[QType, int]:
    """Multiply-adds of one row through the matrices among `weights` ((type, shape) each; a
    vector multiplies nothing), by weight type."""
    macs: Counter[QType] = Counter()
    for qtype, shape in weights:
        if len(shape) > 1:
            macs[qtype] += math.prod(shape)
    return dict(macs)


_KERNELS = (q8_product.KERNEL, kquant_product.Q4_K, kquant_product.Q5_K, kquant_product.Q6_K)


def product_kernel(w: Tensor) -> Kernel | None:
    """Our kernel that multiplies weight `w` (`q8_product`, `kquant_product`), if one does."""
    return next((k for k in _KERNELS if k.takes(w)), None)


Part = tuple[int, np.ndarray, int]  # (slot, rows [n, input width], first position)
_Layout = tuple[tuple[int, int, int, bool], ...]  # (slot, n, span, output) per part
# layout; head; several-column products together (`_product`)
_Shape = tuple[_Layout, str, bool]


@dataclass
class _Call:
    """A built graph and numpy views of its inputs and outputs."""

    graph: Graph
    x: np.ndarray  # [rows, input width]
    positions: np.ndarray  # [rows] int32, RoPE
    # the inputs of the attention's ggml operations (none where a step attends in one, `_attends`):
    k_rows: np.ndarray | None  # [rows] int64: the K cache row of each (the slots' rows end to end)
    v_cells: np.ndarray | None  # [rows, kv_dim] int64: the V cache cell of each channel (likewise)
    masks: list[np.ndarray]  # per part [n, span]
    hidden: np.ndarray  # [output parts, hidden]
    logits: np.ndarray  # [output parts, head rows]
    head_index: np.ndarray | None  # [output parts] int32: which matrix of a stacked (3-D) head
    replays: dict[tuple[tuple[int, ...], int, int], Replay] = field(default_factory=dict)  # `replay`'s


@dataclass(eq=False)
class Replay:
    """A graph ready to run but for its input rows: `x` [rows, input width] to write, the
    other inputs to copy from arrays made once (destination view, source), `logits` [rows,
    head rows] to read after."""

    graph: Graph
    x: np.ndarray
    logits: np.ndarray
    inputs: list[tuple[np.ndarray, np.ndarray]]


@dataclass
class _Rows:
    """One part inside a graph being built: its slot, row count, span, first row among the
    call's rows, and its mask input."""

    slot: int
    n: int
    span: int
    start: int
    mask: Tensor | None  # none where the call attends in one operation (`_attends`)


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
        self.v_block = min(V_BLOCK, n_ctx)
        self.v_blocks = -(-n_ctx // self.v_block)
        kv = self._kv_type = QType.F32 if kv_f32 else QType.F16
        specs: dict[str, tuple[QType, tuple[int, ...]]] = {}
        for bid in range(cfg.num_layers):
            specs[f"{bid}.k"] = (kv, (slots, n_ctx, self.kv_dim))
            specs[f"{bid}.v"] = (kv, (slots, self.v_blocks, self.kv_dim, self.v_block))  # transposed
        self.cache = Memory(specs)
        self._channels = np.arange(self.kv_dim, dtype=np.int64) * self.v_block
        self._allocator = Allocator()  # one compute buffer for all the graphs
        self._graphs: OrderedDict[_Shape, _Call] = OrderedDict()
        self._together = Faster()  # per (rows, threads) of a call: see `_product`

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
        layout = self._layout(parts, outputs)
        total = sum(n for _, n, _, _ in layout)
        threads = self.cores.threads(self.threads)
        timed = self._two_ways(total)
        together = timed and self._together.pick((total, threads))
        call = self._call((layout, head, together))
        self._write(call, parts, head_index)
        began = time.perf_counter()
        call.graph.compute(threads)
        if timed:
            self._together.record((total, threads), together, time.perf_counter() - began)
        return call.hidden.copy(), call.logits.copy()

    def build(
        self, parts: Sequence[Part], head: str = "output", outputs: Sequence[bool] | None = None
    ) -> bool:
        """Build the graph that `forward_many` takes for such parts, ahead of their first call
        (graphs took 4-21 ms each to build on Zen 1): whether it did (not where that call would
        time two graphs first, `_together`). A larger graph built later makes it stale."""
        layout = self._layout(parts, outputs)
        if self._two_ways(sum(n for _, n, _, _ in layout)):
            return False
        self._call((layout, head, False))
        return True

    def replay(
        self, slots: Sequence[int], pos: int, head: str, head_index: int, threads: int
    ) -> Replay | None:
        """The graph of one row in each of `slots` at position `pos` (their spans' end), to run
        on `threads`, with its inputs but the rows as arrays made once (each a step of a stream
        whose positions restart: the code predictor's). None while `forward_many` still times
        calls of its kind (`_together`): run it there."""
        rows = [(slot, np.zeros((1, self.input_width), np.float32), pos) for slot in slots]
        layout = self._layout(rows, None)
        together: bool | None = False
        if self._two_ways(len(rows)):
            together = self._together.chosen.get((len(rows), threads))
        if together is None:
            return None
        call = self._call((layout, head, together))
        key = (tuple(slots), pos, head_index)
        if key not in call.replays:
            fields = [f for f in ("positions", "k_rows", "v_cells") if getattr(call, f) is not None]
            arrays = {f: np.empty_like(getattr(call, f)) for f in ("x", *fields)}
            masks = [np.empty_like(m) for m in call.masks]
            index = None if call.head_index is None else np.empty_like(call.head_index)
            shadow = replace(call, **arrays, masks=masks, head_index=index)
            self._write(shadow, rows, head_index)
            pairs = [(getattr(call, f), arrays[f]) for f in fields]
            pairs += list(zip(call.masks, masks))
            if index is not None:
                pairs.append((call.head_index, index))
            call.replays[key] = Replay(call.graph, call.x, call.logits, pairs)
        return call.replays[key]

    def _layout(self, parts: Sequence[Part], outputs: Sequence[bool] | None) -> _Layout:
        """(slot, n, span, output) of each part, checked."""
        outputs = [True] * len(parts) if outputs is None else list(outputs)
        layout = []
        for (slot, rows, pos), out in zip(parts, outputs):
            end = pos + len(rows)
            if not 0 <= slot < self.slots:
                raise ValueError(f"slot {slot} outside 0..{self.slots - 1}")
            if not 0 < len(rows) <= MAX_PART or end > self.n_ctx:
                raise RuntimeError(f"context full: {pos} + {len(rows)} positions > n_ctx {self.n_ctx}")
            layout.append((slot, len(rows), min(self.n_ctx, -(-end // self.bucket) * self.bucket), out))
        return tuple(layout)

    def _write(self, call: _Call, parts: Sequence[Part], head_index: int) -> None:
        """Write a call's inputs for its parts (their rows, positions, cache cells and masks)."""
        start = 0
        for i, (slot, rows, pos) in enumerate(parts):
            n = len(rows)
            at = np.arange(pos, pos + n)
            call.x[start : start + n] = rows
            call.positions[start : start + n] = at
            if call.k_rows is not None and call.v_cells is not None:
                call.k_rows[start : start + n] = slot * self.n_ctx + at
                block = slot * self.v_blocks + at // self.v_block
                cell = block * self.kv_dim * self.v_block + at % self.v_block
                call.v_cells[start : start + n] = cell[:, None] + self._channels
                mask = call.masks[i]
                mask[...] = np.where(
                    np.arange(mask.shape[1]) <= at[:, None], np.float32(0), np.float32(-np.inf)
                )
            start += n
        if call.head_index is not None:
            call.head_index[...] = head_index

    def cells(self, slot: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The KV cache of slot `slot`'s first `n` positions: K and V, each [layers, n, kv
        channels] (`set_cells` writes them back)."""
        blocks = -(-n // self.v_block)
        k = [k[slot, :n] for k, _ in self._kv]
        v = [v[slot, :blocks].transpose(0, 2, 1).reshape(-1, self.kv_dim)[:n] for _, v in self._kv]
        return np.stack(k), np.stack(v)

    def set_cells(self, slot: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write K and V (as `cells` gives them) into slot `slot`'s first positions."""
        n = k.shape[1]
        for (k_cache, v_cache), k_layer, v_layer in zip(self._kv, k, v):
            k_cache[slot, :n] = k_layer
            for first in range(0, n, self.v_block):
                rows = v_layer[first : first + self.v_block]
                v_cache[slot, first // self.v_block, :, : len(rows)] = rows.T

    @property
    def kv_dtype(self) -> np.dtype:
        """The KV cache's numpy type (`cells` gives it)."""
        return self._kv[0][0].dtype

    @cached_property
    def _kv(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each layer's K [slots, n_ctx, kv channels] and transposed V [slots, blocks, kv
        channels, positions], as numpy views."""
        kv = self._kv_type
        return [
            (
                view_of(self.cache[f"{bid}.k"], kv, (self.slots, self.n_ctx, self.kv_dim)),
                view_of(self.cache[f"{bid}.v"], kv, (self.slots, self.v_blocks, self.kv_dim, self.v_block)),
            )
            for bid in range(self.config.num_layers)
        ]

    def _slot_cells(self, slot: int, keep: int = 0) -> Iterator[tuple[str, int, int]]:
        """(tensor, start, end): the bytes of slot `slot`'s K and V in every layer from position
        `keep` on (V's from the block that holds it)."""
        for bid in range(self.config.num_layers):
            k, v = f"{bid}.k", f"{bid}.v"
            knb, vnb = strides(self.cache[k]), strides(self.cache[v])  # [.., n_ctx, slot], [.., block, slot]
            yield k, slot * knb[2] + keep * knb[1], (slot + 1) * knb[2]
            yield v, slot * vnb[3] + -(-keep // self.v_block) * vnb[2], (slot + 1) * vnb[3]

    def populate(self, slot: int) -> None:
        """Make resident now the first page of slot `slot`'s K and V in every layer: what its
        first utterance's first write there would fault in (`Memory.populate`)."""
        for name, start, _ in self._slot_cells(slot):
            self.cache.populate(name, start, start + 1)

    def release(self, slot: int, keep: int) -> None:
        """Give back the memory of slot `slot`'s cells from position `keep` on (its utterance
        has ended; the rows before `keep` stay cached): an idle slot holds only what it keeps.
        Those cells read as zeros until written again; no step reads a cell its own utterance
        has not written (the masks)."""
        for name, start, end in self._slot_cells(slot, keep):
            self.cache.release(name, start, end)

    def _two_ways(self, rows: int) -> bool:
        """Whether a call of `rows` rows has two graphs that differ, which `_together` times."""
        return rows > 1 and self._shares_columns

    @cached_property
    def _shares_columns(self) -> bool:
        """Whether some product can give several rows one kernel call (`columns_agree`) or
        not: only then do the two ways that `_together` times differ (our kernels take every
        row at once, `product_kernel`)."""
        return any(
            product_kernel(w) is None and columns_agree(w)  # a kernel's: no probe needed
            for w in self.weights.tensors.values()
            if dims(w)[1] > 1
        )

    def _call(self, shape: _Shape) -> _Call:
        """The graph of a shape: built at its first use, then replayed (the `max_graphs` last
        used are kept, twice that while `_together` still tries both ways of some; built again
        if a larger graph moved the compute buffer since)."""
        call = self._graphs.get(shape)
        if call is None or not call.graph.placed:
            if call is not None:
                call.graph.close()
            call = self._graphs[shape] = self._build(*shape)
        self._graphs.move_to_end(shape)
        while len(self._graphs) > self.max_graphs * (1 + bool(self._together.trying)):
            self._graphs.popitem(last=False)[1].graph.close()
        return call

    def _build(self, layout: _Layout, head: str, together: bool) -> _Call:
        cfg, w = self.config, self.weights
        total = sum(n for _, n, _, _ in layout)
        per_parts = sum(
            _NODES_PER_PART + _NODES_PER_BLOCK * (span // self.v_block) for _, _, span, _ in layout
        )
        g = Graph((cfg.num_layers + 1) * (_NODES_PER_LAYER + per_parts))
        x = g.input(QType.F32, (total, self.input_width))
        positions = g.input(QType.I32, (total,))
        attends = self._attends(layout)  # else the cells the rows' K and V go to are inputs
        cells = None if attends else (g.input(QType.I64, (total,)), g.input(QType.I64, (total, self.kv_dim)))
        parts, start = [], 0
        batched = not attends and self._batched(layout)
        # a batch's parts share one mask input, a part's in each row; a step attending in one
        # operation needs none
        shared = g.input(QType.F32, (len(layout), 1, 1, layout[0][2])) if batched else None
        for slot, n, span, _ in layout:
            mask = None if attends else shared if shared is not None else g.input(QType.F32, (n, span))
            parts.append(_Rows(slot, n, span, start, mask))
            start += n
        columns = [(p.start, p.n) for p in parts]
        h = x
        if "proj" in w.tensors:
            h = g.add(self._product(g, "proj", h, columns, together), w["proj_bias"])
        for bid in range(cfg.num_layers):
            h = self._layer(g, bid, h, parts, positions, cells, together, batched)
        outs = [p for p, (*_, out) in zip(parts, layout) if out]  # their last rows
        row = strides(h)[1]
        last = g.join([g.view(h, (cfg.hidden_size, 1), (row,), (p.start + p.n - 1) * row) for p in outs])
        hidden = g.output(g.mul(g.rms_norm(last, cfg.rms_norm_eps), w["output_norm"]))
        index = g.input(QType.I32, (len(outs), 1)) if dims(w[head])[2] > 1 else None
        logits = g.output(self._product(g, head, hidden, [(i, 1) for i in range(len(outs))], together, index))
        g.allocate(self._allocator)
        return _Call(
            g,
            view_of(x, QType.F32, (total, self.input_width)),
            view_of(positions, QType.I32, (total,)),
            None if cells is None else view_of(cells[0], QType.I64, (total,)),
            None if cells is None else view_of(cells[1], QType.I64, (total, self.kv_dim)),
            list(view_of(shared, QType.F32, (len(parts), 1, parts[0].span)))
            if shared is not None
            else [view_of(p.mask, QType.F32, (p.n, p.span)) for p in parts if p.mask is not None],
            view_of(hidden, QType.F32, (len(outs), cfg.hidden_size)),
            view_of(logits, QType.F32, (len(outs), dims(w[head])[1])),
            None if index is None else view_of(index, QType.I32, (len(outs),)),
        )

    def _product(
        self,
        g: Graph,
        name: str,
        x: Tensor,
        parts: Sequence[tuple[int, int]],
        together: bool,
        index: Tensor | None = None,
        norm: str | None = None,
        residual: Tensor | None = None,
    ) -> Tensor:
        """Weight `name` times the columns of x [in, rows], in parts (first column, count);
        `index`: which matrix of a stacked weight each column takes; `norm` (on our kernels
        only: `_layer`'s `products`): the weight of an RMS norm each column takes first;
        `residual` [out, rows]: added to the product.

        A Q8_0, Q4_K, Q5_K or Q6_K matrix, or a stack (the code predictor's heads), multiplies
        every column at once on our kernel of its type, where it runs (`q8_product`,
        `kquant_product`). Else, where ggml's several-column kernel gives each column its
        one-column numbers (`columns_agree`: Q8_0 here), the columns are multiplied
        `together` by it, or the first alone and the others together, whichever runs faster
        on this CPU (`Faster`): on a Zen 5 the several-column kernel
        read a weight from memory several times slower than the one-column one and about as
        fast from the cache, where the first product leaves it (4 one-row parts on one thread:
        46 against 57 ms for the talker's products); on a Xeon of family 6 model 207 all
        together was faster (130-143 against 178-182 ms). Else each part is multiplied alone,
        as it would be without the others. Our kernels apply the norm and add the residual
        in their operation (ggml's numbers: tested); else the residual is ggml's add."""
        w, width, rows = self.weights[name], dims(x)[0], dims(x)[1]
        kernel = product_kernel(w)
        if kernel is not None:  # all rows at once: each row's numbers its own
            scaled = None if norm is None else (self.weights[norm], self.config.rms_norm_eps)
            return kernel.product(g, w, x, ids=index, norm=scaled, residual=residual)
        assert norm is None, "only our kernels norm their rows"
        if index is not None:
            x = g.reshape(x, width, 1, rows)  # mul_mat_id takes [in, 1, rows]
        if rows > 1 and columns_agree(w):
            parts = [(0, rows)] if together else [(0, 1), (1, rows - 1)]
        nb = strides(x)

        def product(start: int, n: int) -> Tensor:
            if index is None:
                return g.mul_mat(w, g.view(x, (width, n), (nb[1],), start * nb[1]))
            y = g.mul_mat_id(
                w,
                g.view(x, (width, 1, n), (nb[1], nb[2]), start * nb[2]),
                g.view(index, (1, n), (4,), 4 * start),
            )
            return g.reshape(y, dims(y)[0], n)

        y = g.join([product(start, n) for start, n in parts])
        return y if residual is None else g.add(residual, y)

    def _attended(self, g: Graph, v_cache: Tensor, scores: Tensor, p: _Rows) -> Tensor:
        """The values weighted by scores [span, rows, heads] of part p: one product per V
        block its span reaches, summed (a span within one block: the one product)."""
        cfg, vnb, snb = self.config, strides(v_cache), strides(scores)
        hd, kvh = cfg.head_dim, cfg.num_kv_heads
        out = None
        for first in range(0, p.span, self.v_block):
            n = min(self.v_block, p.span - first)
            at = p.slot * vnb[3] + first // self.v_block * vnb[2]
            values = g.view(v_cache, (n, hd, kvh), (vnb[1], hd * vnb[1]), at)
            weights = scores
            if n < p.span:  # contiguous for several rows: ggml's several-column kernel wants it
                weights = g.view(scores, (n, p.n, cfg.num_heads), snb[1:3], first * snb[0])
                weights = g.cont(weights) if p.n > 1 else weights
            piece = _cache_product(g, values, weights)
            out = piece if out is None else g.add(out, piece)
        assert out is not None
        return out

    def _attends(self, layout: _Layout) -> bool:
        """Whether each layer's attention runs as one operation (`kv_product.attend`): parts of
        one row each (steps), where the kernel runs for this cache."""
        cfg = self.config
        return all(n == 1 for _, n, _, _ in layout) and kv_product.attends(
            self._kv_type, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        )

    def _batched(self, layout: _Layout) -> bool:
        """Whether a call's parts attend as one batch of operations over their slots (`_attention`):
        several parts of one row each, in slots one after another, over one span within a V
        block (a code-predictor step of several streams; talker steps of streams whose spans
        agree). ggml multiplies and normalizes each entry of a batch apart, so every part gets
        the numbers it gets alone (tested bit for bit), with fewer operations and no join."""
        first, _, span, _ = layout[0]
        return (
            len(layout) > 1
            and span <= self.v_block
            and all(p == (first + i, 1, span, p[3]) for i, p in enumerate(layout))
        )

    def _layer(
        self,
        g: Graph,
        bid: int,
        x: Tensor,
        parts: list[_Rows],
        positions: Tensor,
        cells: tuple[Tensor, Tensor] | None,
        together: bool,
        batched: bool,
    ) -> Tensor:
        """One Qwen3 layer (q/k RMSNorm, NeoX RoPE, GQA) over the call's rows x [hidden, rows]:
        the row-wise ops on all the rows at once, the products as `_product` allows, the
        attention per part, or `batched` (`_batched`) as one batch over the parts' slots, or,
        without `cells` (the K rows and V cells the rows go to), in one operation
        (`_attends`)."""
        cfg = self.config
        w = {role: self.weights[f"{bid}.{role}"] for role in layer_shapes(cfg)}
        hd, heads, kvh, eps = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
        total = dims(x)[1]
        columns = [(p.start, p.n) for p in parts]
        k_cache, v_cache = self.cache[f"{bid}.k"], self.cache[f"{bid}.v"]
        # [kv_dim, n_ctx, slot], [position in block, kv_dim, block, slot]
        knb, vnb = strides(k_cache), strides(v_cache)

        def normed(t: Tensor, weight: str) -> Tensor:
            return g.mul(g.rms_norm(t, eps), w[weight])

        def product(role: str, t: Tensor, residual: Tensor | None = None) -> Tensor:
            return self._product(g, f"{bid}.{role}", t, columns, together, residual=residual)

        def products(roles: tuple[str, ...], t: Tensor, norm: str) -> list[Tensor]:
            """The products of t RMS-normed by weight `norm`: the norm in our kernels'
            operations (none of its own, and no barrier), all in one where one kernel takes
            every weight (a Q4_K_M talker's v may be Q6_K beside Q4_K), else once as ggml's."""
            kernels, name = {product_kernel(w[role]) for role in roles}, f"{bid}.{norm}"
            if len(kernels) == 1 and (kernel := next(iter(kernels))) is not None:
                return kernel.products(g, [w[r] for r in roles], t, (self.weights[name], eps))
            if None not in kernels:
                return [self._product(g, f"{bid}.{r}", t, columns, together, norm=name) for r in roles]
            h = normed(t, norm)
            return [product(role, h) for role in roles]

        def roped(t: Tensor, n_heads: int, weight: str) -> Tensor:
            return g.rope_neox(normed(g.reshape(t, hd, n_heads, total), weight), positions, cfg.rope_theta)

        q, k, v = products(("q", "k", "v"), x, "attn_norm")
        if cells is None:
            slots = [p.slot for p in parts]
            norms = (w["q_norm"], w["k_norm"])
            attended = kv_product.attend(
                g, q, k, v, norms, positions, (k_cache, v_cache), slots, eps, cfg.rope_theta
            )
        else:
            q, k = roped(q, heads, "q_norm"), roped(k, kvh, "k_norm")
            # the slots' K rows end to end, and every V cell in a row: the indices say where
            all_k = g.view(k_cache, (self.kv_dim, self.n_ctx * self.slots), (knb[1],))
            g.set_rows(all_k, g.reshape(k, self.kv_dim, total), cells[0])
            all_v = g.view(v_cache, (1, vnb[3] // vnb[0] * self.slots), (vnb[0],))
            g.set_rows(all_v, g.reshape(v, 1, self.kv_dim * total), g.view(cells[1], (self.kv_dim * total,)))
            attended = self._attention(g, q, k_cache, v_cache, parts, batched)
        x = product("o", attended, residual=x)
        act = g.swiglu(*products(("gate", "up"), x, "ffn_norm"))
        scale = self._down_scale[bid]
        if scale == 1.0:
            return product("down", act, residual=x)
        down = g.scale(product("down", g.scale(act, scale)), 1.0 / scale)
        return g.add(x, down)

    def _attention(
        self, g: Graph, q: Tensor, k_cache: Tensor, v_cache: Tensor, parts: list[_Rows], batched: bool
    ) -> Tensor:
        """The parts' attention outputs [hd * heads, rows] for their query rows q [hd, heads,
        rows]: part by part, joined, or `batched` as one batch over the parts' slots."""
        cfg, knb, vnb, qnb = self.config, strides(k_cache), strides(v_cache), strides(q)
        hd, heads, kvh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        if batched:  # part i: slot parts[0].slot + i, row parts[0].start + i
            first, span, count = parts[0], parts[0].span, len(parts)
            keys = g.view(k_cache, (hd, span, kvh, count), (knb[1], hd * knb[0], knb[2]), first.slot * knb[2])
            rows = g.view(q, (hd, 1, heads, count), (qnb[2], qnb[1], qnb[2]), first.start * qnb[2])
            assert first.mask is not None
            scores = g.soft_max(_cache_product(g, keys, rows), first.mask, 1.0 / math.sqrt(hd))
            v_nb = (vnb[1], hd * vnb[1], vnb[3])  # a V block: [position, kv_dim], the slots apart
            values = g.view(v_cache, (span, hd, kvh, count), v_nb, first.slot * vnb[3])
            return g.reshape(_cache_product(g, values, scores), hd * heads, count)  # [hd, 1, heads, count]
        attended = []
        for p in parts:
            keys = g.view(k_cache, (hd, p.span, kvh), (knb[1], hd * knb[0]), p.slot * knb[2])
            # [hd, rows, heads]: a kv head serves `heads / kvh` query heads (ggml broadcasts)
            rows = g.view(q, (hd, p.n, heads), (qnb[2], qnb[1]), p.start * qnb[2])
            assert p.mask is not None
            scores = g.soft_max(_cache_product(g, keys, rows), p.mask, 1.0 / math.sqrt(hd))
            out = self._attended(g, v_cache, scores, p)  # [hd, rows, heads]
            if p.n > 1:
                out = g.cont(g.permute(out, 0, 2, 1, 3))
            attended.append(g.reshape(out, hd * heads, p.n))
        return g.join(attended)


def _cache_product(g: Graph, cache: Tensor, rows: Tensor) -> Tensor:
    """A product of a KV cache's view with a part's rows: a step's (one row) on our kernel where
    it runs (`kv_product`), a prefill's on ggml's (a matrix product, which it does well)."""
    return kv_product.product(g, cache, rows) if dims(rows)[1] == 1 else g.mul_mat(cache, rows)
