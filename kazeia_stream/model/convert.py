"""Convert an official Qwen3-TTS checkpoint (Hugging Face layout) into the GGUF pair llama.cpp reads.

numpy and gguf only, no torch. The output matches llama.cpp's own converter
(`conversion/qwen3tts.py`): same tensors, names, shapes and metadata, and its tensor-type rules
outside the codec decoder, so libllama loads the talker and mtmd the mmproj. Differences, on
purpose:

- the pre-tokenizer is written as `qwen2` directly (llama.cpp's converter refuses vocabularies
  whose hash it does not know);
- the codec decoder (`a.gen.wav.*`) and the speaker encoder stay F32 whatever the type;
- in a `q8_0` mmproj the code predictor's `ffn_down` is Q8_0 (llama.cpp keeps it F32 for F16's
  range, which Q8_0's per-block scales do not need; the engine would quantize it at every load);
- Base models also get the codec encoder (`kazeia.enc.*`, F32), which llama.cpp does not convert:
  in-context cloning needs it to turn the reference recording into codes;
- a checkpoint without speaker encoder (CustomVoice, VoiceDesign) gets an mmproj without one
  (llama.cpp's converter assumes a Base model);
- extra `kazeia.*` keys (see gguf_layout);
- `q4_k_m`, `q5_k_m`, `q6_k`: the talker is written F32, then quantized by llama.cpp's own
  quantizer (`llama_model_quantize`, its recipe for the type), and the mmproj is the `q8_0` one.

Every input is read and checked before anything is written, and both files are written or
neither. Tensors are produced and written one at a time, the text-embedding fold in row blocks,
so the peak memory is about the largest tensor, not the model.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import TokenType

from ..errors import ModelFileError, UsageError
from . import gguf_layout as L
from .checkpoint import Checkpoint, SafeTensors, read_json
from .gguf_file import drop_from_page_cache

TYPES: dict[str, str] = {
    "f32": "everything F32 (lossless: the BF16 weights exactly)",
    "f16": "talker and code-predictor matrices (incl. embeddings and heads) F16; norms, biases, the "
    "code predictor's ffn_down, the speaker encoder and the codec decoder and encoder F32",
    "q8_0": "talker and code-predictor matrices (incl. embeddings and heads, and the code predictor's "
    "ffn_down, which llama.cpp's converter keeps F32) Q8_0; norms, biases, the speaker encoder and the "
    "codec decoder and encoder F32",
    "q4_k_m": "the talker quantized by llama.cpp's quantizer to its Q4_K_M recipe (Q4_K, Q6_K for "
    "attn_v, ffn_down and the codec head in part); the mmproj as q8_0 (code predictor Q8_0)",
    "q5_k_m": "the talker by llama.cpp's Q5_K_M recipe; the mmproj as q8_0",
    "q6_k": "the talker by llama.cpp's Q6_K recipe; the mmproj as q8_0",
}
DECODER_TYPES: dict[str, str] = {
    "f32": "the codec decoder in float32, whatever the type: its audio that of the official "
    "decoder to float rounding",
    "f16": "its matrices and conv kernels in float16, as llama.cpp writes its conv kernels: "
    "half the bytes a frame's decode reads, and their rounding in the audio",
}
# Types whose talker llama.cpp's own quantizer makes (llama_model_quantize) from an F32 talker;
# their code predictor stays Q8_0: below 8 bits its codes drift (#11).
_LLAMA_QUANTIZED = {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}  # enum llama_ftype
_FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}

_FOLD_ROWS = 4096  # text-embedding rows folded per block
# Fixed by the architectures (llama.cpp's converter and clip.cpp hard-code them too).
_SPK_BLOCKS = 3  # ECAPA-TDNN SE-Res2Net blocks, `blocks.1..3`
_SPK_RES2_CONVS = 7  # res2net scale 8
_DAC_RES_UNITS = 3  # residual units per codec decoder block (dilations 1, 3, 9)
_SPK_NUM_MEL_BINS = 128
_SPK_CHANNELS = 1536  # written as the clip "embedding" and "feed forward" sizes
_SPK_EPS = 1e-5
# transformers' MimiModel fixes its downsample conv (25 Hz -> 12.5 Hz) to stride 2 and replicate
# padding whatever the config says.
_MIMI_DOWNSAMPLE_STRIDE = 2
_MIMI_DOWNSAMPLE_PAD_MODE = "replicate"
_MIMI_CODEBOOK_EPS = 1e-5  # MimiEuclideanCodebook's epsilon: embed_sum / clamp(cluster_usage, eps)

# Layer tensors: checkpoint suffix -> GGUF name.
_TALKER_LAYER = {
    "input_layernorm.weight": L.TALKER_ATTN_NORM,
    "self_attn.q_proj.weight": L.TALKER_ATTN_Q,
    "self_attn.k_proj.weight": L.TALKER_ATTN_K,
    "self_attn.v_proj.weight": L.TALKER_ATTN_V,
    "self_attn.o_proj.weight": L.TALKER_ATTN_OUT,
    "self_attn.q_norm.weight": L.TALKER_ATTN_Q_NORM,
    "self_attn.k_norm.weight": L.TALKER_ATTN_K_NORM,
    "post_attention_layernorm.weight": L.TALKER_FFN_NORM,
    "mlp.gate_proj.weight": L.TALKER_FFN_GATE,
    "mlp.up_proj.weight": L.TALKER_FFN_UP,
    "mlp.down_proj.weight": L.TALKER_FFN_DOWN,
}
_CP_LAYER = {
    "input_layernorm.weight": L.CP_ATTN_NORM,
    "self_attn.q_proj.weight": L.CP_ATTN_Q,
    "self_attn.k_proj.weight": L.CP_ATTN_K,
    "self_attn.v_proj.weight": L.CP_ATTN_V,
    "self_attn.o_proj.weight": L.CP_ATTN_OUT,
    "self_attn.q_norm.weight": L.CP_ATTN_Q_NORM,
    "self_attn.k_norm.weight": L.CP_ATTN_K_NORM,
    "post_attention_layernorm.weight": L.CP_FFN_NORM,
    "mlp.gate_proj.weight": L.CP_FFN_GATE,
    "mlp.up_proj.weight": L.CP_FFN_UP,
    "mlp.down_proj.weight": L.CP_FFN_DOWN,
}
_WAV_TFM_LAYER = {
    "input_layernorm.weight": L.WAV_TFM_ATTN_NORM,
    "self_attn.q_proj.weight": L.WAV_TFM_ATTN_Q,
    "self_attn.k_proj.weight": L.WAV_TFM_ATTN_K,
    "self_attn.v_proj.weight": L.WAV_TFM_ATTN_V,
    "self_attn.o_proj.weight": L.WAV_TFM_ATTN_OUT,
    "self_attn_layer_scale.scale": L.WAV_TFM_ATTN_SCALE,
    "post_attention_layernorm.weight": L.WAV_TFM_FFN_NORM,
    "mlp.gate_proj.weight": L.WAV_TFM_FFN_GATE,
    "mlp.up_proj.weight": L.WAV_TFM_FFN_UP,
    "mlp.down_proj.weight": L.WAV_TFM_FFN_DOWN,
    "mlp_layer_scale.scale": L.WAV_TFM_FFN_SCALE,
}
_ENC_TFM_LAYER = {  # the Mimi encoder transformer's linear layers, biases only if attention_bias
    "self_attn.q_proj": L.ENC_TFM_ATTN_Q,
    "self_attn.k_proj": L.ENC_TFM_ATTN_K,
    "self_attn.v_proj": L.ENC_TFM_ATTN_V,
    "self_attn.o_proj": L.ENC_TFM_ATTN_OUT,
}
_GENERATION_SOURCE = {"subtalker_do_sample": "subtalker_dosample"}  # our key -> generation_config.json


def convert(
    hf_dir: str | Path, out_dir: str | Path, out_type: str = "f16", decoder: str = "f32"
) -> tuple[Path, Path]:
    """Write `<name>-<type>.gguf` (talker) and `mmproj-<name>-<type>.gguf` into out_dir, the
    codec decoder's weights as `decoder` says (`DECODER_TYPES`).

    `<name>` is the checkpoint directory's name. Raises ModelFileError naming the file when an
    input is missing or invalid, UsageError for an unknown out_type or decoder type.
    """
    if out_type not in TYPES:
        raise UsageError(f"unknown type {out_type!r}; choose one of {', '.join(TYPES)}")
    if decoder not in DECODER_TYPES:
        raise UsageError(f"unknown decoder type {decoder!r}; choose one of {', '.join(DECODER_TYPES)}")
    ckpt = Checkpoint(Path(hf_dir))
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: not a folder (the pair is written into OUT_DIR)")
    out.mkdir(parents=True, exist_ok=True)
    name = ckpt.dir.resolve().name
    paths = (out / f"{name}-{out_type}.gguf", out / f"mmproj-{name}-{out_type}.gguf")
    parts = [path.with_name(path.name + ".part") for path in paths]
    quantized = out_type in _LLAMA_QUANTIZED
    mmproj_type = "q8_0" if quantized else out_type
    (talker, talker_tensors), (mmproj, mmproj_tensors) = (
        # every input is read and checked before anything is written; then both files or neither
        _talker_file(ckpt, "f32" if quantized else out_type),
        _mmproj_file(ckpt, mmproj_type, decoder),
    )
    unquantized = parts[0].with_name(parts[0].name + ".f32")
    try:
        if quantized:
            _write_file(talker, talker_tensors, unquantized, "f32")
            _llama_quantize(unquantized, parts[0], _LLAMA_QUANTIZED[out_type])
        else:
            _write_file(talker, talker_tensors, parts[0], out_type)
        _write_file(mmproj, mmproj_tensors, parts[1], mmproj_type)
        for part, path in zip(parts, paths):
            drop_from_page_cache(part)  # the first load then reads it in huge pieces
            part.replace(path)
    finally:
        for part in (*parts, unquantized):
            part.unlink(missing_ok=True)
    return paths


def _llama_quantize(src: Path, dst: Path, ftype: int) -> None:
    """llama.cpp's quantizer, with its recipe for `ftype` (it keeps every key of the file)."""
    import llama_cpp

    from .llama import init_backend

    init_backend()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 1
    if llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), ctypes.byref(params)) != 0:
        raise ModelFileError(f"{src}: llama.cpp's quantizer failed (run with -v for its reason)")


