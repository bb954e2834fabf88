"""The codec decoder ("code2wav"): 16 codes per 80 ms frame -> 1920 samples of 24 kHz audio.

Exact and streaming. Every stage of Qwen3-TTS-Tokenizer-12Hz's decoder is causal, so a sequence
decoded in chunks of any sizes gives the samples of the one-shot decode, bit for bit,
provided each layer's state is carried between calls and every product gives a column the same
numbers whatever columns come with it (see `matrix.Matrix`). The layers hold weights only; an
utterance's state is a `DecoderState` (`CodecDecoder.new_state()`), made of each layer's
own state object, as in Kyutai's moshi streaming modules:

- a causal convolution keeps its last (k - 1) * dilation input columns;
- a transposed convolution (kernel 2 * stride) keeps the (k - stride) output columns that the
  next input frame overlaps;
- each transformer layer keeps a ring of K/V slots covering the last (window - 1) positions,
  and the transformer keeps the absolute RoPE position (positions count from the start of the
  utterance, as in the official one-shot decode).

One path, `CodecDecoder.push_many(states, codes)`, serves streaming and one-shot decoding, of
one utterance (`push`) or of several at once (streams: each state advanced as alone, bit for
bit). The official semantics kept here: negative codes clamp to 0, the transposed
convolutions trim (k - s) samples on the right only, the sliding window lets a query at t see
keys t - window + 1 .. t, the output is clamped to [-1, 1].

Layout and speed: the layers (`codec_layers`, `codec_transformer`) take channel-major float32
activations, and each is a few products W @ X (`matrix.Matrix`, which says where each runs).
Several streams' activations are [channels, time * streams], stream index fastest: the layers
whose weights are large and columns few (up to the second decoder block, `JOINT_BLOCKS`) run on
all the streams' columns and all the push's frames at once, on their states stacked for the
call; the later blocks run per stream and per frame. Each push sets its own BLAS thread count
(threadpoolctl; one by default, whatever numpy's setting): the GEMMs are many and small, and
OpenBLAS' threads spin after each one, taking the core that ggml's threads need (a second BLAS
thread made the talker's next step ~2x slower, and synthesis of the tiny test models 30-80x).
The products in ggml graphs run on one thread (`DECODER_GGML_THREADS`). `python -m
kazeia_stream.engine.codec MMPROJ` measures ms per frame.

Weights come from the mmproj GGUF (`a.gen.wav.*`, see gguf_layout); every width is read from
the tensor shapes, so the tiny test models run through the same code as the real ones.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import ThreadpoolController

from ..model import gguf_layout as L
from ..model.gguf_file import GGUFFile
from . import cache_files, codec_layers, codec_transformer, f32_product, heap, winograd
from . import matrix as matrix_products
from .codec_layers import (
    CausalConv,
    CausalTransConv,
    ContextBuffer,
    ConvNeXtBlock,
    DecoderBlock,
    Linear,
    SnakeBeta,
    count_blocks,
    read_conv,
    read_kernel,
    read_snake,
)
from .codec_transformer import MAX_FRAMES_PER_PASS, Transformer, TransformerState
from .ggml_graph import Allocator, prefault
from .matrix import F32, Matrix
from .threads import DECODER_THREADS, available_cores
from .weight_cache import UNSAVED, Stale, WeightCache

# `push_many` runs this many decoder blocks (and the layers before them) on all the streams'
# columns and all the push's frames at once; the later ones per stream and per frame (their many
# columns make the multiplications the cost, not the weight reads: batching them measured
# slower). The second block's products of 40-45 columns a frame share their weights once they run
# on our kernel (`f32_product`): four streams, Zen 4, 45.0-45.7 against 47.1-48.6 ms a
# stream-frame with the first block alone.
JOINT_BLOCKS = 2
# Where our kernel does not run, a product of at most this many columns runs in a ggml graph
# (`Matrix`), a wider one on numpy's BLAS. OpenBLAS packs
# the weights before multiplying, at every call; with few columns (the layers up to the first
# decoder block: 0.33 of the 0.42 GB of weights a frame reads) that copy was most of a product's
# cost, while ggml's kernels read the weights in place. One core, OpenBLAS' Haswell kernels, per
# shape: 12288x1536 by 4 columns 12.5 -> 4.7 ms, the first block's 24 taps 768x768 by 32 columns
# 13.5 -> 10.9 ms, 384x384 by 160 even, 192x192 by 640 11.2 -> 13.9 ms.
GGML_COLUMNS = 64
# Where our kernel runs (`Matrix.multiply_directly`), a product of fewer columns per frame than
# this takes its weight in panels (a copy; the weights then stream from memory at 32-43 GB/s
# on Zen 4, against 17-35 in place four rows at a time), one of more in place (the columns'
# rows are contiguous in the decoder's buffers), unless its inputs come column-major. The
# decoder alone on Zen 4 (docs/measurements.md, 2026-12-04, late night): one stream 44.3-44.4 ms
# a frame against 60.2-60.9 on ggml's graphs and numpy's BLAS, four streams 34.6 against
# 43.1-43.5 ms a stream-frame.
PANEL_COLUMNS = 8
# A causal conv of more columns per frame multiplies tap by tap, on copies of its weight
# (`CausalConv.split`); one of fewer, its weight in place on gathered columns. Per frame from
# memory, one core: the entry conv (44 MB, 4 columns) 4.4 ms in place against 4.9 tap by tap;
# the first block's k = 7 convs (17 MB, 32 columns) 4.9 against 4.1; in the later blocks
# (hundreds of columns, small weights) the gathering costs up to 0.3 ms a conv.
SPLIT_COLUMNS = 16
# The heap a decoded frame's buffers take at most (`heap.reserve`): 18 MB for the official
# decoder's first frame (its page faults, getrusage).
FRAME_HEAP = 30 << 20

log = logging.getLogger(__name__)


class Quantizer:
    """Split RVQ decode: codebook 0 and codebooks 1.. are each summed, projected (1x1 conv, no
    bias) and added. The GGUF codebooks are already divided by their cluster usage."""

    def __init__(self, f: GGUFFile) -> None:
        # gathered a few rows per frame, not streamed: mapped, only the rows used are resident
        self.first_cb = f.tensor(L.WAV_QUANT_FIRST_CB)  # [size, dim]
        size, dim = self.first_cb.shape
        self.rest_cb = f.tensor(L.WAV_QUANT_REST_CB).reshape(-1, size, dim)  # [groups - 1, size, dim]
        self.first_out = Linear(f.read(L.WAV_QUANT_FIRST_OUT).reshape(-1, dim))
        self.rest_out = Linear(f.read(L.WAV_QUANT_REST_OUT).reshape(-1, dim))
        self.num_groups = 1 + len(self.rest_cb)
        self.codebook_size = size

    def __call__(self, codes: np.ndarray) -> np.ndarray:
        """codes [n, groups] -> [C, n]."""
        codes = np.clip(codes, 0, None)  # the official decode clamps negative (padding) codes to 0
        rest = self.rest_cb[0, codes[:, 1]].copy()
        for i in range(2, self.num_groups):
            rest += self.rest_cb[i - 1, codes[:, i]]
        y = self.first_out(self.first_cb[codes[:, 0]].T)
        y += self.rest_out(rest.T)
        return y


UpsampleState = tuple[np.ndarray, ContextBuffer]  # a transposed conv's tail, a ConvNeXt's context
BlockState = tuple[np.ndarray, list[tuple[ContextBuffer, ContextBuffer]]]
JointState = tuple[ContextBuffer, list[UpsampleState], ContextBuffer, list[BlockState]]


@dataclass
class DecoderState:
    """One utterance's decoder state: every layer's, in the order of the layers (a
    transposed conv's tail is [k - s, C_out, 1]: one stream's)."""

    pre_conv: ContextBuffer
    transformer: TransformerState
    upsample: list[UpsampleState]
    entry: ContextBuffer
    blocks: list[BlockState]
    post_conv: ContextBuffer

    @property
    def position(self) -> int:
        """Frames decoded so far."""
        return self.transformer.pos

    def joint(self) -> JointState:
        """The states of the convolutions that a pass runs on all the streams' columns at once."""
        return self.pre_conv, self.upsample, self.entry, self.blocks[:JOINT_BLOCKS]


