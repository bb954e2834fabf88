"""The code predictor: codebooks 1..15 of a frame from the talker's hidden state and codebook 0.

Its 5-layer Qwen3 LM runs on libllama as a plain `qwen3` model built in memory from the mmproj's
`a.gen.code.*` tensors with `llama_model_init_from_user`: the metadata is a GGUF header written
with `gguf.GGUFWriter` and parsed by libggml's `gguf_init_from_buffer`, and the weights are copied
from the memory-mapped mmproj by the set-tensor callback. We feed embeddings, never tokens.

Per frame (positions restart at 0): a 2-token prefill [h, C_talker(c0)], then 14 single steps fed
`codec_embedding[j-1](cb_j)`; every input goes through small_to_mtp_projection when the model has
one (1.7B). Codebook j comes from `lm_head[j-1]`: the model's vocabulary is the 2048 codes and its
`output` tensor is the heads' first matrix; before each decode its data pointer is moved to head
j-1 in our copy of the stacked heads, so each head is applied in the graph, in its stored type,
by libllama's threads (applying them in numpy cost ~19 ms per frame at 0.6B).

Weight types (`exact=False`, the default): the stored ones, except the F32 `ffn_down` that
converters keep because its input peaks near 1.5e5, beyond F16 (ggml casts a matmul's input to the
weight's type). In an F16 file it becomes F16, with its input scaled down by 2^-6 through the
`ffn_up.scale` tensor libllama applies after the up projection and scaled back by `ffn_down.scale`
(powers of two: exact); in a Q8_0 file it becomes Q8_0 (per-block scales, no range issue). Bytes
read per pass at 0.6B: F16 file 189 -> 157 MB, Q8_0 file 130 -> 84 MB; the passes are memory-bound.
`exact=True` keeps every stored type (hidden states within ~1e-6 of float32). An all-F32 file
is the same either way. The KV cache is F32 with any weights: it holds 16 positions (libllama
pads them to 256: 10 MB per stream at 0.6B), and its attention measured ~5% faster per frame
than with llama.cpp's default F16 cache (interleaved, 1 and 2 threads), whose queries are
converted to F16 for every product.

No state survives a call: each frame's passes restart at position 0 and each decode points the
output tensor at its head first. `predict_many` runs the passes of up to `max_streams` streams
together, each its own sequence; between two of its passes, another call may run in the
sequences it does not use. One CodePredictor serves one thread at a time (the runtime's
generator thread), since that pointer and the KV cache are the engine's scratch space.
"""

from __future__ import annotations

import ctypes
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from ..errors import ModelFileError
from ..ggml_lib import GGMLTensor, GGUFInitParams, ggml, quantize
from ..model import gguf_layout as L
from ..model.config import CodePredictorConfig
from ..model.gguf_file import GGUFFile
from ..model.llama import init_backend
from .llm import EmbeddingLM, LMOptions
from .threads import SharedCores

ARCH = "qwen3"
# Positions per frame: the 2-token prefill and 14 steps.
_N_POS = 16
# ffn_down's input is multiplied by this before its F16 cast (and the output by the inverse).
_FFN_DOWN_INPUT_SCALE = 2.0**-6

_PLAIN = {QType.F32: np.float32, QType.F16: np.float16}
_OUTPUT = "output.weight"
_LAYER_TENSORS = {
    "attn_norm": L.CP_ATTN_NORM,
    "attn_q": L.CP_ATTN_Q,
    "attn_k": L.CP_ATTN_K,
    "attn_v": L.CP_ATTN_V,
    "attn_output": L.CP_ATTN_OUT,
    "attn_q_norm": L.CP_ATTN_Q_NORM,
    "attn_k_norm": L.CP_ATTN_K_NORM,
    "ffn_norm": L.CP_FFN_NORM,
    "ffn_gate": L.CP_FFN_GATE,
    "ffn_up": L.CP_FFN_UP,
    "ffn_down": L.CP_FFN_DOWN,
}
# Optional tensors libllama creates for a model built from metadata (a file would simply lack
# them) and then uses in the graph: filled with the value that makes them a no-op. Any other
# tensor it asks for that we do not know is an error, so a libllama that adds one is noticed.
_NEUTRAL_SUFFIXES = {".bias": 0.0, ".scale": 1.0, ".input_scale": 1.0}  # q/k/v bias, FP8-style scales
_UNUSED = {"token_embd.weight", "cls.output.weight"}  # we feed embeddings; rerank head