# ------------------------------------------------------------------------------------------------
# Tensors
# ------------------------------------------------------------------------------------------------


@dataclass
class _Tensor:
    """A tensor to write: `chunks()` yields float32 arrays whose row-major data, concatenated,
    is the tensor's; each has the tensor's last axis (so each can be quantized alone)."""

    name: str
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[np.ndarray]]
    keep_f32: bool = False
    no_f16: bool = False  # F32 where the type would make it F16 (its input exceeds F16's range)
    f16: bool = False  # F16 whatever the type (the codec decoder's matrices, `DECODER_TYPES`)


def _copy(st: SafeTensors, src: str, dst: str, no_f16: bool = False) -> _Tensor:
    return _Tensor(dst, st.shape(src), lambda: [st.read(src)], no_f16=no_f16)


def _pair(st: SafeTensors, src: str, dst: str) -> list[_Tensor]:
    """A `.weight` / `.bias` pair."""
    return [_copy(st, f"{src}.{s}", f"{dst}.{s}") for s in ("weight", "bias")]


def _squeezed(st: SafeTensors, src: str, dst: str) -> _Tensor:
    """A k=1 convolution kernel [out, in, 1] stored as a matrix [out, in]."""
    return _Tensor(dst, st.shape(src)[:-1], lambda: [st.read(src)[..., 0]])


