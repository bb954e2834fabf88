#!/usr/bin/env python3
"""Write a random-weight Qwen3-TTS 12 Hz checkpoint in the official Hugging Face layout.

Why: the real checkpoints are large downloads with no network on CI, and tests must still
exercise the converter and the runtime end to end. This tool writes exactly the file set of a
published repository (config.json, generation_config.json, model.safetensors in BF16, the Qwen2
tokenizer files, preprocessor_config.json and speech_tokenizer/{config.json,
preprocessor_config.json, model.safetensors in F32}) with the official tensor names and shapes,
so the official `qwen-tts` loader reads it with no missing or unexpected key.

It needs numpy only (no torch): the safetensors files are written by hand, BF16 being the upper
16 bits of float32 rounded to nearest even.

Random values are chosen so that a reference computed from them is informative (see the engine
notes, "Random-weight checkpoints: pitfalls"): fan-in-scaled weights, embeddings with std 0.5,
random codebooks with cluster_usage in [0.5, 2], every norm weight, bias, layer scale and SnakeBeta
parameter perturbed, and the codec's last layer scaled for an output RMS near 0.2. Each tensor has
its own generator seeded from (--seed, tensor name), so a checkpoint is a pure function of
(preset, kind, seed) and does not depend on the order tensors are written in.

Presets:
  tiny  for the test suite: keeps every vocabulary and special id of the real model (16
        codebooks of 2048, codec vocab 3072, text vocab 151936, 1920 samples per frame, decoder
        window 72) with tiny widths. About 23 MB with the 4.4 MB tokenizer files; most of the
        rest is what the real vocabularies impose (15 code-predictor tables and heads of 2048
        rows, the 151936-row text embedding). custom_voice and base say "0b6" with talker
        hidden == code-predictor hidden (no small_to_mtp_projection); voice_design says "1b7"
        with talker hidden 96 != 64, so the projection exists.
  0.6b, 1.7b  the real sizes.

Usage: python tools/make_random_checkpoint.py --preset tiny --kind custom_voice --seed 1 OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import struct
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "tokenizer"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")
KINDS = ("custom_voice", "base", "voice_design")
NUM_CODE_GROUPS = 16
CODEBOOK_SIZE = 2048
TEXT_VOCAB = 151936
CODEC_VOCAB = 3072

# Output RMS target of the codec decoder: its last conv's gain, found by measuring the official
# decoder on the tiny preset (RMS of the waveform from random codes is about 0.2 with it).
CODEC_OUTPUT_GAIN = 0.08

# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------

# Talker / code predictor widths. "mrope" sections must sum to head_dim / 2.
TALKER = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        text_hidden_size=16,
        mrope_section=[4, 2, 2],
    ),
    "0.6b": dict(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        text_hidden_size=2048,
        mrope_section=[24, 20, 20],
    ),
    "1.7b": dict(
        hidden_size=2048,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=6144,
        text_hidden_size=2048,
        mrope_section=[24, 20, 20],
    ),
}
# The tiny voice_design talker is wider than its code predictor, to exercise small_to_mtp_projection.
TINY_VOICE_DESIGN_TALKER_HIDDEN = 96

CODE_PREDICTOR = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
    ),
    "0.6b": dict(
        hidden_size=1024,
        num_hidden_layers=5,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
    ),
}
CODE_PREDICTOR["1.7b"] = CODE_PREDICTOR["0.6b"]

# ECAPA-TDNN speaker encoder (Base only); enc_dim is always the talker hidden size.
# The real configs write only enc_dim and sample_rate and rely on the code defaults below.
SPEAKER_ENCODER_DEFAULTS = dict(
    mel_dim=128,
    enc_channels=[512, 512, 512, 512, 1536],
    enc_kernel_sizes=[5, 3, 3, 3, 1],
    enc_dilations=[1, 2, 3, 4, 1],
    enc_attention_channels=128,
    enc_res2net_scale=8,
    enc_se_channels=128,
    sample_rate=24000,
)
TINY_SPEAKER_ENCODER = dict(
    SPEAKER_ENCODER_DEFAULTS, enc_channels=[32, 32, 32, 32, 96], enc_attention_channels=16, enc_se_channels=16
)

CODEC_DECODER = {
    "real": dict(
        codebook_dim=512,
        latent_dim=1024,
        hidden_size=512,
        head_dim=64,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=1024,
        num_hidden_layers=8,
        decoder_dim=1536,
    ),
    "tiny": dict(
        codebook_dim=32,
        latent_dim=64,
        hidden_size=32,
        head_dim=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=64,
        num_hidden_layers=2,
        decoder_dim=64,
    ),
}

# Mimi encoder (only used by Base models for ICL reference codes, but present in every
# speech_tokenizer/model.safetensors). The tiny one keeps the strides, so 1920 samples per frame.
CODEC_ENCODER = {
    "real": dict(
        hidden_size=512,
        intermediate_size=2048,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        num_hidden_layers=8,
        num_filters=64,
        codebook_dim=256,
        vector_quantization_hidden_dimension=256,
        upsample_groups=512,
    ),
    "tiny": dict(
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=1,
        num_filters=4,
        codebook_dim=8,
        vector_quantization_hidden_dimension=8,
        upsample_groups=16,
    ),
}

# ---------------------------------------------------------------------------------------------
# Configs (values of the published 0.6B-CustomVoice repository unless a preset changes them)
# ---------------------------------------------------------------------------------------------

SPEAKERS = {
    "serena": 3066,
    "vivian": 3065,
    "uncle_fu": 3010,
    "ryan": 3061,
    "aiden": 2861,
    "ono_anna": 2873,
    "sohee": 2864,
    "eric": 2875,
    "dylan": 2878,
}
DIALECTS = {"eric": "sichuan_dialect", "dylan": "beijing_dialect"}
LANGUAGES = {
    "chinese": 2055,
    "english": 2050,
    "german": 2053,
    "italian": 2070,
    "portuguese": 2071,
    "spanish": 2054,
    "japanese": 2058,
    "korean": 2064,
    "french": 2061,
    "russian": 2069,
}
DIALECT_LANGUAGES = {"beijing_dialect": 2074, "sichuan_dialect": 2062}

GENERATION_CONFIG = {
    "do_sample": True,
    "repetition_penalty": 1.05,
    "temperature": 0.9,
    "top_p": 1.0,
    "top_k": 50,
    "subtalker_dosample": True,
    "subtalker_temperature": 0.9,
    "subtalker_top_p": 1.0,
    "subtalker_top_k": 50,
    "max_new_tokens": 8192,
}
PREPROCESSOR_CONFIG = {
    "padding_side": "left",
    "padding_value": 0.0,
    "processor_class": "Qwen3TTSProcessor",
    "return_attention_mask": True,
}
SPEECH_PREPROCESSOR_CONFIG = {
    "chunk_length_s": None,
    "feature_extractor_type": "EncodecFeatureExtractor",
    "feature_size": 1,
    "overlap": None,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "sampling_rate": 24000,
}

# PretrainedConfig boilerplate that the published code_predictor_config carries verbatim. Some of
# it (do_sample, top_k, temperature, repetition_penalty) seeds the predictor's generation config.
CODE_PREDICTOR_BOILERPLATE = {
    "_name_or_path": "",
    "add_cross_attention": False,
    "architectures": None,
    "bad_words_ids": None,
    "begin_suppress_tokens": None,
    "bos_token_id": None,
    "chunk_size_feed_forward": 0,
    "cross_attention_hidden_size": None,
    "decoder_start_token_id": None,
    "diversity_penalty": 0.0,
    "do_sample": False,
    "early_stopping": False,
    "encoder_no_repeat_ngram_size": 0,
    "eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "finetuning_task": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
    "is_decoder": False,
    "is_encoder_decoder": False,
    "label2id": {"LABEL_0": 0, "LABEL_1": 1},
    "length_penalty": 1.0,
    "max_length": 20,
    "min_length": 0,
    "no_repeat_ngram_size": 0,
    "num_beam_groups": 1,
    "num_beams": 1,
    "num_return_sequences": 1,
    "output_attentions": False,
    "output_hidden_states": False,
    "output_scores": False,
    "pad_token_id": None,
    "prefix": None,
    "problem_type": None,
    "pruned_heads": {},
    "remove_invalid_values": False,
    "repetition_penalty": 1.0,
    "return_dict": True,
    "return_dict_in_generate": False,
    "sep_token_id": None,
    "suppress_tokens": None,
    "task_specific_params": None,
    "temperature": 1.0,
    "tf_legacy_loss": False,
    "tie_encoder_decoder": False,
    "tie_word_embeddings": False,
    "tokenizer_class": None,
    "top_k": 50,
    "top_p": 1.0,
    "dtype": None,
    "torchscript": False,
    "typical_p": 1.0,
    "use_bfloat16": False,
}


@dataclass(frozen=True)
class Dims:
    """Every size the tensor layout depends on, resolved from (preset, kind)."""

    talker: dict
    code_predictor: dict
    speaker_encoder: dict | None
    decoder: dict
    encoder: dict


def resolve_dims(preset: str, kind: str) -> Dims:
    talker = dict(TALKER[preset])
    if preset == "tiny" and kind == "voice_design":
        talker["hidden_size"] = TINY_VOICE_DESIGN_TALKER_HIDDEN
    speaker_encoder = None
    if kind == "base":
        base = TINY_SPEAKER_ENCODER if preset == "tiny" else SPEAKER_ENCODER_DEFAULTS
        speaker_encoder = dict(base, enc_dim=talker["hidden_size"])
    size = "tiny" if preset == "tiny" else "real"
    return Dims(
        talker,
        dict(CODE_PREDICTOR[preset]),
        speaker_encoder,
        dict(CODEC_DECODER[size]),
        dict(CODEC_ENCODER[size]),
    )


def model_size_tag(preset: str, kind: str) -> str:
    if preset == "tiny":
        return "1b7" if kind == "voice_design" else "0b6"
    return {"0.6b": "0b6", "1.7b": "1b7"}[preset]


def make_config(preset: str, kind: str, dims: Dims) -> dict:
    t, cp = dims.talker, dims.code_predictor
    languages = dict(LANGUAGES)
    if kind == "custom_voice":
        languages.update(DIALECT_LANGUAGES)
    code_predictor_config = dict(
        CODE_PREDICTOR_BOILERPLATE,
        attention_bias=False,
        attention_dropout=0,
        head_dim=cp["head_dim"],
        hidden_act="silu",
        hidden_size=cp["hidden_size"],
        initializer_range=0.02,
        intermediate_size=cp["intermediate_size"],
        layer_types=["full_attention"] * cp["num_hidden_layers"],
        max_position_embeddings=65536,
        max_window_layers=28,
        model_type="qwen3_tts_talker_code_predictor",
        num_attention_heads=cp["num_attention_heads"],
        num_code_groups=NUM_CODE_GROUPS,
        num_hidden_layers=cp["num_hidden_layers"],
        num_key_value_heads=cp["num_key_value_heads"],
        rms_norm_eps=1e-06,
        rope_scaling=None,
        rope_theta=1000000,
        sliding_window=None,
        use_cache=True,
        use_sliding_window=False,
        vocab_size=CODEBOOK_SIZE,
    )
    talker_config = {
        "attention_bias": False,
        "attention_dropout": 0,
        "code_predictor_config": code_predictor_config,
        "codec_bos_id": 2149,
        "codec_eos_token_id": 2150,
        "codec_think_id": 2154,
        "codec_language_id": languages,
        "codec_nothink_id": 2155,
        "codec_pad_id": 2148,
        "codec_think_bos_id": 2156,
        "codec_think_eos_id": 2157,
        "spk_id": dict(SPEAKERS) if kind == "custom_voice" else {},
        "spk_is_dialect": {s: DIALECTS.get(s, False) for s in SPEAKERS} if kind == "custom_voice" else {},
        "head_dim": t["head_dim"],
        "hidden_act": "silu",
        "hidden_size": t["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": t["intermediate_size"],
        "max_position_embeddings": 32768,
        "model_type": "qwen3_tts_talker",
        "num_attention_heads": t["num_attention_heads"],
        "num_code_groups": NUM_CODE_GROUPS,
        "num_hidden_layers": t["num_hidden_layers"],
        "num_key_value_heads": t["num_key_value_heads"],
        "position_id_per_seconds": 13,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "interleaved": True,
            "mrope_section": list(t["mrope_section"]),
            "rope_type": "default",
            "type": "default",
        },
        "rope_theta": 1000000,
        "sliding_window": None,
        "text_hidden_size": t["text_hidden_size"],
        "text_vocab_size": TEXT_VOCAB,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": CODEC_VOCAB,
    }
    config = {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "assistant_token_id": 77091,
        "im_end_token_id": 151645,
        "im_start_token_id": 151644,
        "tts_bos_token_id": 151672,
        "tts_eos_token_id": 151673,
        "tts_pad_token_id": 151671,
        "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_size": model_size_tag(preset, kind),
        "tts_model_type": kind,
    }
    if dims.speaker_encoder is not None:
        se = dims.speaker_encoder
        # Published Base configs carry only these two keys; tiny must also spell out its widths.
        config["speaker_encoder_config"] = (
            {"enc_dim": se["enc_dim"], "sample_rate": se["sample_rate"]} if preset != "tiny" else dict(se)
        )
    config["talker_config"] = talker_config
    # This exact version makes transformers 4.57.3 apply fix_mistral_regex when the official
    # loader asks for it, as with the published files.
    config["transformers_version"] = "4.57.3"
    return config


def make_speech_tokenizer_config(dims: Dims) -> dict:
    d, e = dims.decoder, dims.encoder
    decoder_config = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "latent_dim": d["latent_dim"],
        "codebook_dim": d["codebook_dim"],
        "codebook_size": CODEBOOK_SIZE,
        "decoder_dim": d["decoder_dim"],
        "hidden_act": "silu",
        "hidden_size": d["hidden_size"],
        "intermediate_size": d["intermediate_size"],
        "layer_scale_initial_scale": 0.01,
        "max_position_embeddings": 8000,
        "head_dim": d["head_dim"],
        "num_attention_heads": d["num_attention_heads"],
        "num_hidden_layers": d["num_hidden_layers"],
        "num_key_value_heads": d["num_key_value_heads"],
        "num_quantizers": NUM_CODE_GROUPS,
        "num_semantic_quantizers": 1,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000,
        "semantic_codebook_size": 4096,
        "sliding_window": 72,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "vector_quantization_hidden_dimension": d["codebook_dim"],
    }
    encoder_config = {
        "_frame_rate": 12.5,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "audio_channels": 1,
        "codebook_dim": e["codebook_dim"],
        "codebook_size": CODEBOOK_SIZE,
        "compress": 2,
        "dilation_growth_rate": 2,
        "dtype": "float32",
        "head_dim": e["head_dim"],
        "hidden_act": "gelu",
        "hidden_size": e["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": e["intermediate_size"],
        "kernel_size": 7,
        "last_kernel_size": 3,
        "layer_scale_initial_scale": 0.01,
        "max_position_embeddings": 8000,
        "norm_eps": 1e-05,
        "normalize": False,
        "num_attention_heads": e["num_attention_heads"],
        "num_filters": e["num_filters"],
        "num_hidden_layers": e["num_hidden_layers"],
        "num_key_value_heads": e["num_key_value_heads"],
        "num_quantizers": 32,
        "num_residual_layers": 1,
        "num_semantic_quantizers": 1,
        "pad_mode": "constant",
        "residual_kernel_size": 3,
        "rope_theta": 10000.0,
        "sampling_rate": 24000,
        "sliding_window": 250,
        "transformers_version": "4.57.0.dev0",
        "trim_right_ratio": 1.0,
        "upsample_groups": e["upsample_groups"],
        "upsampling_ratios": [8, 6, 5, 4],
        "use_cache": False,
        "use_causal_conv": True,
        "use_conv_shortcut": False,
        "use_streaming": False,
        "vector_quantization_hidden_dimension": e["vector_quantization_hidden_dimension"],
    }
    return {
        "architectures": ["Qwen3TTSTokenizerV2Model"],
        "model_type": "qwen3_tts_tokenizer_12hz",
        "encoder_valid_num_quantizers": 16,
        "input_sample_rate": 24000,
        "output_sample_rate": 24000,
        "decode_upsample_rate": 1920,
        "encode_downsample_rate": 1920,
        "decoder_config": decoder_config,
        "encoder_config": encoder_config,
        "transformers_version": "4.57.3",
    }


# ---------------------------------------------------------------------------------------------
# Tensor specifications
# ---------------------------------------------------------------------------------------------

Init = Callable[[np.random.Generator, tuple], np.ndarray]


def normal(std: float) -> Init:
    return lambda rng, shape: rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


def near(center: float, spread: float) -> Init:
    """Norm weights, biases, SnakeBeta logs: a constant plus a small perturbation."""
    return lambda rng, shape: (center + spread * rng.standard_normal(shape)).astype(np.float32)


def uniform(lo: float, hi: float) -> Init:
    return lambda rng, shape: rng.uniform(lo, hi, shape).astype(np.float32)


def codebook_usage(rng: np.random.Generator, size: int) -> np.ndarray:
    return rng.uniform(0.5, 2.0, size).astype(np.float32)


def codebook_part(part: str, std: float) -> Init:
    """cluster_usage in [0.5, 2] and embedding_sum = codebook * usage, from one generator, so the
    dequantised codebook (embedding_sum / usage) is N(0, std)."""

    def init(rng: np.random.Generator, shape: tuple) -> np.ndarray:
        usage = codebook_usage(rng, shape[0])
        if part == "usage":
            return usage
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)) * usage[:, None]

    return init


NORM = near(1.0, 0.1)
BIAS = near(0.0, 0.05)
SNAKE = near(0.0, 0.2)
LAYER_SCALE = uniform(0.2, 0.5)


class Specs:
    """An ordered list of (name, shape, init) with helpers for the common module kinds."""

    def __init__(self) -> None:
        self.items: list[tuple[str, tuple, Init, str | None]] = []

    def add(self, name: str, shape, init: Init, seed_key: str | None = None) -> None:
        self.items.append((name, tuple(int(s) for s in shape), init, seed_key))

    def linear(self, name: str, n_out: int, n_in: int, bias: bool = False, gain: float = 1.0) -> None:
        self.add(f"{name}.weight", (n_out, n_in), normal(gain / math.sqrt(n_in)))
        if bias:
            self.add(f"{name}.bias", (n_out,), BIAS)

    def conv(self, name: str, n_out: int, n_in: int, k: int, bias: bool = True, gain: float = 1.0) -> None:
        self.add(f"{name}.weight", (n_out, n_in, k), normal(gain / math.sqrt(n_in * k)))
        if bias:
            self.add(f"{name}.bias", (n_out,), BIAS)

    def conv_transpose(self, name: str, n_in: int, n_out: int, k: int, stride: int) -> None:
        # Each output sample sums n_in * k / stride products.
        self.add(f"{name}.weight", (n_in, n_out, k), normal(1.0 / math.sqrt(n_in * k / stride)))
        self.add(f"{name}.bias", (n_out,), BIAS)

    def codebook(self, prefix: str, sum_name: str, size: int, dim: int, std: float) -> None:
        self.add(f"{prefix}.cluster_usage", (size,), codebook_part("usage", std), seed_key=prefix)
        self.add(f"{prefix}.{sum_name}", (size, dim), codebook_part("sum", std), seed_key=prefix)


def qwen3_layer(s: Specs, p: str, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> None:
    s.add(f"{p}.input_layernorm.weight", (hidden,), NORM)
    s.add(f"{p}.post_attention_layernorm.weight", (hidden,), NORM)
    s.linear(f"{p}.self_attn.q_proj", heads * head_dim, hidden)
    s.linear(f"{p}.self_attn.k_proj", kv_heads * head_dim, hidden)
    s.linear(f"{p}.self_attn.v_proj", kv_heads * head_dim, hidden)
    s.linear(f"{p}.self_attn.o_proj", hidden, heads * head_dim)
    s.add(f"{p}.self_attn.q_norm.weight", (head_dim,), NORM)
    s.add(f"{p}.self_attn.k_norm.weight", (head_dim,), NORM)
    s.linear(f"{p}.mlp.gate_proj", inter, hidden)
    s.linear(f"{p}.mlp.up_proj", inter, hidden)
    s.linear(f"{p}.mlp.down_proj", hidden, inter)


def model_specs(dims: Dims) -> Specs:
    """model.safetensors: talker, code predictor and (Base) speaker encoder."""
    s = Specs()
    t, cp = dims.talker, dims.code_predictor
    h, th = t["hidden_size"], t["text_hidden_size"]
    # Text side: T(id) = fc2(silu(fc1(emb))) comes out with an RMS around 0.5.
    s.add("talker.model.text_embedding.weight", (TEXT_VOCAB, th), normal(1.0))
    s.linear("talker.text_projection.linear_fc1", th, th, bias=True)
    s.linear("talker.text_projection.linear_fc2", h, th, bias=True)
    s.add("talker.model.codec_embedding.weight", (CODEC_VOCAB, h), normal(0.5))
    s.linear("talker.codec_head", CODEC_VOCAB, h)
    s.add("talker.model.norm.weight", (h,), NORM)
    for i in range(t["num_hidden_layers"]):
        qwen3_layer(
            s,
            f"talker.model.layers.{i}",
            h,
            t["num_attention_heads"],
            t["num_key_value_heads"],
            t["head_dim"],
            t["intermediate_size"],
        )

    hc = cp["hidden_size"]
    p = "talker.code_predictor"
    for i in range(cp["num_hidden_layers"]):
        qwen3_layer(
            s,
            f"{p}.model.layers.{i}",
            hc,
            cp["num_attention_heads"],
            cp["num_key_value_heads"],
            cp["head_dim"],
            cp["intermediate_size"],
        )
    s.add(f"{p}.model.norm.weight", (hc,), NORM)
    for j in range(NUM_CODE_GROUPS - 1):
        # The predictor's input tables have the talker's width (they also feed the talker).
        s.add(f"{p}.model.codec_embedding.{j}.weight", (CODEBOOK_SIZE, h), normal(0.5))
        s.linear(f"{p}.lm_head.{j}", CODEBOOK_SIZE, hc)
    if h != hc:
        s.linear(f"{p}.small_to_mtp_projection", hc, h, bias=True)

    if dims.speaker_encoder is not None:
        speaker_encoder_specs(s, dims.speaker_encoder)
    return s


def speaker_encoder_specs(s: Specs, se: dict) -> None:
    """ECAPA-TDNN, as Qwen3TTSSpeakerEncoder builds it (all convs with bias)."""
    ch, ks, scale = se["enc_channels"], se["enc_kernel_sizes"], se["enc_res2net_scale"]
    p = "speaker_encoder"
    # Log-mel inputs span about -11..2, hence the smaller first-layer gain.
    s.conv(f"{p}.blocks.0.conv", ch[0], se["mel_dim"], ks[0], gain=0.3)
    for i in range(1, len(ch) - 1):
        b = f"{p}.blocks.{i}"
        s.conv(f"{b}.tdnn1.conv", ch[i], ch[i - 1], 1)
        for j in range(scale - 1):
            s.conv(f"{b}.res2net_block.blocks.{j}.conv", ch[i] // scale, ch[i] // scale, ks[i])
        s.conv(f"{b}.tdnn2.conv", ch[i], ch[i], 1)
        s.conv(f"{b}.se_block.conv1", se["enc_se_channels"], ch[i], 1)
        s.conv(f"{b}.se_block.conv2", ch[i], se["enc_se_channels"], 1)
    s.conv(f"{p}.mfa.conv", ch[-1], ch[-1], ks[-1])
    s.conv(f"{p}.asp.tdnn.conv", se["enc_attention_channels"], ch[-1] * 3, 1)
    s.conv(f"{p}.asp.conv", ch[-1], se["enc_attention_channels"], 1)
    s.conv(f"{p}.fc", se["enc_dim"], ch[-1] * 2, 1)


def speech_tokenizer_specs(dims: Dims) -> Specs:
    """speech_tokenizer/model.safetensors: the codec decoder and the Mimi encoder."""
    s = Specs()
    decoder_specs(s, dims.decoder)
    encoder_specs(s, dims.encoder)
    return s


def decoder_specs(s: Specs, d: dict) -> None:
    cd, latent, hs, dd = d["codebook_dim"], d["latent_dim"], d["hidden_size"], d["decoder_dim"]
    vq = cd // 2
    q = "decoder.quantizer"
    for part, n in (("rvq_first", 1), ("rvq_rest", NUM_CODE_GROUPS - 1)):
        for i in range(n):
            # Codebooks summed over n layers stay at unit RMS.
            s.codebook(
                f"{q}.{part}.vq.layers.{i}._codebook",
                "embedding_sum",
                CODEBOOK_SIZE,
                vq,
                std=1.0 / math.sqrt(n),
            )
        s.conv(f"{q}.{part}.input_proj", vq, cd, 1, bias=False)
        s.conv(f"{q}.{part}.output_proj", cd, vq, 1, bias=False)
    s.conv("decoder.pre_conv.conv", latent, cd, 3)

    p = "decoder.pre_transformer"
    s.linear(f"{p}.input_proj", hs, latent, bias=True)
    for i in range(d["num_hidden_layers"]):
        lp = f"{p}.layers.{i}"
        s.add(f"{lp}.input_layernorm.weight", (hs,), NORM)
        s.add(f"{lp}.post_attention_layernorm.weight", (hs,), NORM)
        heads, kv, hd = d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"]
        s.linear(f"{lp}.self_attn.q_proj", heads * hd, hs)
        s.linear(f"{lp}.self_attn.k_proj", kv * hd, hs)
        s.linear(f"{lp}.self_attn.v_proj", kv * hd, hs)
        s.linear(f"{lp}.self_attn.o_proj", hs, heads * hd)
        s.linear(f"{lp}.mlp.gate_proj", d["intermediate_size"], hs)
        s.linear(f"{lp}.mlp.up_proj", d["intermediate_size"], hs)
        s.linear(f"{lp}.mlp.down_proj", hs, d["intermediate_size"])
        s.add(f"{lp}.self_attn_layer_scale.scale", (hs,), LAYER_SCALE)
        s.add(f"{lp}.mlp_layer_scale.scale", (hs,), LAYER_SCALE)
    s.add(f"{p}.norm.weight", (hs,), NORM)
    s.linear(f"{p}.output_proj", latent, hs, bias=True)

    for i in range(2):  # upsampling_ratios [2, 2]
        u = f"decoder.upsample.{i}"
        s.conv_transpose(f"{u}.0.conv", latent, latent, 2, 2)
        s.conv(f"{u}.1.dwconv.conv", latent, 1, 7)
        s.add(f"{u}.1.norm.weight", (latent,), NORM)
        s.add(f"{u}.1.norm.bias", (latent,), BIAS)
        s.linear(f"{u}.1.pwconv1", 4 * latent, latent, bias=True)
        s.linear(f"{u}.1.pwconv2", latent, 4 * latent, bias=True)
        s.add(f"{u}.1.gamma", (latent,), LAYER_SCALE)

    s.conv("decoder.decoder.0.conv", dd, latent, 7)
    for i, rate in enumerate((8, 5, 4, 3), start=1):
        b = f"decoder.decoder.{i}.block"
        n_in, n_out = dd // 2 ** (i - 1), dd // 2**i
        s.add(f"{b}.0.alpha", (n_in,), SNAKE)
        s.add(f"{b}.0.beta", (n_in,), SNAKE)
        s.conv_transpose(f"{b}.1.conv", n_in, n_out, 2 * rate, rate)
        for j in (2, 3, 4):  # residual units, dilations 1, 3, 9
            for act in ("act1", "act2"):
                s.add(f"{b}.{j}.{act}.alpha", (n_out,), SNAKE)
                s.add(f"{b}.{j}.{act}.beta", (n_out,), SNAKE)
            s.conv(f"{b}.{j}.conv1.conv", n_out, n_out, 7, gain=0.5)
            s.conv(f"{b}.{j}.conv2.conv", n_out, n_out, 1, gain=0.5)
    out = dd // 16
    s.add("decoder.decoder.5.alpha", (out,), SNAKE)
    s.add("decoder.decoder.5.beta", (out,), SNAKE)
    s.conv("decoder.decoder.6.conv", 1, out, 7, gain=CODEC_OUTPUT_GAIN)


def encoder_specs(s: Specs, e: dict) -> None:
    """transformers' MimiModel without its decoder side, as Qwen3TTSTokenizerV2Encoder keeps it."""
    nf, hs = e["num_filters"], e["hidden_size"]
    # Module indices in encoder.encoder.layers: conv, then per stride [resnet block, ELU, strided
    # conv], then ELU and the last conv. Every MimiConv1d keeps its nn.Conv1d as ".conv".
    p = "encoder.encoder.layers"
    s.conv(f"{p}.0.conv", nf, 1, 7)
    index, scaling = 1, 1
    for ratio in (4, 5, 6, 8):  # reversed(upsampling_ratios)
        dim = scaling * nf
        s.conv(f"{p}.{index}.block.1.conv", dim // 2, dim, 3)  # compress 2, residual kernel 3
        s.conv(f"{p}.{index}.block.3.conv", dim, dim // 2, 1)
        s.conv(f"{p}.{index + 2}.conv", dim * 2, dim, ratio * 2)
        index += 3
        scaling *= 2
    s.conv(f"{p}.{index + 1}.conv", hs, scaling * nf, 3)

    heads, kv, hd = e["num_attention_heads"], e["num_key_value_heads"], e["head_dim"]
    for i in range(e["num_hidden_layers"]):
        lp = f"encoder.encoder_transformer.layers.{i}"
        s.linear(f"{lp}.self_attn.q_proj", heads * hd, hs)
        s.linear(f"{lp}.self_attn.k_proj", kv * hd, hs)
        s.linear(f"{lp}.self_attn.v_proj", kv * hd, hs)
        s.linear(f"{lp}.self_attn.o_proj", hs, heads * hd)
        s.linear(f"{lp}.mlp.fc1", e["intermediate_size"], hs)
        s.linear(f"{lp}.mlp.fc2", hs, e["intermediate_size"])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            s.add(f"{lp}.{norm}.weight", (hs,), NORM)
            s.add(f"{lp}.{norm}.bias", (hs,), BIAS)
        s.add(f"{lp}.self_attn_layer_scale.scale", (hs,), LAYER_SCALE)
        s.add(f"{lp}.mlp_layer_scale.scale", (hs,), LAYER_SCALE)
    s.conv("encoder.downsample.conv", hs, hs, 4, bias=False)  # 25 Hz -> 12.5 Hz

    q = "encoder.quantizer"
    vqh = e["vector_quantization_hidden_dimension"]
    for part, n in (("semantic_residual_vector_quantizer", 1), ("acoustic_residual_vector_quantizer", 31)):
        for i in range(n):
            cb = f"{q}.{part}.layers.{i}.codebook"
            s.add(f"{cb}.initialized", (1,), lambda rng, shape: np.ones(shape, np.float32))
            s.codebook(cb, "embed_sum", CODEBOOK_SIZE, e["codebook_dim"], std=1.0)
        if vqh != hs:
            s.conv(f"{q}.{part}.input_proj", vqh, hs, 1, bias=False)
            s.conv(f"{q}.{part}.output_proj", hs, vqh, 1, bias=False)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def tensor_rng(seed: int, key: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(key.encode())])


def to_bf16_bytes(a: np.ndarray) -> bytes:
    """float32 -> bfloat16 with round-to-nearest-even (finite values only)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    u = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
    return u.astype("<u2").tobytes()


def write_safetensors(path: Path, specs: Specs, dtype: str, seed: int) -> None:
    """Write the safetensors format directly: u64 LE header size, JSON header, raw data."""
    itemsize = {"BF16": 2, "F32": 4}[dtype]
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _, _ in specs.items:
        if name in header:
            raise ValueError(f"duplicate tensor {name}")
        nbytes = math.prod(shape) * itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, init, seed_key in specs.items:
            values = init(tensor_rng(seed, seed_key or name), shape)
            assert values.shape == shape and values.dtype == np.float32, name
            f.write(to_bf16_bytes(values) if dtype == "BF16" else values.astype("<f4").tobytes())


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_checkpoint(preset: str, kind: str, seed: int, out_dir: Path) -> int:
    """Write the whole repository layout into out_dir; returns its size in bytes."""
    missing = [n for n in TOKENIZER_FILES if not (TOKENIZER_DIR / n).is_file()]
    if missing:
        raise FileNotFoundError(f"tokenizer files missing from {TOKENIZER_DIR}: {missing}")
    dims = resolve_dims(preset, kind)
    st_dir = out_dir / "speech_tokenizer"
    st_dir.mkdir(parents=True, exist_ok=True)

    write_json(out_dir / "config.json", make_config(preset, kind, dims))
    write_json(out_dir / "generation_config.json", GENERATION_CONFIG)
    write_json(out_dir / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    for name in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_DIR / name, out_dir / name)
    write_safetensors(out_dir / "model.safetensors", model_specs(dims), "BF16", seed)

    write_json(st_dir / "config.json", make_speech_tokenizer_config(dims))
    write_json(st_dir / "preprocessor_config.json", SPEECH_PREPROCESSOR_CONFIG)
    write_safetensors(st_dir / "model.safetensors", speech_tokenizer_specs(dims), "F32", seed)
    return sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(TALKER), default="tiny")
    ap.add_argument("--kind", choices=KINDS, default="custom_voice")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("out_dir", type=Path)
    args = ap.parse_args(argv)
    size = make_checkpoint(args.preset, args.kind, args.seed, args.out_dir)
    print(f"{args.out_dir}: {args.preset} {args.kind} seed {args.seed}, {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