def _stack(parts: Sequence[Any]) -> Any:
    """The states of a layer (context buffers, tails, or tuples or lists of them), one per
    stream, as the layer's state for all the streams, stream index fastest: a copy of their
    contexts. One stream's is its own."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, ContextBuffer):
        return ContextBuffer.stack(parts)
    if isinstance(first, np.ndarray):
        return np.concatenate(parts, axis=2)
    return type(first)(_stack(p) for p in zip(*parts))


def _unstack(stacked: Any, parts: Sequence[Any]) -> None:
    """The inverse of `_stack`: copy each stream's state back into its own in `parts`."""
    if len(parts) == 1:
        return
    if isinstance(stacked, ContextBuffer):
        stacked.unstack(parts)
    elif isinstance(stacked, np.ndarray):
        for s, part in enumerate(parts):
            part[...] = stacked[:, :, s : s + 1]
    else:
        for i, sub in enumerate(stacked):
            _unstack(sub, [p[i] for p in parts])


@dataclass
class _Streams:
    """The states of S streams for a pass over all of them: the joint ones stacked (see
    `_stack`), and each stream's own `DecoderState` for the rest."""

    states: Sequence[DecoderState]
    pre_conv: ContextBuffer
    upsample: list[UpsampleState]
    entry: ContextBuffer
    blocks: list[BlockState]

    @classmethod
    def stack(cls, states: Sequence[DecoderState]) -> _Streams:
        """The streams' states for a pass: copies of their joint states, until `unstack`."""
        return cls(states, *_stack([state.joint() for state in states]))

    def unstack(self) -> None:
        """Copy each stream's joint states back into its `DecoderState`."""
        _unstack((self.pre_conv, self.upsample, self.entry, self.blocks), [s.joint() for s in self.states])