def _stacked(st: SafeTensors, srcs: list[str], dst: str) -> _Tensor:
    shape = st.shape(srcs[0])
    for src in srcs:
        st.expect(src, shape)
    return _Tensor(dst, (len(srcs), *shape), lambda: (st.read(src) for src in srcs))


def _snake(st: SafeTensors, src: str, dst: str) -> list[_Tensor]:
    """SnakeBeta with its exp()/reciprocal folded in: alpha = exp(a), beta = 1 / (exp(b) + 1e-9)."""
    a, b = f"{src}.alpha", f"{src}.beta"
    return [
        _Tensor(f"{dst}.alpha", st.shape(a), lambda: [np.exp(st.read(a))]),
        _Tensor(f"{dst}.beta", st.shape(b), lambda: [1.0 / (np.exp(st.read(b)) + 1e-9)]),
    ]


def _codebooks(st: SafeTensors, src: str, n: int, dst: str) -> _Tensor:
    """The EMA codebooks of an RVQ: embedding_sum / clamp(cluster_usage, 1e-5); 2D when n == 1."""
    prefixes = [f"{src}.vq.layers.{i}._codebook" for i in range(n)]
    return _ema_codebooks(st, prefixes, "embedding_sum", 1e-5, dst, stack=n > 1)


def _ema_codebooks(
    st: SafeTensors, prefixes: list[str], sum_name: str, eps: float, dst: str, stack: bool = True
) -> _Tensor:
    """Codebooks kept as EMA sums, divided as the official modules do at load: `<prefix>.<sum_name>`
    / clamp(`<prefix>.cluster_usage`, eps); [n, size, dim], or [size, dim] when not `stack`."""
    shape = st.shape(f"{prefixes[0]}.{sum_name}")
    for p in prefixes:
        st.expect(f"{p}.{sum_name}", shape)
        st.expect(f"{p}.cluster_usage", shape[:1])

    def chunks() -> Iterable[np.ndarray]:
        for p in prefixes:
            usage = st.read(p + ".cluster_usage")
            yield st.read(f"{p}.{sum_name}") / np.maximum(usage, eps)[:, None]

    return _Tensor(dst, (len(prefixes), *shape) if stack else shape, chunks)


def _token_embd(ckpt: Checkpoint) -> _Tensor:
    """[T(id) for every text id | codec_embedding], T = fc2(silu(fc1(text_embedding) + b1)) + b2,
    folded in float32 by blocks of rows."""
    st, t = ckpt.weights, ckpt.talker
    if t["hidden_act"] != "silu":
        raise ModelFileError(f"{ckpt.config.path}: unsupported talker_config.hidden_act {t['hidden_act']!r}")
    n_text, text_hidden, hidden = t["text_vocab_size"], t["text_hidden_size"], t["hidden_size"]
    emb, codec = "talker.model.text_embedding.weight", "talker.model.codec_embedding.weight"
    proj = "talker.text_projection."
    st.expect(emb, (n_text, text_hidden))
    st.expect(codec, (t["vocab_size"], hidden))
    st.expect(proj + "linear_fc1.weight", (text_hidden, text_hidden))
    st.expect(proj + "linear_fc1.bias", (text_hidden,))
    st.expect(proj + "linear_fc2.weight", (hidden, text_hidden))
    st.expect(proj + "linear_fc2.bias", (hidden,))

    def chunks() -> Iterable[np.ndarray]:
        w1, b1 = st.read(proj + "linear_fc1.weight").T, st.read(proj + "linear_fc1.bias")
        w2, b2 = st.read(proj + "linear_fc2.weight").T, st.read(proj + "linear_fc2.bias")
        for start in range(0, n_text, _FOLD_ROWS):
            h = st.read(emb, start, min(start + _FOLD_ROWS, n_text)) @ w1 + b1
            with np.errstate(over="ignore"):  # exp(-h) = inf for very negative h gives silu = -0
                h /= 1.0 + np.exp(-h)
            yield h @ w2 + b2
        yield st.read(codec)

    return _Tensor(L.TALKER_TOKEN_EMBD, (n_text + t["vocab_size"], hidden), chunks)


