"""A libllama context driven by input embeddings, for the talker and the code predictor.

One `llama_decode` gives both the final-norm hidden state (context `embeddings=True`, pooling
none) and the logits of each requested position. The batch points straight at numpy buffers, with
as many position rows per token as the architecture wants (4 for the talker's M-RoPE).

A context holds `n_seq` sequences, each with its own KV cells (libllama's non-unified cache: one
buffer of `n_ctx` positions per sequence, so a sequence's attention reads its own cells only),
and one decode may feed rows of several sequences: the weights are read once for all of them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np
from gguf import GGMLQuantizationType as QType

from ..model.config import LMConfig
from .pages import zeroed_pages_released
from .threads import SharedCores

GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1


def kv_f32_for(weights: QType) -> bool:
    """The KV cache type that goes with the weights: F32 beside F32 weights (hidden states
    within ~1e-6 of a float32 reference), else F16, llama.cpp's default: half the memory, and
    its rounding is far below that of F16 or quantized weights."""
    return weights == QType.F32


@dataclass(frozen=True)
class LMOptions:
    """Context settings (`kv_f32`: see `kv_f32_for`)."""

    threads: int
    # positions per sequence: 164 s of frames, and long texts are split into segments that fit
    n_ctx: int = 2048
    n_batch: int = 512
    kv_f32: bool = True
    n_seq: int = 1


class EmbeddingLM:
    """Feeds embedding rows at given positions and returns hidden states and logits. The KV
    cache is the context's; which positions it holds is the caller's to track."""

    def __init__(
        self,
        model: llama_cpp.llama_model_p,
        cfg: LMConfig,
        n_logits: int,
        n_pos_per_token: int,
        options: LMOptions,
        cores: SharedCores | None = None,
    ) -> None:
        p = llama_cpp.llama_context_default_params()
        # libllama pads each sequence's cells to a multiple of 256
        p.n_ctx = -(-options.n_ctx // 256) * 256 * options.n_seq
        p.n_batch = p.n_ubatch = options.n_batch
        p.n_seq_max = options.n_seq
        p.kv_unified = False
        p.n_threads = p.n_threads_batch = options.threads
        p.embeddings = True
        p.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE
        p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        kv_type, kv_item = (GGML_TYPE_F32, 4) if options.kv_f32 else (GGML_TYPE_F16, 2)
        p.type_k = p.type_v = kv_type
        p.no_perf = True
        kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * p.n_ctx * kv_item
        with zeroed_pages_released(kv_bytes):  # the KV cache's, but for the cells a stream fills
            self.ctx = llama_cpp.llama_init_from_model(model, p)
        if not self.ctx:
            raise RuntimeError("libllama could not create a context")
        self.n_embd, self.n_logits, self.n_pos = cfg.hidden_size, n_logits, n_pos_per_token
        self.kv_f32 = options.kv_f32
        self.threads = self._threads_set = options.threads
        self.cores = cores or SharedCores(options.threads)
        self.n_ctx, self.n_batch = options.n_ctx, options.n_batch
        if llama_cpp.llama_n_ctx_seq(self.ctx) < self.n_ctx:
            raise RuntimeError(f"libllama gave {llama_cpp.llama_n_ctx_seq(self.ctx)} positions per sequence")
        self._n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        # One batch struct and its arrays, reused by every decode: building them per call cost
        # ~0.1-0.2 ms, a tenth of a code-predictor pass.
        self._seq = np.zeros(self.n_batch, dtype=np.int32)  # each row's sequence
        self._positions = np.zeros(self.n_batch * n_pos_per_token, dtype=np.int32)
        self._n_seq_id = np.ones(self.n_batch, dtype=np.int32)
        self._want = np.zeros(self.n_batch, dtype=np.int8)
        row_seq = ctypes.POINTER(ctypes.c_int32)
        self._seq_ids = (row_seq * self.n_batch)(
            *[ctypes.cast(self._seq.ctypes.data + 4 * i, row_seq) for i in range(self.n_batch)]
        )
        self._batch = llama_cpp.llama_batch(
            n_tokens=0,
            token=None,
            embd=None,
            pos=self._positions.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            n_seq_id=self._n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            seq_id=self._seq_ids,
            logits=self._want.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None

    __del__ = close

    def set_threads(self, threads: int) -> None:
        self.threads = threads

    def clear(self, clear_data: bool = True) -> None:
        """Forget the KV cache of every sequence.

        With `clear_data=False` only the cells are freed and the buffers keep stale values, which
        the attention mask hides (zeroing them costs ~0.1 ms per MiB of cache)."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), clear_data)

    def keep(self, n: int, seq: int = 0) -> None:
        """Keep the first `n` positions of sequence `seq`, so that a call can continue at n."""
        if not llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx), seq, n, -1):
            raise RuntimeError("libllama could not shorten the KV cache")

    def forward(
        self, embeds: np.ndarray, pos: int, outputs: str = "last", seq: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Run rows `embeds` [n, H] of sequence `seq` at positions pos .. pos + n - 1.

        Returns (hidden, logits) for the last row ([H], [n_logits]) or, with outputs="all",
        for every row ([n, H], [n, n_logits]). Logits are the last `n_logits` of the vocabulary.
        """
        embeds = np.ascontiguousarray(embeds, dtype=np.float32)
        n = len(embeds)
        hidden, logits = [], []
        for start in range(0, n, self.n_batch):
            chunk = embeds[start : start + self.n_batch]
            rows = range(len(chunk) - 1, len(chunk)) if outputs == "last" else range(len(chunk))
            h, lg = self._decode(chunk, [(seq, pos + start, len(chunk))], rows)
            hidden.append(h)
            logits.append(lg)
        if outputs == "last":
            return hidden[-1][-1], logits[-1][-1]
        return np.concatenate(hidden), np.concatenate(logits)

    def forward_many(self, parts: list[tuple[int, np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray]:
        """One decode of several sequences' rows: `parts` are (seq, rows [n, H], pos); returns
        (hidden [parts, H], logits [parts, n_logits]) at each part's last row."""
        counts = [len(rows) for _, rows, _ in parts]
        if sum(counts) > self.n_batch:
            raise RuntimeError(f"{sum(counts)} rows in one decode > n_batch {self.n_batch}")
        embeds = np.concatenate([rows for _, rows, _ in parts]).astype(np.float32, copy=False)
        last = np.cumsum(counts) - 1
        return self._decode(embeds, [(seq, pos, n) for (seq, _, pos), n in zip(parts, counts)], last)

    def _decode(
        self, chunk: np.ndarray, spans: list[tuple[int, int, int]], rows: Sequence[int] | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Decode `chunk`, made of spans (seq, first position, row count) in order; the outputs
        of `rows`."""
        threads = self.cores.threads(self.threads)
        if threads != self._threads_set:
            llama_cpp.llama_set_n_threads(self.ctx, threads, threads)
            self._threads_set = threads
        chunk = np.ascontiguousarray(chunk)
        n = len(chunk)
        positions = self._positions[: n * self.n_pos].reshape(self.n_pos, n)
        start = 0
        for seq, pos, count in spans:
            if pos + count > self.n_ctx:
                raise RuntimeError(f"context full: {pos} + {count} positions > n_ctx {self.n_ctx}")
            positions[:, start : start + count] = np.arange(pos, pos + count)
            self._seq[start : start + count] = seq
            start += count
        self._want[:n] = 0
        self._want[list(rows)] = 1
        batch = self._batch
        batch.n_tokens = n
        # a float *, which llama_cpp's annotations declare as an array
        batch.embd = ctypes.cast(chunk.ctypes.data, ctypes.POINTER(ctypes.c_float))  # type: ignore[assignment]
        rc = llama_cpp.llama_decode(self.ctx, batch)
        batch.embd = None  # type: ignore[assignment]
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc})")
        hidden = np.empty((len(rows), self.n_embd), dtype=np.float32)
        logits = np.empty((len(rows), self.n_logits), dtype=np.float32)
        skip = (self._n_vocab - self.n_logits) * 4
        for k, i in enumerate(rows):
            _copy(hidden[k], llama_cpp.llama_get_embeddings_ith(self.ctx, i), 0)
            _copy(logits[k], llama_cpp.llama_get_logits_ith(self.ctx, i), skip)
        return hidden, logits


def _copy(out: np.ndarray, ptr: Any, skip_bytes: int) -> None:
    """Copy a libllama output row (a float pointer, NULL if absent) into `out`."""
    address = ctypes.cast(ptr, ctypes.c_void_p).value
    if not address:
        raise RuntimeError("libllama returned no output for a requested row")
    ctypes.memmove(out.ctypes.data, address + skip_bytes, out.nbytes)