class CodecDecoder:
    """codes [n, 16] -> float32 audio [n * samples_per_frame], streaming with explicit state.

    The decoder holds weights only. `new_state()` starts an utterance, `push(state, codes)`
    continues it, `push_many(states, codes)` continues several at once, `decode(codes)` is a
    one-shot decode of a fresh one. Chunks of any sizes give the samples of the one-shot
    decode."""

    def __init__(self, mmproj: GGUFFile, threads: int) -> None:
        self.threads = threads
        self._blas = ThreadpoolController().select(user_api="blas")
        self._kernel = f32_product.chosen()  # our kernel's variant, or None: ggml's and BLAS's
        with self._threads(None):  # the load's products too: a second thread spins after them
            layout = f"winograd={winograd.available()}"
            cache = WeightCache.of(mmproj.path, _code(), layout) if self._kernel else UNSAVED
            try:
                self._load(mmproj, cache)
                cache.finish()
            except Stale as e:  # the saved arrays are others: made anew, and saved
                log.debug("%s: %s", cache.path, e)
                cache.forget()
                self._load(mmproj, cache)
                cache.finish()

    def _load(self, f: GGUFFile, cache: WeightCache) -> None:
        self.quantizer = Quantizer(f)
        self.pre_conv = CausalConv(*read_conv(f, L.WAV_PRE_CONV))
        self.transformer = Transformer(f)
        self.upsample: list[tuple[CausalTransConv, ConvNeXtBlock]] = []
        for bid in range(count_blocks(f, L.WAV_UP_CONV)):
            w, b = read_kernel(f, L.WAV_UP_CONV.format(bid=bid))
            w = w.reshape(-1, len(b), w.shape[-1])
            self.upsample.append((CausalTransConv(w, b, stride=w.shape[-1]), ConvNeXtBlock(f, bid)))
        self.entry = CausalConv(*read_conv(f, L.WAV_DAC_ENTRY))
        self.blocks = [DecoderBlock(f, bid) for bid in range(count_blocks(f, L.WAV_DAC_UP_CONV))]
        self.post_act = SnakeBeta(*read_snake(f, L.WAV_DAC_POST_SNAKE))
        self.post_conv = CausalConv(*read_conv(f, L.WAV_DAC_POST_CONV))
        self._allocator = Allocator()  # one compute buffer for the products on ggml's kernels
        columns_of = self.matrices()
        dilated = [unit.conv1 for block in self.blocks for unit in block.units]
        for conv in self._convs():
            if conv in dilated:  # most of the multiply-adds: in Winograd's F(m, 7) where it runs
                conv.tile(columns_of[id(conv.products[0])][1], cache)
            if conv.method == "gathered" and columns_of[id(conv.products[0])][1] > SPLIT_COLUMNS:
                conv.split()
        kernel = self._kernel
        per_stream = self._per_stream_matrices()
        for key, (matrix, columns) in self.matrices().items():
            if kernel is not None:
                matrix.multiply_directly(kernel, matrix.column_major or columns < PANEL_COLUMNS, cache)
            else:
                matrix.widen()
                if columns <= GGML_COLUMNS or key not in per_stream:
                    matrix.allocator, matrix.by_column = self._allocator, columns == 1
            # mapped now (from the cache file, or in place in the model's): the first frame is
            # heard first (its products took 2x as long, faulting 0.29 GB in, Zen 1)
            prefault(matrix.array)
        for _ in range(2):  # a frame's graphs too; again where the buffer's growth left one stale
            for matrix, columns in self.products():
                matrix.prepare(columns)
        self.num_groups = self.quantizer.num_groups
        self.samples_per_frame = int(
            np.prod([up.s for up, _ in self.upsample]) * np.prod([blk.up.s for blk in self.blocks])
        )
        heap.reserve(FRAME_HEAP)  # last: a frame's buffers, not the weights, take this memory

    def new_state(self) -> DecoderState:
        """A new utterance: zero context everywhere, RoPE position 0."""
        return DecoderState(
            pre_conv=self.pre_conv.new_state(),
            transformer=self.transformer.new_state(),
            upsample=[(up.new_state(), block.new_state()) for up, block in self.upsample],
            entry=self.entry.new_state(),
            blocks=[block.new_state() for block in self.blocks],
            post_conv=self.post_conv.new_state(),
        )

    def push(self, state: DecoderState, codes: np.ndarray, threads: int | None = None) -> np.ndarray:
        """Decode the next frames of the utterance: codes [n, groups] -> audio [n * spf], on
        `threads` BLAS threads (default: the decoder's `threads`)."""
        return self.push_many([state], [codes], threads)[0]

    def push_many(
        self,
        states: Sequence[DecoderState],
        codes: Sequence[np.ndarray],
        threads: int | None = None,
        between: Callable[[Callable[[int], None]], None] | None = None,
    ) -> list[np.ndarray]:
        """Decode the next n frames of several utterances (streams) together, the same n for
        each: codes [n, groups] per stream -> audio [n * spf] per stream, each state advanced
        as `push` leaves it, bit for bit.
        The layers up to the first decoder blocks multiply their weights once by the columns of
        all the streams: with one stream's few columns, reading the weights is the cost. The
        later blocks run stream by stream; `between(use)` is called before the first stream and
        after each stream's later blocks, and may push other states meanwhile (a stream that
        must be heard soon need not wait for the whole pass) and set the threads of what
        follows (`use(n)`)."""
        if len(states) != len(codes):
            raise ValueError(f"{len(states)} states for {len(codes)} code arrays")
        if len({id(state) for state in states}) != len(states):
            raise ValueError("a state is pushed twice")
        frames = [self._check(c) for c in codes]
        n = len(frames[0]) if frames else 0
        if any(len(c) != n for c in frames):
            raise ValueError(
                f"every stream must push the same number of frames, got {[len(c) for c in frames]}"
            )
        outs = [np.empty(n * self.samples_per_frame, F32) for _ in states]
        if not n:
            return outs
        count = len(states)
        joint = np.stack(frames, axis=1).reshape(n * count, self.num_groups)  # stream index fastest
        streams = _Streams.stack(states)
        done = [0] * count
        with self._threads(threads) as use:
            if between is not None:
                between(use)
            for i in range(0, n, MAX_FRAMES_PER_PASS):
                h = self.quantizer(joint[i * count : (i + MAX_FRAMES_PER_PASS) * count])
                h = self.transformer(
                    [state.transformer for state in states], self.pre_conv(streams.pre_conv, h)
                )
                for s, piece in self._render(streams, h):
                    outs[s][done[s] : done[s] + len(piece)] = piece
                    done[s] += len(piece)
                    if between is not None:
                        between(use)
        streams.unstack()
        return outs

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """One-shot: a fresh utterance decoded whole."""
        return self.push(self.new_state(), codes)

    def prime(self, state: DecoderState, codes: np.ndarray, threads: int | None = None) -> None:
        """Advance `state` past `codes` (an in-context voice's reference) without making their
        audio: the state is then what `push(state, codes)` leaves, to float rounding, at a
        fraction of the cost. The quantizer, pre-conv and transformer run on every frame (each
        attention layer looks 71 frames back, so the transformer's state depends on them all);
        the convolutions after it hold finite contexts, which depend on the last
        `lookback_frames` frames only, so only those run through them."""
        codes = np.asarray(codes, dtype=np.int64)
        with self._threads(threads):
            h = self.transformer([state.transformer], self.pre_conv(state.pre_conv, self.quantizer(codes)))
            for _ in self._render(_Streams.stack([state]), h[:, -self.lookback_frames :]):
                pass

    @contextmanager
    def _threads(self, threads: int | None) -> Iterator[Callable[[int], None]]:
        """The products of the block run on `threads` threads (default: the decoder's): BLAS's,
        and our kernel's in a team, of no more threads than cores (its helpers spin); until
        the block calls what it yields with another count."""
        with ExitStack() as held:
            now = 0

            def use(n: int) -> None:
                nonlocal now
                if n != now:
                    held.close()
                    held.enter_context(self._blas.limit(limits=n))
                    held.enter_context(f32_product.threads(min(n, available_cores()) if self._kernel else 1))
                    now = n

            use(threads or self.threads)
            yield use

    def _check(self, codes: np.ndarray) -> np.ndarray:
        """One stream's codes [n, groups] as int64, checked."""
        codes = np.asarray(codes)
        if codes.ndim != 2 or codes.shape[1] != self.num_groups:
            raise ValueError(f"codes must be [n, {self.num_groups}], got {codes.shape}")
        if codes.size and codes.max() >= self.quantizer.codebook_size:
            raise ValueError(f"codes must be < {self.quantizer.codebook_size}, got {codes.max()}")
        return codes.astype(np.int64)

    @cached_property
    def lookback_frames(self) -> int:
        """How many frames back the state of the layers after the transformer reaches: each
        layer's context in frames at its rate (a transposed conv sees one input column back),
        summed over the layers, rounded up (11 for the official decoder)."""
        frames, rate = 0.0, 1  # rate: columns per frame at the current layer's input
        for up, convnext in self.upsample:
            frames += 1 / rate
            rate *= up.s
            frames += (convnext.dwconv.k - 1) / rate
        frames += self.entry.context / rate
        for block in self.blocks:
            frames += 1 / rate
            rate *= block.up.s
            frames += sum(unit.conv1.context + unit.conv2.context for unit in block.units) / rate
        frames += self.post_conv.context / rate
        return math.ceil(frames)

    def products(self) -> Iterator[tuple[Matrix, int]]:
        """Every matrix product of a frame's decode, in order: (its weight, its columns per
        frame; a tiled conv's weights once per chunk of tiles, with its columns). Depthwise
        convolutions, attention and activations are left out: they are well under 1% of the
        multiply-adds."""
        q, tfm = self.quantizer, self.transformer
        yield q.first_out.w, 1
        yield q.rest_out.w, 1
        yield from self.pre_conv.calls(1)
        yield tfm.in_proj.w, 1
        for layer in tfm.layers:
            yield from ((m.w, 1) for m in (layer.qkv, layer.out, layer.gate_up, layer.down))
        yield tfm.out_proj.w, 1
        rate = 1  # columns per frame at the current layer's input
        for up, convnext in self.upsample:
            yield up.w, rate
            rate *= up.s
            yield convnext.pw1.w, rate
            yield convnext.pw2.w, rate
        yield from self.entry.calls(rate)
        for block in self.blocks:
            yield block.up.w, rate
            rate *= block.up.s
            for conv in block.convs:
                yield from conv.calls(rate)
        yield from self.post_conv.calls(rate)

    def matrices(self) -> dict[int, tuple[Matrix, int]]:
        """Each matrix of `products` by its id, with the most columns a call of it multiplies
        per frame (a tiled conv's weights come once per chunk of tiles)."""
        most: dict[int, tuple[Matrix, int]] = {}
        for matrix, columns in self.products():
            most[id(matrix)] = matrix, max(columns, most.get(id(matrix), (matrix, 0))[1])
        return most

    def _per_stream_matrices(self) -> set[int]:
        """The ids of the matrices that `push_many` multiplies stream by stream (`_render`). The
        others multiply all the streams' columns at once, so not on numpy's BLAS, whose numbers
        for a column depend on the columns beside it (OpenBLAS' Haswell kernels do even where
        its SkylakeX ones do not): on ggml's graphs, however many columns a frame they take."""
        blocks = self.blocks[JOINT_BLOCKS:]
        convs = [conv for block in blocks for conv in block.convs] + [self.post_conv]
        return {id(block.up.w) for block in blocks} | {id(m) for conv in convs for m in conv.products}

    def _convs(self) -> Iterator[CausalConv]:
        yield from (self.pre_conv, self.entry, self.post_conv)
        for block in self.blocks:
            yield from block.convs

    @cached_property
    def macs_per_frame(self) -> int:
        """Multiply-adds of the matrix products per frame (`products`)."""
        return sum(math.prod(m.shape) * columns for m, columns in self.products())

    def products_time(self, frames: int = 1, repeat: int = 3, in_order: bool = False) -> float:
        """Seconds per frame that the matrix products alone take at `frames` frames per push,
        on the same kernels and shapes as a decode (the blocks' column pieces included), on
        the decoder's threads: the floor its multiply-adds set. Best of `repeat`: of each
        product repeated (its weights then come from the caches), or, `in_order`, of all the
        products one after the other as a decode runs them (weights from memory: the caches
        hold a few percent of the 0.42 GB a frame reads)."""
        rng = np.random.default_rng(0)
        calls = []  # (product, input, its calls per `frames` frames)
        per_frame = self._per_stream_matrices()
        for m, columns in self.products():
            n = columns * frames
            piece = columns if id(m) in per_frame else n  # as a decode calls it (see `_render`)
            calls.append((m, rng.standard_normal((m.shape[1], piece), dtype=F32), n // piece))

        def run(group: Sequence[tuple[Matrix, np.ndarray, int]]) -> float:
            best = math.inf
            for _ in range(repeat):
                start = time.perf_counter()
                for m, x, count in group:
                    for _ in range(count):
                        m(x)
                best = min(best, time.perf_counter() - start)
            return best

        with self._threads(None):
            total = run(calls) if in_order else sum(run([call]) for call in calls)
        return total / frames

    def _render(self, streams: _Streams, h: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """The audio of the transformer's output h [C, n * S] of S streams, in consecutive
        pieces of each stream's: (stream, samples). The upsampling, the entry conv and the first
        `JOINT_BLOCKS` decoder blocks run on all the streams' columns at once, and on all the
        pass's frames (the weights are large, the activations small: a push of several frames
        reads them once); the later blocks (many columns, small weights: the multiplications are
        the cost) per stream, one frame at a time (see `_blocks`). Every layer streams, and the
        products of the joint blocks give a column the same numbers whatever columns come with
        it, so any split gives the same samples."""
        count = len(streams.states)
        frames = h.shape[1] // count  # the transformer's output is a column per frame
        for (up, convnext), (tail, context) in zip(self.upsample, streams.upsample):
            h = convnext(context, up(tail, h))
        h = self.entry(streams.entry, h)
        for block, block_state in zip(self.blocks[:JOINT_BLOCKS], streams.blocks):
            h = block(block_state, h)
        joint = h.reshape(h.shape[0], -1, count)
        for s, state in enumerate(streams.states):
            pieces = np.split(joint[:, :, s], frames, axis=1)
            for h in _blocks(self.blocks[JOINT_BLOCKS:], state.blocks[JOINT_BLOCKS:], pieces):
                n = h.shape[1]
                self.post_act(h, out=state.post_conv.input(n))
                yield s, np.clip(self.post_conv.run(state.post_conv, n).reshape(-1), -1.0, 1.0)


def _blocks(
    blocks: Sequence[DecoderBlock], states: Sequence[BlockState], pieces: list[np.ndarray]
) -> list[np.ndarray]:
    """Decoder blocks on consecutive pieces of their input, one frame's each: the output
    pieces, one frame's each (numpy's products then have the same columns whatever the push,
    and the activations stay in the L2 cache)."""
    for block, state in zip(blocks, states):
        pieces = [block(state, p) for p in pieces]
    return pieces


@cache
def _code() -> tuple[Path, ...]:
    """The files of the code that makes the weights' layouts (`WeightCache`'s key)."""
    modules = [
        sys.modules[__name__],
        codec_layers,
        codec_transformer,
        matrix_products,
        winograd,
        f32_product,
        cache_files,
    ]
    return cache_files.code(modules, ["f32_product"])


def _bench(argv: list[str] | None = None) -> None:
    """`python -m kazeia_stream.engine.codec MMPROJ [FRAMES_PER_PUSH ...] [--streams S,...]`:
    ms per frame while streaming, one stream pushing FRAMES_PER_PUSH frames per call (and its
    matrix products alone, the floor), or S streams pushing one frame each per call (ms per
    stream-frame). CPU time is what the process used; with other processes on the machine,
    wall time is the larger."""
    import argparse
    from functools import partial

    ap = argparse.ArgumentParser(description=_bench.__doc__)
    ap.add_argument("mmproj")
    ap.add_argument("per_push", nargs="*", type=int, help="default: 1 4 12 without --streams")
    ap.add_argument("--streams", type=lambda v: [int(s) for s in v.split(",")], default=[])
    ap.add_argument("--frames", type=int, default=48, help="frames decoded per measurement")
    ap.add_argument("--repeat", type=int, default=3, help="measurements; the best is shown")
    ap.add_argument(
        "--threads", type=int, default=DECODER_THREADS, help=f"BLAS threads (default {DECODER_THREADS})"
    )
    args = ap.parse_args(argv)
    dec = CodecDecoder(GGUFFile(args.mmproj), threads=args.threads)
    size = (max(args.streams, default=1), args.frames, dec.num_groups)
    codes = np.random.default_rng(0).integers(0, dec.quantizer.codebook_size, size)

    def measure(label: str, run: Callable[[], None], frames: int) -> None:
        run()  # warm up
        walls, cpus = [], []
        for _ in range(args.repeat):
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            walls.append((time.perf_counter() - wall) / frames * 1e3)
            cpus.append((time.process_time() - cpu) / frames * 1e3)
        print(
            f"{label}: {min(walls):6.1f} ms/frame wall (best of {args.repeat}; "
            f"mean {np.mean(walls):.1f}), {min(cpus):6.1f} ms/frame cpu",
            flush=True,
        )

    def one_stream(per: int) -> None:
        state = dec.new_state()
        for i in range(0, args.frames, per):
            dec.push(state, codes[0, i : i + per])

    def streams(count: int, frames: int) -> None:
        states = [dec.new_state() for _ in range(count)]
        for i in range(frames):
            dec.push_many(states, list(codes[:count, i : i + 1]))

    for per in args.per_push or ([] if args.streams else [1, 4, 12]):
        measure(f"{per:3d} frames per push", partial(one_stream, per), args.frames)
        floor = dec.products_time(per, args.repeat) * 1e3
        in_order = dec.products_time(per, args.repeat, in_order=True) * 1e3
        print(
            f"{per:3d} frames per push: {floor:6.1f} ms/frame for the matrix products alone, "
            f"{in_order:.1f} in a decode's order (weights from memory)",
            flush=True,
        )
    for count in args.streams:
        frames = max(1, args.frames // count)  # per stream: about --frames in all
        measure(f"{count:3d} streams, 1 frame each per push", partial(streams, count, frames), frames * count)


if __name__ == "__main__":
    _bench()