def _talker_tensors(ckpt: Checkpoint) -> list[_Tensor]:
    st = ckpt.weights
    st.expect("talker.codec_head.weight", (ckpt.talker["vocab_size"], ckpt.talker["hidden_size"]))
    tensors = [
        _token_embd(ckpt),
        _copy(st, "talker.model.norm.weight", L.TALKER_OUTPUT_NORM),
        _copy(st, "talker.codec_head.weight", L.TALKER_OUTPUT),
    ]
    for bid in range(ckpt.talker["num_hidden_layers"]):
        tensors += [
            _copy(st, f"talker.model.layers.{bid}.{src}", dst.format(bid=bid))
            for src, dst in _TALKER_LAYER.items()
        ]
    return tensors


def _code_predictor_tensors(ckpt: Checkpoint) -> list[_Tensor]:
    st, cp = ckpt.weights, "talker.code_predictor."
    groups = range(ckpt.code_predictor["num_code_groups"] - 1)
    tensors = [
        _stacked(st, [f"{cp}model.codec_embedding.{i}.weight" for i in groups], L.CP_EMBD),
        _stacked(st, [f"{cp}lm_head.{i}.weight" for i in groups], L.CP_HEAD),
        _copy(st, "talker.model.codec_embedding.weight", L.CP_OUT_EMBD),
        _copy(st, f"{cp}model.norm.weight", L.CP_OUTPUT_NORM),
    ]
    if st.has(f"{cp}small_to_mtp_projection.weight"):
        tensors += _pair(st, f"{cp}small_to_mtp_projection", L.CP_PROJ_IN)
    for bid in range(ckpt.code_predictor["num_hidden_layers"]):
        # ffn_down never F16 (F32 instead, as in llama.cpp): its input peaks near 1.5e5, beyond
        # F16, and ggml's mul_mat casts the input to the weight's type. Q8_0 scales each block
        # of the input, so a q8_0 file has it Q8_0 (llama.cpp's F32 there, which the engine
        # quantizes at every load, cost 0.1-0.3 s of a first audio from process start).
        tensors += [
            _copy(st, f"{cp}model.layers.{bid}.{src}", dst.format(bid=bid), no_f16=dst == L.CP_FFN_DOWN)
            for src, dst in _CP_LAYER.items()
        ]
    return tensors


def _codec_tensors(ckpt: Checkpoint) -> list[_Tensor]:
    st, dec, q = ckpt.codec, ckpt.decoder, "decoder.quantizer."
    tensors = [
        _squeezed(st, q + "rvq_first.input_proj.weight", L.WAV_QUANT_FIRST_IN),
        _squeezed(st, q + "rvq_first.output_proj.weight", L.WAV_QUANT_FIRST_OUT),
        _codebooks(st, q + "rvq_first", 1, L.WAV_QUANT_FIRST_CB),
        _squeezed(st, q + "rvq_rest.input_proj.weight", L.WAV_QUANT_REST_IN),
        _squeezed(st, q + "rvq_rest.output_proj.weight", L.WAV_QUANT_REST_OUT),
        _codebooks(st, q + "rvq_rest", dec["num_quantizers"] - 1, L.WAV_QUANT_REST_CB),
        *_pair(st, "decoder.pre_conv.conv", L.WAV_PRE_CONV),
        *_pair(st, "decoder.pre_transformer.input_proj", L.WAV_TFM_IN_PROJ),
        *_pair(st, "decoder.pre_transformer.output_proj", L.WAV_TFM_OUT_PROJ),
        _copy(st, "decoder.pre_transformer.norm.weight", L.WAV_TFM_OUTPUT_NORM),
    ]
    for bid in range(dec["num_hidden_layers"]):
        tensors += [
            _copy(st, f"decoder.pre_transformer.layers.{bid}.{src}", dst.format(bid=bid))
            for src, dst in _WAV_TFM_LAYER.items()
        ]
    for bid in range(len(dec["upsampling_ratios"])):
        up = f"decoder.upsample.{bid}."
        tensors += [
            *_pair(st, up + "0.conv", L.WAV_UP_CONV.format(bid=bid)),
            *_pair(st, up + "1.dwconv.conv", L.WAV_UP_DWCONV.format(bid=bid)),
            *_pair(st, up + "1.norm", L.WAV_UP_NORM.format(bid=bid)),
            *_pair(st, up + "1.pwconv1", L.WAV_UP_PW1.format(bid=bid)),
            *_pair(st, up + "1.pwconv2", L.WAV_UP_PW2.format(bid=bid)),
            _copy(st, up + "1.gamma", L.WAV_UP_GAMMA.format(bid=bid)),
        ]
    tensors += _pair(st, "decoder.decoder.0.conv", L.WAV_DAC_ENTRY)
    n_blocks = len(dec["upsample_rates"])
    for bid in range(n_blocks):
        blk = f"decoder.decoder.{bid + 1}.block."  # decoder.decoder.0 is the entry conv
        tensors += [
            *_snake(st, blk + "0", L.WAV_DAC_UP_SNAKE.format(bid=bid)),
            *_pair(st, blk + "1.conv", L.WAV_DAC_UP_CONV.format(bid=bid)),
        ]
        for xid in range(_DAC_RES_UNITS):
            res, ids = f"{blk}{xid + 2}.", {"bid": bid, "xid": xid}
            tensors += [
                *_snake(st, res + "act1", L.WAV_DAC_RES_ACT1.format(**ids)),
                *_pair(st, res + "conv1.conv", L.WAV_DAC_RES_CONV1.format(**ids)),
                *_snake(st, res + "act2", L.WAV_DAC_RES_ACT2.format(**ids)),
                *_pair(st, res + "conv2.conv", L.WAV_DAC_RES_CONV2.format(**ids)),
            ]
    tensors += [
        *_snake(st, f"decoder.decoder.{n_blocks + 1}", L.WAV_DAC_POST_SNAKE),
        *_pair(st, f"decoder.decoder.{n_blocks + 2}.conv", L.WAV_DAC_POST_CONV),
    ]
    return tensors