class _Plan:
    """Which mmproj tensor fills each libllama tensor, in which type, and the scale tensors."""

    def __init__(self, f: GGUFFile, n_layers: int, exact: bool) -> None:
        self.file = f
        self.sources = {"output_norm.weight": L.CP_OUTPUT_NORM}
        for bid in range(n_layers):
            for dst, src in _LAYER_TENSORS.items():
                self.sources[f"blk.{bid}.{dst}.weight"] = src.format(bid=bid)
        for src in [*self.sources.values(), L.CP_HEAD]:
            if not f.has_tensor(src):
                raise ModelFileError(f"{f.path}: code predictor tensor {src!r} is missing")
        self.types = {dst: f.tensor_type(src) for dst, src in self.sources.items()}
        self.types[_OUTPUT] = self.types["token_embd.weight"] = f.tensor_type(L.CP_HEAD)
        self.scales: dict[str, float] = {}
        if not exact:
            for bid in range(n_layers):
                down, up = f"blk.{bid}.ffn_down.weight", f"blk.{bid}.ffn_up.weight"
                if self.types[down] == QType.F32 and self.types[up] in (QType.F16, QType.Q8_0):
                    self.types[down] = self.types[up]
                    if self.types[up] == QType.F16:
                        self.scales[f"blk.{bid}.ffn_up.scale"] = _FFN_DOWN_INPUT_SCALE
                        self.scales[f"blk.{bid}.ffn_down.scale"] = 1.0 / _FFN_DOWN_INPUT_SCALE

    def shape(self, dst: str) -> tuple[int, ...]:
        """numpy shape of a tensor with stored data."""
        if dst in (_OUTPUT, "token_embd.weight"):
            return self.file.tensor_shape(L.CP_HEAD)[1:]
        return self.file.tensor_shape(self.sources[dst])

    def data(self, dst: str) -> np.ndarray:
        """The bytes libllama gets for a tensor with stored data (converted if planned)."""
        if dst == _OUTPUT:
            return np.ascontiguousarray(self.file.raw(L.CP_HEAD)[0])
        src = self.sources[dst]
        stored, wanted = self.file.tensor_type(src), self.types[dst]
        if wanted == stored:  # mapped: libllama copies it into its buffer, the one copy made
            return self.file.raw(src)
        if wanted == QType.F16:
            return self.file.read(src).astype(np.float16)
        return quantize(self.file.read(src), wanted)

    def nbytes(self, dst: str) -> int:
        *rows, cols = self.shape(dst)
        block, type_size = gguf.GGML_QUANT_SIZES[self.types[dst]]
        return int(np.prod(rows, dtype=np.int64)) * (cols // block * type_size)


def _metadata(plan: _Plan, cfg: CodePredictorConfig) -> bytes:
    """A metadata-only GGUF (KV pairs and tensor infos, no data) describing the LM as `qwen3`.
    libllama takes the shapes from the hyperparameters and each tensor's type from its info."""
    with tempfile.TemporaryDirectory(prefix="kazeia-cp-") as tmp:
        path = Path(tmp) / "code_predictor.gguf"
        w = gguf.GGUFWriter(path, ARCH)
        w.add_name("qwen3-tts code predictor")
        w.add_context_length(4096)
        w.add_embedding_length(cfg.hidden_size)
        w.add_block_count(cfg.num_layers)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_heads)
        w.add_head_count_kv(cfg.num_kv_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_tokenizer_model("none")
        w.add_vocab_size(cfg.vocab_size)
        for dst, qtype in plan.types.items():
            w.add_tensor_info(dst, plan.shape(dst), np.dtype(np.float32), plan.nbytes(dst), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        header = path.read_bytes()
    # gguf's reader seeks to the aligned start of the data section: it must lie in the buffer
    return header + bytes(-len(header) % w.data_alignment)


class _Weights:
    """The set-tensor callback: each tensor's bytes, checked against what libllama made."""

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan
        self.error: Exception | None = None
        self.loaded: set[str] = set()
        self.output: int | None = None  # address of the output tensor
        self.callback = llama_cpp.llama_model_set_tensor_data_t(self._set)

    def _set(self, tensor: int, _userdata: int) -> None:
        try:
            self._copy(tensor)
        except Exception as e:  # an exception cannot cross the C callback: keep it for later
            if self.error is None:
                self.error = e

    def _copy(self, tensor: int) -> None:
        name = ggml.ggml_get_name(tensor).decode()
        nbytes = ggml.ggml_nbytes(tensor)
        t = GGMLTensor.from_address(tensor)
        if name in self.plan.types and name not in _UNUSED:
            data = self.plan.data(name)
            qtype = self.plan.types[name]
            shape = self.plan.shape(name)[::-1]
            ne = tuple(t.ne)
            if t.type != qtype or ne != shape + (1,) * (4 - len(shape)) or data.nbytes != nbytes:
                raise ModelFileError(
                    f"{self.plan.file.path}: {name} should be {qtype.name} {shape}; libllama made "
                    f"type {t.type} {ne}"
                )
            self.loaded.add(name)
            if name == _OUTPUT:
                if ggml.ggml_get_data(tensor) != t.data or t.name != name.encode():
                    raise ModelFileError("struct ggml_tensor differs from ggml_lib.GGMLTensor")
                self.output = tensor
        elif name in _UNUSED:
            data = np.zeros(nbytes, dtype=np.uint8)
        else:
            value = self.plan.scales.get(name)
            if value is None:
                value = next((v for k, v in _NEUTRAL_SUFFIXES.items() if name.endswith(k)), None)
            if value is None or t.type != QType.F32:
                raise ModelFileError(f"libllama asks for a code predictor tensor {name!r} we cannot supply")
            data = np.full(nbytes // 4, value, dtype=np.float32)
        ggml.ggml_backend_tensor_set(tensor, data.ctypes.data, 0, nbytes)


def build_llama_model(plan: _Plan, cfg: CodePredictorConfig) -> tuple[llama_cpp.llama_model_p, int]:
    """A libllama `qwen3` model holding the code predictor (weights copied), and the address of
    its output tensor (struct ggml_tensor), whose data pointer selects the head."""
    init_backend()
    f = plan.file
    header = _metadata(plan, cfg)
    buf = ctypes.create_string_buffer(header, len(header))
    meta = ggml.gguf_init_from_buffer(buf, len(header), GGUFInitParams(True, None))
    if not meta:
        raise ModelFileError(f"{f.path}: libggml rejected the code predictor's metadata")
    weights = _Weights(plan)
    try:
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        model = llama_cpp.llama_model_init_from_user(meta, weights.callback, None, params)
    finally:
        ggml.gguf_free(meta)
    problem = weights.error
    if problem is None and not model:
        problem = ModelFileError(
            f"{f.path}: libllama could not build the code predictor (run with -v for llama.cpp's reason)"
        )
    missing = sorted(set(plan.types) - _UNUSED - weights.loaded)
    if problem is None and missing:
        problem = ModelFileError(f"{f.path}: libllama did not ask for {missing}")
    if problem is None and weights.output is None:
        problem = ModelFileError(f"{f.path}: libllama made no output tensor")
    if problem is not None:
        if model:
            llama_cpp.llama_model_free(model)
        raise problem
    assert weights.output is not None
    return model, weights.output


class _Table:
    """Rows of a stacked [groups, rows, width] tensor as float32, dequantized on demand."""

    def __init__(self, f: GGUFFile, name: str) -> None:
        self.raw = f.raw(name)
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
        self._proj: tuple[np.ndarray, np.ndarray] | None = None  # weight [hidden, talker], bias
        if cfg.has_projection:
            self._proj = (
                f.read(L.CP_PROJ_IN + ".weight"),
                f.read(L.CP_PROJ_IN + ".bias"),
            )
        # our copy of the heads (stored type); the output tensor points into it
        self._heads = f.load(L.CP_HEAD)
        self._head_bytes = self._heads[0].nbytes
        plan = _Plan(f, cfg.num_layers, exact)
        model, output = build_llama_model(plan, cfg)
        # what a pass reads: every matrix libllama holds (one head: `output`), our projection
        read = [dst for dst in plan.types if dst not in _UNUSED]
        self.bytes_per_pass = sum(plan.nbytes(dst) for dst in read)
        self.params_per_pass = sum(int(np.prod(plan.shape(dst))) for dst in read)
        if self._proj is not None:
            self.bytes_per_pass += self._proj[0].nbytes
            self.params_per_pass += self._proj[0].size
        self._model: llama_cpp.llama_model_p | None = model
        self._output = GGMLTensor.from_address(output)
        self._lm = EmbeddingLM(
            model,
            cfg,
            cfg.vocab_size,
            1,
            LMOptions(threads, n_ctx=_N_POS, n_batch=_N_POS * max_streams, kv_f32=True, n_seq=max_streams),
            cores,
        )

    def close(self) -> None:
        """Free the context and the model (once; also when collected)."""
        if hasattr(self, "_lm"):
            self._lm.close()
        if getattr(self, "_model", None):
            llama_cpp.llama_model_free(self._model)
            self._model = None

    __del__ = close

    def set_threads(self, threads: int) -> None:
        self._lm.set_threads(threads)

    def _project(self, x: np.ndarray) -> np.ndarray:
        if self._proj is None:
            return x
        weight, bias = self._proj
        # einsum runs in this thread: a BLAS call would wake OpenBLAS threads that spin on the
        # core libllama's second thread needs
        return np.einsum("oi,ni->no", weight, x) + bias

    def _step(self, parts: list[tuple[int, np.ndarray, int]], codebook: int) -> np.ndarray:
        """Feed each stream's rows (talker width) after its frame's earlier inputs: parts are
        (sequence, rows, position), codebook 1 the first two rows at position 0, codebook j one
        row at position j; the logits of `codebook` at each part's last row [parts, vocab]."""
        self._output.data = self._heads.ctypes.data + (codebook - 1) * self._head_bytes
        projected = self._project(np.concatenate([rows for _, rows, _ in parts]))
        ends = np.cumsum([len(rows) for _, rows, _ in parts])
        pieces = np.split(projected, ends[:-1])
        return self._lm.forward_many([(seq, x, pos) for (seq, _, pos), x in zip(parts, pieces)])[1]

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
        sampler each), every pass one decode of all of them: codes [S, 16], embeddings [S, H].
        Each stream is its own sequence (`first_seq` onwards), so its codes do not depend on the
        others; `between(seq)` runs between two passes, and may predict other streams' frames
        in the sequences from `seq` on."""
        n = len(code0)
        if first_seq + n > self.max_streams:
            raise ValueError(f"{first_seq + n} sequences > the code predictor's {self.max_streams}")
        codes = np.empty((n, self.n_groups + 1), dtype=np.int64)
        codes[:, 0] = code0
        seqs = range(first_seq, first_seq + n)
        parts = [
            (seq, np.stack([np.asarray(h, np.float32), self._talker_embd.row(int(c))]), 0)
            for seq, h, c in zip(seqs, hidden, code0)
        ]
        for seq in seqs:
            self._lm.keep(0, seq)
        for j in range(1, self.n_groups + 1):
            logits = self._step(parts, j)
            for s in range(n):
                code = int(samplers[s](logits[s]))
                if not 0 <= code < self.vocab_size:
                    raise ValueError(
                        f"sampled code {code} of codebook {j} is outside 0..{self.vocab_size - 1}"
                    )
                codes[s, j] = code
            parts = [(seq, self._embd.row(j - 1, int(c))[None], j + 1) for seq, c in zip(seqs, codes[:, j])]
            if between is not None and j < self.n_groups:
                between(first_seq + n)
        return codes, np.stack([self.embed(c) for c in codes])

    def teacher_forced_logits(self, hidden: np.ndarray, codes: np.ndarray) -> np.ndarray:
        """[15, vocab]: codebook j's logits given codes 0..j-1 of the frame (the same decodes
        as `predict`, fed the given codes)."""
        codes = np.asarray(codes)
        x = np.stack([np.asarray(hidden, dtype=np.float32), self._talker_embd.row(int(codes[0]))])
        logits = np.empty((self.n_groups, self.vocab_size), dtype=np.float32)
        self._lm.clear(clear_data=False)
        for j in range(1, self.n_groups + 1):
            logits[j - 1] = self._step([(0, x, 0 if j == 1 else j)], j)[0]
            x = self._embd.row(j - 1, int(codes[j]))[None]
        return logits

    def embed(self, codes: np.ndarray) -> np.ndarray:
        """The talker's next input for a frame's 16 codes: C_talker(c0) + sum_i cp.embd[i-1](cb_i)."""
        total = self._talker_embd.row(int(codes[0])).copy()
        for j in range(1, self.n_groups + 1):
            total += self._embd.row(j - 1, int(codes[j]))
        return total
