"""The code predictor: codebooks 1..15 of a frame from the talker's hidden state and codebook 0.

Its 5-layer Qwen3 LM runs on libllama as a plain `qwen3` model built in memory from the mmproj's
`a.gen.code.*` tensors (`llama_model_init_from_user`): the metadata is a GGUF header written with
`gguf.GGUFWriter` and parsed by libggml, and the weights are copied from the memory-mapped mmproj
in their stored types. The model has a one-token dummy vocabulary; we feed embeddings and apply
the 15 per-codebook heads (`lm_head[j-1]` for codebook j) in numpy on the final-norm hidden state.
numpy work uses `einsum`, which runs in the calling thread: a BLAS matvec would wake OpenBLAS
threads that spin on the core libllama's second thread needs (seen in perf: `blas_thread_server`
took 14% of a frame's samples).

Per frame (positions restart at 0): a 2-token prefill [h, C_talker(c0)], then 14 single steps
fed `codec_embedding[j-1](cb_j)`; every input goes through small_to_mtp_projection when the model
has one (1.7B).
"""

from __future__ import annotations

import ctypes
import tempfile
from collections.abc import Callable
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from ..errors import ModelFileError
from ..ggml_lib import GGMLTensorHead, GGUFInitParams, ggml
from ..model import gguf_layout as L
from ..model import llama as _llama  # noqa: F401  (routes llama.cpp's log, inits the backend)
from ..model.gguf_file import GGUFFile
from .llm import EmbeddingLM, LMOptions

ARCH = "qwen3"
# The dummy vocabulary: token_embd and output get this many rows (zeros; never used).
_N_VOCAB = 1
# Positions per frame: the 2-token prefill and 14 steps use 16; the teacher-forced pass 16 too.
_N_POS = 16

_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


def _tensor_map(f: GGUFFile, n_layers: int) -> dict[str, str]:
    """libllama `qwen3` tensor name -> mmproj tensor name."""
    names = {"output_norm.weight": L.CP_OUTPUT_NORM}
    per_layer = {
        "attn_norm": L.CP_ATTN_NORM, "attn_q": L.CP_ATTN_Q, "attn_k": L.CP_ATTN_K,
        "attn_v": L.CP_ATTN_V, "attn_output": L.CP_ATTN_OUT, "attn_q_norm": L.CP_ATTN_Q_NORM,
        "attn_k_norm": L.CP_ATTN_K_NORM, "ffn_norm": L.CP_FFN_NORM, "ffn_gate": L.CP_FFN_GATE,
        "ffn_up": L.CP_FFN_UP, "ffn_down": L.CP_FFN_DOWN,
    }
    for bid in range(n_layers):
        for dst, src in per_layer.items():
            names[f"blk.{bid}.{dst}.weight"] = src.format(bid=bid)
    for src in names.values():
        if not f.has_tensor(src):
            raise ModelFileError(f"{f.path}: code predictor tensor {src!r} is missing")
    return names


def _to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even (exact for the BF16-born weights)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _plan(f: GGUFFile, names: dict[str, str], ffn_down_bf16: bool) -> dict[str, GGMLQuantizationType]:
    """The type libllama gets for each tensor: the stored one, except F32 ffn_down -> BF16 if asked."""
    types = {}
    for dst, src in names.items():
        qtype = f.tensor_type(src)
        if ffn_down_bf16 and src.endswith("ffn_down.weight") and qtype == GGMLQuantizationType.F32:
            qtype = GGMLQuantizationType.BF16
        types[dst] = qtype
    return types


def _metadata(f: GGUFFile, cfg, names: dict[str, str], types: dict[str, GGMLQuantizationType]) -> bytes:
    """A metadata-only GGUF (KV pairs and tensor infos, no data) describing the LM as `qwen3`."""
    with tempfile.TemporaryDirectory(prefix="kazeia-cp-") as tmp:
        path = Path(tmp) / "code_predictor.gguf"
        w = gguf.GGUFWriter(path, ARCH)
        w.add_name("qwen3-tts code predictor")
        w.add_context_length(max(_N_POS, 4096))
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
        w.add_vocab_size(_N_VOCAB)
        for dst, src in names.items():
            raw = f.raw(src)
            if types[dst] == GGMLQuantizationType.BF16:
                w.add_tensor_info(dst, raw.shape, np.float32, raw.size * 2, raw_dtype=types[dst])
            else:
                w.add_tensor_info(dst, raw.shape, raw.dtype, raw.nbytes, raw_dtype=types[dst])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        header = path.read_bytes()
    # gguf's reader seeks to the aligned start of the data section: it must lie in the buffer
    pad = -len(header) % w.data_alignment
    return header + bytes(pad)