def _codec_encoder_tensors(ckpt: Checkpoint) -> list[_Tensor]:
    """The Mimi encoder (`encoder.*`) as transformers' MimiModel builds it from encoder_config:
    SEANet convs, the transformer, the downsample conv, and the codebooks the official encode
    keeps (the first `encoder_valid_num_quantizers`: semantic, then acoustic)."""
    st, enc = ckpt.codec, ckpt.encoder
    for key, supported in (("use_causal_conv", True), ("use_conv_shortcut", False), ("audio_channels", 1)):
        if enc[key] != supported:
            raise ModelFileError(
                f"{enc.path}: unsupported {enc.where}{key} {enc[key]!r} (expected {supported!r})"
            )
    p = "encoder.encoder.layers."
    tensors = _pair(st, p + "0.conv", L.ENC_CONV_IN)
    index = 1  # MimiEncoder.layers: conv; per ratio: residual blocks, ELU, strided conv; ELU, conv
    for bid in range(len(enc["upsampling_ratios"])):
        for xid in range(enc["num_residual_layers"]):
            ids = {"bid": bid, "xid": xid}
            tensors += [
                *_pair(st, f"{p}{index}.block.1.conv", L.ENC_RES_CONV1.format(**ids)),
                *_pair(st, f"{p}{index}.block.3.conv", L.ENC_RES_CONV2.format(**ids)),
            ]
            index += 1
        tensors += _pair(st, f"{p}{index + 1}.conv", L.ENC_DOWN_CONV.format(bid=bid))
        index += 2
    tensors += _pair(st, f"{p}{index + 1}.conv", L.ENC_CONV_OUT)
    for bid in range(enc["num_hidden_layers"]):
        lp = f"encoder.encoder_transformer.layers.{bid}."
        tensors += _pair(st, lp + "input_layernorm", L.ENC_TFM_ATTN_NORM.format(bid=bid))
        for src, dst in _ENC_TFM_LAYER.items():
            parts = ("weight", "bias") if enc.get("attention_bias") else ("weight",)
            tensors += [_copy(st, f"{lp}{src}.{s}", f"{dst.format(bid=bid)}.{s}") for s in parts]
        tensors += [
            _copy(st, lp + "self_attn_layer_scale.scale", L.ENC_TFM_ATTN_SCALE.format(bid=bid)),
            *_pair(st, lp + "post_attention_layernorm", L.ENC_TFM_FFN_NORM.format(bid=bid)),
            _copy(st, lp + "mlp.fc1.weight", L.ENC_TFM_FFN_UP.format(bid=bid)),
            _copy(st, lp + "mlp.fc2.weight", L.ENC_TFM_FFN_DOWN.format(bid=bid)),
            _copy(st, lp + "mlp_layer_scale.scale", L.ENC_TFM_FFN_SCALE.format(bid=bid)),
        ]
    tensors.append(_copy(st, "encoder.downsample.conv.weight", L.ENC_DOWNSAMPLE))

    valid, semantic = ckpt.codec_config["encoder_valid_num_quantizers"], enc["num_semantic_quantizers"]
    if not semantic < valid <= enc["num_quantizers"]:
        raise ModelFileError(
            f"{ckpt.codec_config.path}: encoder_valid_num_quantizers {valid} is not between "
            f"num_semantic_quantizers {semantic} (excluded) and num_quantizers {enc['num_quantizers']}"
        )
    has_proj = enc["vector_quantization_hidden_dimension"] != enc["hidden_size"]  # as MimiModel decides
    q = "encoder.quantizer."
    for part, n, proj, cb in (
        ("semantic", semantic, L.ENC_QUANT_SEMANTIC_IN, L.ENC_QUANT_SEMANTIC_CB),
        ("acoustic", valid - semantic, L.ENC_QUANT_ACOUSTIC_IN, L.ENC_QUANT_ACOUSTIC_CB),
    ):
        rvq = f"{q}{part}_residual_vector_quantizer."
        if has_proj:
            tensors.append(_squeezed(st, rvq + "input_proj.weight", proj))
        prefixes = [f"{rvq}layers.{i}.codebook" for i in range(n)]
        tensors.append(_ema_codebooks(st, prefixes, "embed_sum", _MIMI_CODEBOOK_EPS, cb))
    return tensors


def _speaker_encoder_tensors(ckpt: Checkpoint) -> list[_Tensor]:
    st, se = ckpt.weights, "speaker_encoder."
    tensors = _pair(st, se + "blocks.0.conv", L.SPK_STEM)
    for bid in range(1, _SPK_BLOCKS + 1):
        blk = f"{se}blocks.{bid}."
        tensors += _pair(st, blk + "tdnn1.conv", L.SPK_TDNN1.format(bid=bid))
        for xid in range(_SPK_RES2_CONVS):
            tensors += _pair(st, f"{blk}res2net_block.blocks.{xid}.conv", L.SPK_RES2.format(bid=bid, xid=xid))
        tensors += [
            *_pair(st, blk + "tdnn2.conv", L.SPK_TDNN2.format(bid=bid)),
            *_pair(st, blk + "se_block.conv1", L.SPK_SE_CONV1.format(bid=bid)),
            *_pair(st, blk + "se_block.conv2", L.SPK_SE_CONV2.format(bid=bid)),
        ]
    tensors += [
        *_pair(st, se + "mfa.conv", L.SPK_MFA),
        *_pair(st, se + "asp.tdnn.conv", L.SPK_ASP_TDNN),
        *_pair(st, se + "asp.conv", L.SPK_ASP_CONV),
        *_pair(st, se + "fc", L.SPK_FC),
    ]
    # F32 whatever the type (ours; llama.cpp writes F16 kernels): 9 M parameters (12 M on the
    # 1.7B) that run once per voice, so exactness costs 18-24 MB of file and no time
    return [replace(t, keep_f32=True) for t in tensors]


# ------------------------------------------------------------------------------------------------
# Vocabulary
# ------------------------------------------------------------------------------------------------


def _text_tokens(ckpt: Checkpoint) -> tuple[list[str], list[int]]:
    """The Qwen2 vocabulary as llama.cpp writes it: vocab.json tokens NORMAL, added tokens CONTROL
    when special or `<|...|>`-shaped, else USER_DEFINED, missing ids `[PADn]` UNUSED."""
    n = ckpt.talker["text_vocab_size"]
    tokens: list[str | None] = [None] * n
    types = [TokenType.UNUSED] * n
    vocab_path = ckpt.dir / "vocab.json"
    vocab = read_json(vocab_path)
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise ModelFileError(f"{vocab_path}: not a mapping of tokens to ids")
    entries = [(i, tok, TokenType.NORMAL) for tok, i in vocab.items()]
    try:
        for i, entry in ckpt.tokenizer_config.get("added_tokens_decoder", {}).items():
            content = entry["content"]
            special = entry.get("special") or (content.startswith("<|") and content.endswith("|>"))
            entries.append((int(i), content, TokenType.CONTROL if special else TokenType.USER_DEFINED))
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ModelFileError(f"{ckpt.tokenizer_config.path}: bad added_tokens_decoder ({e!r})") from None
    for i, tok, typ in entries:
        if not 0 <= i < n:
            raise ModelFileError(f"{vocab_path}: token id {i} ({tok!r}) outside the text vocabulary of {n}")
        tokens[i], types[i] = tok, typ
    return [f"[PAD{i}]" if tok is None else tok for i, tok in enumerate(tokens)], [int(t) for t in types]


def _merges(ckpt: Checkpoint) -> list[str]:
    path = ckpt.dir / "merges.txt"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ModelFileError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: unreadable ({e})") from None
    if lines and lines[0].startswith("#"):
        lines = lines[1:]
    return [" ".join(parts) for parts in (line.split() for line in lines) if len(parts) == 2]


def _codec_tokens(ckpt: Checkpoint) -> list[str]:
    """`<|codec_N|>`, renamed from every talker_config `*_id` key exactly as llama.cpp's
    `_codec_token_names()`: `codec_bos_id` -> `<|codec_bos|>`, `spk_id.ryan` -> `<|spk_ryan|>`."""
    n = ckpt.talker["vocab_size"]
    names = [L.CODEC_TOKEN.format(id=i) for i in range(n)]
    for key, val in ckpt.talker.data.items():
        if not key.endswith("_id"):
            continue
        prefix = key[: -len("_id")]
        ids = (
            {f"<|{prefix}|>": val}
            if isinstance(val, int)
            else ({f"<|{prefix}_{k}|>": v for k, v in val.items()} if isinstance(val, dict) else {})
        )
        for name, i in ids.items():
            if not isinstance(i, int) or not 0 <= i < n:
                raise ModelFileError(
                    f"{ckpt.config.path}: talker_config.{key} id {i} is outside the codec vocabulary"
                )
            names[i] = name
    return names


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------