# Optional tensors libllama creates for a model built from metadata (a file would simply lack
# them) and the graph then uses: filled with the value that makes them a no-op. Any other tensor
# it asks for that the mmproj lacks is an error, so a libllama that adds one is noticed.
_NEUTRAL_SUFFIXES = {".bias": 0.0, ".scale": 1.0, ".input_scale": 1.0}  # q/k/v bias, FP8-style scales
_UNUSED = {"token_embd.weight", "output.weight", "cls.output.weight"}  # dummy vocab, rerank head


class _Weights:
    """The set_tensor_data callback: copies each tensor's stored bytes from the mmproj."""

    def __init__(self, f: GGUFFile, names: dict[str, str], types: dict[str, GGMLQuantizationType]) -> None:
        self.file, self.names, self.types = f, names, types
        self.error: Exception | None = None
        self.loaded: set[str] = set()
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
        head = GGMLTensorHead.from_address(tensor)
        src = self.names.get(name)
        if src is None:
            data = self._filler(name, head.type, nbytes)
        else:
            data = np.ascontiguousarray(self.file.raw(src))
            qtype = self.types[name]
            if qtype != self.file.tensor_type(src):
                data = _to_bf16(data)
            shape = self.file.tensor_shape(src)[::-1]
            ne = tuple(head.ne[: len(shape)])
            if head.type != qtype or ne != shape or data.nbytes != nbytes:
                raise ModelFileError(
                    f"{self.file.path}: {src} is {qtype.name} {shape}, "
                    f"libllama expects type {head.type} {tuple(head.ne)} for {name}")
            self.loaded.add(name)
        ggml.ggml_backend_tensor_set(tensor, data.ctypes.data, 0, nbytes)

    @staticmethod
    def _filler(name: str, qtype: int, nbytes: int) -> np.ndarray:
        if name in _UNUSED:
            return np.zeros(nbytes, dtype=np.uint8)
        value = next((v for k, v in _NEUTRAL_SUFFIXES.items() if name.endswith(k)), None)
        if value is None or qtype != GGMLQuantizationType.F32:
            raise ModelFileError(f"libllama asks for a code predictor tensor {name!r} we cannot supply")
        return np.full(nbytes // 4, value, dtype=np.float32)


def build_llama_model(f: GGUFFile, cfg, ffn_down_bf16: bool = False) -> llama_cpp.llama_model_p:
    """A libllama `qwen3` model holding the code predictor's layers (weights copied)."""
    names = _tensor_map(f, cfg.num_layers)
    types = _plan(f, names, ffn_down_bf16)
    header = _metadata(f, cfg, names, types)
    buf = ctypes.create_string_buffer(header, len(header))
    meta = ggml.gguf_init_from_buffer(buf, len(header), GGUFInitParams(True, None))
    if not meta:
        raise ModelFileError(f"{f.path}: libggml rejected the code predictor's metadata")
    weights = _Weights(f, names, types)
    try:
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        model = llama_cpp.llama_model_init_from_user(meta, weights.callback, None, params)
    finally:
        ggml.gguf_free(meta)
    if weights.error is not None or not model:
        if model:
            llama_cpp.llama_model_free(model)
        raise weights.error or ModelFileError(
            f"{f.path}: libllama could not build the code predictor (run with -vv for llama.cpp's reason)")
    missing = set(names) - weights.loaded
    if missing:
        llama_cpp.llama_model_free(model)
        raise ModelFileError(f"{f.path}: libllama did not ask for {sorted(missing)}")
    return model


class _Table:
    """Rows of a stacked [groups, rows, width] tensor as float32, dequantized on demand."""

    def __init__(self, f: GGUFFile, name: str) -> None:
        self.raw = f.raw(name)
        self.qtype = f.tensor_type(name)

    def row(self, *index: int) -> np.ndarray:
        data = self.raw[index]
        if self.qtype in _PLAIN:
            return data.astype(np.float32)
        return dequantize(np.asarray(data)[None], self.qtype)[0].astype(np.float32, copy=False)


class CodePredictor:
    """Codebooks 1..15 of each frame, and the talker's next input embedding."""

    def __init__(self, model, threads: int = 2, ffn_down_bf16: bool = False) -> None:
        f: GGUFFile = model.mmproj_file
        self.config = cfg = model.config.code_predictor
        self.n_groups = cfg.num_code_groups - 1
        self.vocab_size = cfg.vocab_size
        self._embd = _Table(f, L.CP_EMBD)  # [15, 2048, talker hidden]
        self._talker_embd = _Table(f, L.CP_OUT_EMBD)  # [codec vocab, talker hidden]
        self.talker_hidden = f.tensor_shape(L.CP_EMBD)[-1]
        self._heads = np.ascontiguousarray(f.tensor(L.CP_HEAD))  # [15, 2048, hidden] float32
        if cfg.has_projection:
            self._proj_w = np.ascontiguousarray(f.tensor(L.CP_PROJ_IN + ".weight"))  # [hidden, talker]
            self._proj_b = f.tensor(L.CP_PROJ_IN + ".bias")
        else:
            self._proj_w = self._proj_b = None
        self._model = build_llama_model(f, cfg, ffn_down_bf16)
        self._lm = EmbeddingLM(self._model, cfg.hidden_size, _N_VOCAB, 1,
                               LMOptions(n_ctx=_N_POS, n_batch=_N_POS, threads=threads))

    def close(self) -> None:
        lm = getattr(self, "_lm", None)
        if lm is not None:
            lm.close()
            self._lm = None
        if getattr(self, "_model", None):
            llama_cpp.llama_model_free(self._model)
            self._model = None

    __del__ = close

    def set_threads(self, threads: int) -> None:
        self._lm.set_threads(threads)

    def _project(self, x: np.ndarray) -> np.ndarray:
        if self._proj_w is None:
            return x
        return np.einsum("oi,ni->no", self._proj_w, x) + self._proj_b

    def predict(self, hidden: np.ndarray, code0: int,
                sample: Callable[[np.ndarray], int]) -> tuple[np.ndarray, np.ndarray]:
        """Codes [16] (code0 then cb1..cb15) and the talker's next input embedding
        C_talker(code0) + sum_i cp.embd[i-1](cb_i) [talker hidden]; `sample(logits) -> code`."""
        lm = self._lm
        lm.reset()
        c0_row = self._talker_embd.row(int(code0))
        x = np.stack([np.asarray(hidden, dtype=np.float32), c0_row])
        h, _ = lm.forward(self._project(x))
        codes = np.empty(self.n_groups + 1, dtype=np.int64)
        codes[0] = code0
        total = c0_row.copy()
        for j in range(1, self.n_groups + 1):
            logits = np.einsum("vh,h->v", self._heads[j - 1], h)
            code = int(sample(logits))
            if not 0 <= code < self.vocab_size:
                raise ValueError(f"sampled code {code} of codebook {j} is outside 0..{self.vocab_size - 1}")
            codes[j] = code
            row = self._embd.row(j - 1, code)
            total += row
            if j < self.n_groups:
                h, _ = lm.forward(self._project(row[None]))
        return codes, total

    def teacher_forced_logits(self, hidden: np.ndarray, codes: np.ndarray) -> np.ndarray:
        """[15, vocab]: codebook j's logits given codes 0..j-1 of the frame, in one forward."""
        codes = np.asarray(codes)
        rows = [np.asarray(hidden, dtype=np.float32), self._talker_embd.row(int(codes[0]))]
        rows += [self._embd.row(j - 1, int(codes[j])) for j in range(1, self.n_groups)]
        self._lm.reset()
        h, _ = self._lm.forward(self._project(np.stack(rows)), outputs="all")
        self._lm.reset()
        return np.einsum("gvh,gh->gv", self._heads, h[1:])

    def embed(self, codes: np.ndarray) -> np.ndarray:
        """The talker's next input for a frame's 16 codes: C_talker(c0) + sum_i cp.embd[i-1](cb_i)."""
        total = self._talker_embd.row(int(codes[0])).copy()
        for j in range(1, self.n_groups + 1):
            total += self._embd.row(j - 1, int(codes[j]))
        return total