def _talker_file(ckpt: Checkpoint, out_type: str) -> tuple[gguf.GGUFWriter, list[_Tensor]]:
    """The talker's metadata in a writer, and its tensors."""
    t = ckpt.talker
    tensors = _talker_tensors(ckpt)
    w = gguf.GGUFWriter(None, L.TALKER_ARCH)
    _add_general(w, ckpt, "model", out_type, tensors)
    w.add_uint32(L.KEY_BLOCK_COUNT, t["num_hidden_layers"])
    w.add_uint32(L.KEY_CONTEXT_LENGTH, t["max_position_embeddings"])
    w.add_uint32(L.KEY_EMBEDDING_LENGTH, t["hidden_size"])
    w.add_uint32(L.KEY_FEED_FORWARD_LENGTH, t["intermediate_size"])
    w.add_uint32(L.KEY_HEAD_COUNT, t["num_attention_heads"])
    w.add_uint32(L.KEY_HEAD_COUNT_KV, t["num_key_value_heads"])
    sections = list(t.section("rope_scaling")["mrope_section"])
    w.add_array(L.KEY_ROPE_SECTIONS, (sections + [0] * 4)[:4])
    w.add_float32(L.KEY_ROPE_FREQ_BASE, t["rope_theta"])
    w.add_float32(L.KEY_RMS_EPS, t["rms_norm_eps"])
    w.add_uint32(L.KEY_KEY_LENGTH, t["head_dim"])
    w.add_uint32(L.KEY_VALUE_LENGTH, t["head_dim"])

    text_tokens, text_types = _text_tokens(ckpt)
    codec_tokens = _codec_tokens(ckpt)
    n_vocab = len(text_tokens) + len(codec_tokens)
    eos = len(text_tokens) + t["codec_eos_token_id"]
    w.add_string(L.KEY_TOKENIZER_MODEL, L.TOKENIZER_MODEL)
    w.add_string(L.KEY_TOKENIZER_PRE, L.TOKENIZER_PRE)
    w.add_array(L.KEY_TOKENS, text_tokens + codec_tokens)
    w.add_array(L.KEY_TOKEN_TYPES, text_types + [int(TokenType.CONTROL)] * len(codec_tokens))
    w.add_array(L.KEY_MERGES, _merges(ckpt))
    # the talker may only emit codes 0..2047 or the codec EOS
    w.add_array(L.KEY_SUPPRESS_TOKENS, [i for i in range(n_vocab - 1024, n_vocab) if i != eos])
    w.add_uint32(L.KEY_EOS_TOKEN_ID, eos)
    w.add_bool(L.KEY_ADD_BOS, bool(ckpt.tokenizer_config.get("add_bos_token", False)))
    w.add_bool(L.KEY_ADD_EOS, False)

    w.add_string(L.KEY_TTS_MODEL_TYPE, ckpt.kind)
    w.add_string(L.KEY_TTS_MODEL_SIZE, ckpt.config["tts_model_size"])
    dialects = {spk: lang for spk, lang in (t.get("spk_is_dialect") or {}).items() if lang}
    w.add_array(L.KEY_DIALECT_SPEAKERS, list(dialects))  # not written when empty (gguf cannot)
    w.add_array(L.KEY_DIALECT_LANGUAGES, list(dialects.values()))
    for key, typ in L.GENERATION_KEYS.items():
        value = ckpt.generation.get(_GENERATION_SOURCE.get(key, key))
        if value is not None:
            _add_typed(w, L.KEY_GENERATION_PREFIX + key, typ(value))
    return w, tensors


def _mmproj_file(ckpt: Checkpoint, out_type: str, decoder: str) -> tuple[gguf.GGUFWriter, list[_Tensor]]:
    """The mmproj's metadata in a writer, and its tensors."""
    cp, dec = ckpt.code_predictor, ckpt.decoder
    has_spkenc = ckpt.kind == "base"
    codec = _codec_tensors(ckpt)
    if decoder == "f16":
        tables = (L.WAV_QUANT_FIRST_CB, L.WAV_QUANT_REST_CB)  # looked up: no product reads them
        codec = [replace(t, f16=len(t.shape) > 1 and t.name not in tables) for t in codec]
    tensors = _code_predictor_tensors(ckpt) + codec
    if has_spkenc:
        tensors += _speaker_encoder_tensors(ckpt) + _codec_encoder_tensors(ckpt)
    w = gguf.GGUFWriter(None, L.MMPROJ_ARCH)
    _add_general(w, ckpt, "mmproj", out_type, tensors)
    hidden = ckpt.talker["hidden_size"]
    if has_spkenc:
        # ECAPA-TDNN has no attention or FFN: clip.cpp needs these keys, llama.cpp writes fixed values
        w.add_bool(L.KEY_HAS_AUDIO_ENCODER, True)
        w.add_string(L.KEY_AUDIO_PROJECTOR_TYPE, L.SPKENC_PROJECTOR_TYPE)
        w.add_uint32(L.KEY_AUDIO_PROJECTION_DIM, hidden)
        w.add_uint32(L.KEY_AUDIO_NUM_MEL_BINS, _SPK_NUM_MEL_BINS)
        w.add_uint32(L.KEY_AUDIO_BLOCK_COUNT, _SPK_BLOCKS)
        w.add_uint32(L.KEY_AUDIO_EMBEDDING_LENGTH, _SPK_CHANNELS)
        w.add_uint32(L.KEY_AUDIO_HEAD_COUNT, 1)
        w.add_uint32(L.KEY_AUDIO_FEED_FORWARD_LENGTH, _SPK_CHANNELS)
        w.add_float32(L.KEY_AUDIO_LAYERNORM_EPS, _SPK_EPS)
    w.add_bool(L.KEY_HAS_GEN_AUDIO_ENCODER, True)
    w.add_string(L.KEY_GEN_PROJECTOR_TYPE, L.GEN_PROJECTOR_TYPE)
    w.add_uint32(L.KEY_GEN_PROJECTION_DIM, hidden)
    w.add_uint32(L.KEY_GEN_EMBEDDING_LENGTH, cp["hidden_size"])
    w.add_uint32(L.KEY_GEN_FEED_FORWARD_LENGTH, cp["intermediate_size"])
    w.add_uint32(L.KEY_GEN_BLOCK_COUNT, cp["num_hidden_layers"])
    w.add_uint32(L.KEY_GEN_HEAD_COUNT, cp["num_attention_heads"])
    w.add_uint32(L.KEY_GEN_HEAD_COUNT_KV, cp["num_key_value_heads"])
    w.add_float32(L.KEY_GEN_LAYERNORM_EPS, cp["rms_norm_eps"])

    for key, typ in L.CODEC_KEYS.items():
        _add_typed(w, L.KEY_CODEC_PREFIX + key, typ(dec[key]))
    w.add_uint32(L.KEY_CODEC_SAMPLE_RATE, ckpt.codec_config["output_sample_rate"])
    w.add_uint32(L.KEY_CODEC_SAMPLES_PER_FRAME, ckpt.codec_config["decode_upsample_rate"])
    w.add_array(L.KEY_CODEC_UPSAMPLING_RATIOS, [int(r) for r in dec["upsampling_ratios"]])
    w.add_array(L.KEY_CODEC_UPSAMPLE_RATES, [int(r) for r in dec["upsample_rates"]])
    w.add_uint32(L.KEY_CP_HEAD_DIM, cp["head_dim"])
    w.add_float32(L.KEY_CP_ROPE_THETA, cp["rope_theta"])
    w.add_uint32(L.KEY_CP_VOCAB_SIZE, cp["vocab_size"])
    w.add_uint32(L.KEY_CP_NUM_CODE_GROUPS, cp["num_code_groups"])
    if has_spkenc:
        _add_codec_encoder_keys(w, ckpt)
    return w, tensors


def _add_codec_encoder_keys(w: gguf.GGUFWriter, ckpt: Checkpoint) -> None:
    """What the codec encoder needs beside its tensor shapes (`kazeia.codec_encoder.*`)."""
    enc = ckpt.encoder
    for key, typ in L.CODEC_ENCODER_KEYS.items():
        _add_typed(w, L.KEY_ENC_PREFIX + key, typ(enc[key]))
    w.add_array(L.KEY_ENC_UPSAMPLING_RATIOS, [int(r) for r in enc["upsampling_ratios"]])
    w.add_uint32(L.KEY_ENC_VALID_QUANTIZERS, ckpt.codec_config["encoder_valid_num_quantizers"])
    w.add_uint32(L.KEY_ENC_FRAME_SIZE, ckpt.codec_config["encode_downsample_rate"])
    w.add_uint32(L.KEY_ENC_DOWNSAMPLE_STRIDE, _MIMI_DOWNSAMPLE_STRIDE)
    w.add_string(L.KEY_ENC_DOWNSAMPLE_PAD_MODE, _MIMI_DOWNSAMPLE_PAD_MODE)


def _add_general(
    w: gguf.GGUFWriter, ckpt: Checkpoint, file_kind: str, out_type: str, tensors: list[_Tensor]
) -> None:
    """general.* as llama.cpp writes them: name, basename, size label... from the directory name
    and model card, sampling defaults from generation_config.json, file type."""
    n_params = sum(math.prod(t.shape) for t in tensors)
    meta = gguf.Metadata.load(None, ckpt.dir, None, n_params)
    meta.name = meta.name or ckpt.dir.resolve().name
    meta.size_label = meta.size_label or gguf.size_label(n_params, 0, 0, 0)
    w.add_string(L.KEY_TYPE, file_kind)
    meta.set_gguf_meta_model(w)
    w.add_uint32(L.KEY_FILE_TYPE, int(_FILE_TYPES[out_type]))
    w.add_uint32(L.KEY_QUANTIZATION_VERSION, gguf.GGML_QUANT_VERSION)
    w.add_string(L.KEY_CHECKPOINT_ID, ckpt.fingerprint)


def _add_typed(w: gguf.GGUFWriter, key: str, value: bool | int | float | str) -> None:
    if isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    else:
        w.add_float32(key, value)


def _ggml_type(t: _Tensor, out_type: str) -> QType:
    """llama.cpp's rules: vectors F32; the codec decoder and encoder, the speaker encoder and
    forced tensors F32 (ours), unless forced F16; rows that are not whole Q8_0 blocks fall
    back to F16, or F32 where F16 would overflow."""
    if t.f16:
        return QType.F16
    if out_type == "f32" or len(t.shape) < 2 or t.keep_f32 or t.name.startswith((L.WAV_PREFIX, L.ENC_PREFIX)):
        return QType.F32
    if out_type == "q8_0" and t.shape[-1] % gguf.GGML_QUANT_SIZES[QType.Q8_0][0] == 0:
        return QType.Q8_0
    return QType.F32 if t.no_f16 else QType.F16


def _encode(a: np.ndarray, qtype: QType) -> np.ndarray:
    if qtype == QType.F32:
        return np.ascontiguousarray(a, dtype=np.float32)
    if qtype == QType.F16:
        return a.astype(np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), qtype)


def _write_file(w: gguf.GGUFWriter, tensors: list[_Tensor], path: Path, out_type: str) -> None:
    """Header, metadata and tensor infos through GGUFWriter, then the data tensor by tensor,
    chunk by chunk."""
    types = [_ggml_type(t, out_type) for t in tensors]
    for t, qtype in zip(tensors, types):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), math.prod(t.shape) // block * size, qtype)
    progress = sys.stderr.isatty()
    try:
        w.write_header_to_file(path)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None  # opened by write_header_to_file
        fout = w.fout[0]
        w.write_padding(fout, fout.tell())
        for i, (t, qtype) in enumerate(zip(tensors, types)):
            if progress:
                print(f"\r{path.stem}: tensor {i + 1}/{len(tensors)}", end="", file=sys.stderr, flush=True)
            n = 0
            for chunk in t.chunks():
                data = _encode(chunk, qtype)
                data.tofile(fout)
                n += data.nbytes
            w.write_padding(fout, n)
    finally:
        w.close()
        if progress:
            print(file=sys.stderr)
