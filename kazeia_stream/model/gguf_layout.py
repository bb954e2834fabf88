"""The GGUF layout of a Qwen3-TTS model pair: tensor names and metadata keys.

The single place that spells them. They are exactly what llama.cpp's converter
(`conversion/qwen3tts.py` in llama-cpp-python 0.3.36) writes and what libllama (`qwen3tts`
talker) and mtmd (`clip.cpp`: `qwen3tts_gen`, `qwen3tts_spkenc`) read; the PyPI `gguf` package
lacks these names. `kazeia.*` keys are our converter's additions: llama.cpp ignores them and
published files lack them, so readers need a fallback.

Tensor names: a name ending in `.weight` is complete. The other names are prefixes, completed
with `.weight` / `.bias` (convolutions, linear layers with bias, LayerNorm) or `.alpha` / `.beta`
(SnakeBeta, already folded: alpha = exp(a), beta = 1 / (exp(b) + 1e-9)). `{bid}` is a block
index, `{xid}` a sub-block index: `CP_ATTN_Q.format(bid=0)`.
"""

from __future__ import annotations

TALKER_ARCH = "qwen3tts"
MMPROJ_ARCH = "clip"
GEN_PROJECTOR_TYPE = "qwen3tts_gen"
SPKENC_PROJECTOR_TYPE = "qwen3tts_spkenc"

# --- general.* (both files) ---
KEY_ARCHITECTURE = "general.architecture"
KEY_TYPE = "general.type"  # "model" (talker) or "mmproj"
KEY_NAME = "general.name"
KEY_FILE_TYPE = "general.file_type"  # llama_ftype: 0 all F32, 1 mostly F16, 7 mostly Q8_0
KEY_QUANTIZATION_VERSION = "general.quantization_version"

# --- talker hyperparameters (libllama, arch qwen3tts) ---
KEY_CONTEXT_LENGTH = f"{TALKER_ARCH}.context_length"
KEY_EMBEDDING_LENGTH = f"{TALKER_ARCH}.embedding_length"
KEY_BLOCK_COUNT = f"{TALKER_ARCH}.block_count"
KEY_FEED_FORWARD_LENGTH = f"{TALKER_ARCH}.feed_forward_length"
KEY_HEAD_COUNT = f"{TALKER_ARCH}.attention.head_count"
KEY_HEAD_COUNT_KV = f"{TALKER_ARCH}.attention.head_count_kv"
KEY_KEY_LENGTH = f"{TALKER_ARCH}.attention.key_length"
KEY_VALUE_LENGTH = f"{TALKER_ARCH}.attention.value_length"
KEY_RMS_EPS = f"{TALKER_ARCH}.attention.layer_norm_rms_epsilon"
KEY_ROPE_FREQ_BASE = f"{TALKER_ARCH}.rope.freq_base"
KEY_ROPE_SECTIONS = f"{TALKER_ARCH}.rope.dimension_sections"  # mrope_section padded to 4

# --- talker tokenizer ---
KEY_TOKENIZER_MODEL = "tokenizer.ggml.model"  # "gpt2"
KEY_TOKENIZER_PRE = "tokenizer.ggml.pre"  # "qwen2"
KEY_TOKENS = "tokenizer.ggml.tokens"  # [text vocab (padded with [PADn]) | codec tokens]
KEY_TOKEN_TYPES = "tokenizer.ggml.token_type"
KEY_MERGES = "tokenizer.ggml.merges"
KEY_EOS_TOKEN_ID = "tokenizer.ggml.eos_token_id"  # text vocab + codec_eos_token_id
KEY_ADD_BOS = "tokenizer.ggml.add_bos_token"
KEY_ADD_EOS = "tokenizer.ggml.add_eos_token"
KEY_SUPPRESS_TOKENS = "tokenizer.ggml.suppress_tokens"  # the last 1024 ids except the codec EOS
KEY_CHAT_TEMPLATE = "tokenizer.chat_template"  # never written: chat stays disabled
TOKENIZER_MODEL = "gpt2"
TOKENIZER_PRE = "qwen2"

# Codec token names: "<|codec_N|>", except ids named by a talker_config `*_id` key:
# "<|codec_bos|>", "<|codec_eos_token|>", "<|codec_language_english|>", "<|spk_ryan|>", ...
CODEC_TOKEN = "<|codec_{id}|>"
SPEAKER_TOKEN_PREFIX = "spk_"
LANGUAGE_TOKEN_PREFIX = "codec_language_"

# --- mmproj: clip.* keys ---
KEY_HAS_AUDIO_ENCODER = "clip.has_audio_encoder"  # speaker encoder present (Base models only)
KEY_HAS_GEN_AUDIO_ENCODER = "clip.has_gen_audio_encoder"
KEY_AUDIO_PROJECTOR_TYPE = "clip.audio.projector_type"
KEY_AUDIO_PROJECTION_DIM = "clip.audio.projection_dim"
KEY_AUDIO_NUM_MEL_BINS = "clip.audio.num_mel_bins"
KEY_AUDIO_BLOCK_COUNT = "clip.audio.block_count"
KEY_AUDIO_EMBEDDING_LENGTH = "clip.audio.embedding_length"
KEY_AUDIO_FEED_FORWARD_LENGTH = "clip.audio.feed_forward_length"
KEY_AUDIO_HEAD_COUNT = "clip.audio.attention.head_count"
KEY_AUDIO_LAYERNORM_EPS = "clip.audio.attention.layer_norm_epsilon"
KEY_GEN_PROJECTOR_TYPE = "clip.gen.audio.projector_type"
KEY_GEN_PROJECTION_DIM = "clip.gen.audio.projection_dim"  # talker hidden size
KEY_GEN_EMBEDDING_LENGTH = "clip.gen.audio.embedding_length"  # code predictor hidden size
KEY_GEN_FEED_FORWARD_LENGTH = "clip.gen.audio.feed_forward_length"
KEY_GEN_BLOCK_COUNT = "clip.gen.audio.block_count"
KEY_GEN_HEAD_COUNT = "clip.gen.audio.attention.head_count"
KEY_GEN_HEAD_COUNT_KV = "clip.gen.audio.attention.head_count_kv"
KEY_GEN_LAYERNORM_EPS = "clip.gen.audio.attention.layer_norm_epsilon"

# --- kazeia.* (our converter only) ---
KEY_TTS_MODEL_TYPE = "kazeia.tts_model_type"  # custom_voice | base | voice_design
KEY_TTS_MODEL_SIZE = "kazeia.tts_model_size"  # 0b6 | 1b7
KEY_CHECKPOINT_ID = "kazeia.checkpoint_id"  # in both files: which checkpoint they come from
KEY_DIALECT_SPEAKERS = "kazeia.dialect_speakers"  # parallel string arrays from spk_is_dialect
KEY_DIALECT_LANGUAGES = "kazeia.dialect_languages"
KEY_GENERATION_PREFIX = "kazeia.generation."  # + a GENERATION_KEYS key
GENERATION_KEYS: dict[str, type] = {  # generation_config.json (subtalker_dosample renamed); type
    "do_sample": bool,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "repetition_penalty": float,
    "max_new_tokens": int,
    "subtalker_do_sample": bool,
    "subtalker_temperature": float,
    "subtalker_top_k": int,
    "subtalker_top_p": float,
}
KEY_CODEC_PREFIX = "kazeia.codec."  # + a CODEC_KEYS key
CODEC_KEYS: dict[str, type] = {  # speech_tokenizer/config.json decoder_config; type
    "codebook_size": int,
    "codebook_dim": int,
    "latent_dim": int,
    "hidden_size": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "head_dim": int,
    "intermediate_size": int,
    "num_hidden_layers": int,
    "rms_norm_eps": float,
    "rope_theta": float,
    "sliding_window": int,
    "decoder_dim": int,
}
KEY_CODEC_SAMPLE_RATE = KEY_CODEC_PREFIX + "sample_rate"
KEY_CODEC_SAMPLES_PER_FRAME = KEY_CODEC_PREFIX + "samples_per_frame"
KEY_CODEC_UPSAMPLING_RATIOS = KEY_CODEC_PREFIX + "upsampling_ratios"  # int array
KEY_CODEC_UPSAMPLE_RATES = KEY_CODEC_PREFIX + "upsample_rates"  # int array
KEY_CP_HEAD_DIM = "kazeia.code_predictor.head_dim"
KEY_CP_ROPE_THETA = "kazeia.code_predictor.rope_theta"
KEY_CP_VOCAB_SIZE = "kazeia.code_predictor.vocab_size"
KEY_CP_NUM_CODE_GROUPS = "kazeia.code_predictor.num_code_groups"

# --- talker tensors ---
TALKER_TOKEN_EMBD = "token_embd.weight"  # [text vocab | codec vocab] rows, text rows = T(id)
TALKER_OUTPUT_NORM = "output_norm.weight"
TALKER_OUTPUT = "output.weight"  # codec_head, 3072 rows
TALKER_ATTN_NORM = "blk.{bid}.attn_norm.weight"
TALKER_ATTN_Q = "blk.{bid}.attn_q.weight"
TALKER_ATTN_K = "blk.{bid}.attn_k.weight"
TALKER_ATTN_V = "blk.{bid}.attn_v.weight"
TALKER_ATTN_OUT = "blk.{bid}.attn_output.weight"
TALKER_ATTN_Q_NORM = "blk.{bid}.attn_q_norm.weight"
TALKER_ATTN_K_NORM = "blk.{bid}.attn_k_norm.weight"
TALKER_FFN_NORM = "blk.{bid}.ffn_norm.weight"
TALKER_FFN_GATE = "blk.{bid}.ffn_gate.weight"
TALKER_FFN_UP = "blk.{bid}.ffn_up.weight"
TALKER_FFN_DOWN = "blk.{bid}.ffn_down.weight"
# a talker layer's tensors by role (the roles of model.config.layer_shapes)
TALKER_LAYER = {
    "attn_norm": TALKER_ATTN_NORM,
    "q": TALKER_ATTN_Q,
    "k": TALKER_ATTN_K,
    "v": TALKER_ATTN_V,
    "o": TALKER_ATTN_OUT,
    "q_norm": TALKER_ATTN_Q_NORM,
    "k_norm": TALKER_ATTN_K_NORM,
    "ffn_norm": TALKER_FFN_NORM,
    "gate": TALKER_FFN_GATE,
    "up": TALKER_FFN_UP,
    "down": TALKER_FFN_DOWN,
}

# --- mmproj: code predictor ---
CP_PROJ_IN = "a.gen.code.proj_in"  # small_to_mtp_projection, 1.7B only
CP_EMBD = "a.gen.code.embd.weight"  # 3D [15, 2048, talker hidden]: input table of codebooks 1..15
CP_HEAD = "a.gen.code.head.weight"  # 3D [15, 2048, hidden]: lm_head of codebooks 1..15
CP_OUT_EMBD = "a.gen.code.out_embd.weight"  # the talker's codec_embedding
CP_OUTPUT_NORM = "a.gen.code.output_norm.weight"
CP_ATTN_NORM = "a.gen.code.blk.{bid}.ln1.weight"
CP_ATTN_Q = "a.gen.code.blk.{bid}.attn_q.weight"
CP_ATTN_Q_NORM = "a.gen.code.blk.{bid}.attn_q_norm.weight"
CP_ATTN_K = "a.gen.code.blk.{bid}.attn_k.weight"
CP_ATTN_K_NORM = "a.gen.code.blk.{bid}.attn_k_norm.weight"
CP_ATTN_V = "a.gen.code.blk.{bid}.attn_v.weight"
CP_ATTN_OUT = "a.gen.code.blk.{bid}.attn_out.weight"
CP_FFN_NORM = "a.gen.code.blk.{bid}.ln2.weight"
CP_FFN_GATE = "a.gen.code.blk.{bid}.ffn_gate.weight"
CP_FFN_UP = "a.gen.code.blk.{bid}.ffn_up.weight"
CP_FFN_DOWN = "a.gen.code.blk.{bid}.ffn_down.weight"
CP_LAYER = {
    "attn_norm": CP_ATTN_NORM,
    "q": CP_ATTN_Q,
    "k": CP_ATTN_K,
    "v": CP_ATTN_V,
    "o": CP_ATTN_OUT,
    "q_norm": CP_ATTN_Q_NORM,
    "k_norm": CP_ATTN_K_NORM,
    "ffn_norm": CP_FFN_NORM,
    "gate": CP_FFN_GATE,
    "up": CP_FFN_UP,
    "down": CP_FFN_DOWN,
}


def layer_tensors(layer: dict[str, str], n_layers: int) -> dict[tuple[int, str], str]:
    """Every layer tensor of a stack by (layer, role), from its pattern per role (`TALKER_LAYER`,
    `CP_LAYER`)."""
    return {
        (bid, role): pattern.format(bid=bid) for bid in range(n_layers) for role, pattern in layer.items()
    }


# --- mmproj: codec decoder ("code2wav") ---
WAV_QUANT_FIRST_IN = "a.gen.wav.quant.first.in_proj.weight"  # 1x1 conv kernels stored 2D
WAV_QUANT_FIRST_OUT = "a.gen.wav.quant.first.out_proj.weight"
WAV_QUANT_FIRST_CB = "a.gen.wav.quant.first.codebook.weight"  # [2048, 256], usage-normalised
WAV_QUANT_REST_IN = "a.gen.wav.quant.rest.in_proj.weight"
WAV_QUANT_REST_OUT = "a.gen.wav.quant.rest.out_proj.weight"
WAV_QUANT_REST_CB = "a.gen.wav.quant.rest.codebook.weight"  # [15, 2048, 256]
WAV_PRE_CONV = "a.gen.wav.pre_conv"
WAV_TFM_IN_PROJ = "a.gen.wav.tfm.in_proj"
WAV_TFM_OUT_PROJ = "a.gen.wav.tfm.out_proj"
WAV_TFM_OUTPUT_NORM = "a.gen.wav.tfm.output_norm.weight"
WAV_TFM_ATTN_NORM = "a.gen.wav.tfm.blk.{bid}.ln1.weight"
WAV_TFM_ATTN_Q = "a.gen.wav.tfm.blk.{bid}.attn_q.weight"
WAV_TFM_ATTN_K = "a.gen.wav.tfm.blk.{bid}.attn_k.weight"
WAV_TFM_ATTN_V = "a.gen.wav.tfm.blk.{bid}.attn_v.weight"
WAV_TFM_ATTN_OUT = "a.gen.wav.tfm.blk.{bid}.attn_out.weight"
WAV_TFM_ATTN_SCALE = "a.gen.wav.tfm.blk.{bid}.ls1.weight"
WAV_TFM_FFN_NORM = "a.gen.wav.tfm.blk.{bid}.ln2.weight"
WAV_TFM_FFN_GATE = "a.gen.wav.tfm.blk.{bid}.ffn_gate.weight"
WAV_TFM_FFN_UP = "a.gen.wav.tfm.blk.{bid}.ffn_up.weight"
WAV_TFM_FFN_DOWN = "a.gen.wav.tfm.blk.{bid}.ffn_down.weight"
WAV_TFM_FFN_SCALE = "a.gen.wav.tfm.blk.{bid}.ls2.weight"
WAV_UP_CONV = "a.gen.wav.up.blk.{bid}.conv"  # ConvTranspose1d [in, out, k]
WAV_UP_DWCONV = "a.gen.wav.up.blk.{bid}.dwconv"
WAV_UP_NORM = "a.gen.wav.up.blk.{bid}.norm"
WAV_UP_PW1 = "a.gen.wav.up.blk.{bid}.pw1"
WAV_UP_PW2 = "a.gen.wav.up.blk.{bid}.pw2"
WAV_UP_GAMMA = "a.gen.wav.up.blk.{bid}.gamma"  # complete name, no suffix
WAV_DAC_ENTRY = "a.gen.wav.dac.entry"
WAV_DAC_UP_SNAKE = "a.gen.wav.dac.blk.{bid}.snake"
WAV_DAC_UP_CONV = "a.gen.wav.dac.blk.{bid}.conv"  # ConvTranspose1d [in, out, 2 * rate]
WAV_DAC_RES_ACT1 = "a.gen.wav.dac.blk.{bid}.res.{xid}.act1"
WAV_DAC_RES_CONV1 = "a.gen.wav.dac.blk.{bid}.res.{xid}.conv1"
WAV_DAC_RES_ACT2 = "a.gen.wav.dac.blk.{bid}.res.{xid}.act2"
WAV_DAC_RES_CONV2 = "a.gen.wav.dac.blk.{bid}.res.{xid}.conv2"
WAV_DAC_POST_SNAKE = "a.gen.wav.dac.post_snake"
WAV_DAC_POST_CONV = "a.gen.wav.dac.post_conv"
WAV_PREFIX = "a.gen.wav."

# --- mmproj: speaker encoder (ECAPA-TDNN, Base models only); kernels keep their [out, in, k] ---
SPK_STEM = "a.conv1d.0"  # blocks.0
SPK_TDNN1 = "a.blk.{bid}.conv_pw1"  # bid 1..3
SPK_RES2 = "a.blk.{bid}.res2.{xid}"  # xid 0..6
SPK_TDNN2 = "a.blk.{bid}.conv_pw2"
SPK_SE_CONV1 = "a.blk.{bid}.se_conv1"
SPK_SE_CONV2 = "a.blk.{bid}.se_conv2"
SPK_MFA = "a.conv_out"
SPK_ASP_TDNN = "a.asp_tdnn"
SPK_ASP_CONV = "a.asp_attn"
SPK_FC = "mm.a.fc"

# --- mmproj: codec encoder (ours; llama.cpp has none) ---
# The Mimi encoder of speech_tokenizer/model.safetensors (`encoder.*`), which turns a reference
# recording into codes for in-context cloning (Base models only). Always F32. Kernels keep their
# [out, in, k]; 1x1 projections are matrices; the codebooks are already divided by their cluster
# usage. Only the codebooks the official encode keeps (`valid_num_quantizers`) are written.
ENC_PREFIX = "kazeia.enc."
ENC_CONV_IN = "kazeia.enc.conv_in"  # encoder.encoder.layers.0
ENC_RES_CONV1 = "kazeia.enc.blk.{bid}.res.{xid}.conv1"  # residual kernel, dim -> dim / compress
ENC_RES_CONV2 = "kazeia.enc.blk.{bid}.res.{xid}.conv2"  # k=1, back to dim
ENC_DOWN_CONV = "kazeia.enc.blk.{bid}.down"  # k = 2 * ratio, stride ratio, dim -> 2 * dim
ENC_CONV_OUT = "kazeia.enc.conv_out"  # -> the transformer's width
ENC_TFM_ATTN_NORM = "kazeia.enc.tfm.blk.{bid}.ln1"  # LayerNorm
ENC_TFM_ATTN_Q = "kazeia.enc.tfm.blk.{bid}.attn_q"  # .weight, and .bias if attention_bias
ENC_TFM_ATTN_K = "kazeia.enc.tfm.blk.{bid}.attn_k"
ENC_TFM_ATTN_V = "kazeia.enc.tfm.blk.{bid}.attn_v"
ENC_TFM_ATTN_OUT = "kazeia.enc.tfm.blk.{bid}.attn_out"
ENC_TFM_ATTN_SCALE = "kazeia.enc.tfm.blk.{bid}.ls1.weight"
ENC_TFM_FFN_NORM = "kazeia.enc.tfm.blk.{bid}.ln2"  # LayerNorm
ENC_TFM_FFN_UP = "kazeia.enc.tfm.blk.{bid}.ffn_up.weight"  # mlp.fc1, no bias
ENC_TFM_FFN_DOWN = "kazeia.enc.tfm.blk.{bid}.ffn_down.weight"  # mlp.fc2, no bias
ENC_TFM_FFN_SCALE = "kazeia.enc.tfm.blk.{bid}.ls2.weight"
ENC_DOWNSAMPLE = "kazeia.enc.downsample.weight"  # Conv1d [hidden, hidden, k], no bias
ENC_QUANT_SEMANTIC_IN = "kazeia.enc.quant.semantic.in_proj.weight"  # absent when no projection
ENC_QUANT_SEMANTIC_CB = "kazeia.enc.quant.semantic.codebook.weight"  # [n, size, dim]
ENC_QUANT_ACOUSTIC_IN = "kazeia.enc.quant.acoustic.in_proj.weight"
ENC_QUANT_ACOUSTIC_CB = "kazeia.enc.quant.acoustic.codebook.weight"  # [valid - semantic, size, dim]
KEY_ENC_PREFIX = "kazeia.codec_encoder."  # + a CODEC_ENCODER_KEYS key
CODEC_ENCODER_KEYS: dict[str, type] = {  # speech_tokenizer/config.json encoder_config; type
    "sampling_rate": int,
    "kernel_size": int,
    "last_kernel_size": int,
    "residual_kernel_size": int,
    "dilation_growth_rate": int,
    "compress": int,
    "num_residual_layers": int,
    "pad_mode": str,
    "hidden_act": str,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "head_dim": int,
    "norm_eps": float,
    "rope_theta": float,
    "num_semantic_quantizers": int,
}
KEY_ENC_UPSAMPLING_RATIOS = KEY_ENC_PREFIX + "upsampling_ratios"  # int array; applied reversed
KEY_ENC_VALID_QUANTIZERS = KEY_ENC_PREFIX + "valid_num_quantizers"  # encoder_valid_num_quantizers
KEY_ENC_FRAME_SIZE = KEY_ENC_PREFIX + "frame_size"  # encode_downsample_rate: samples per code frame
KEY_ENC_DOWNSAMPLE_STRIDE = KEY_ENC_PREFIX + "downsample_stride"  # fixed by transformers' MimiModel
KEY_ENC_DOWNSAMPLE_PAD_MODE = KEY_ENC_PREFIX + "downsample_pad_mode"  # likewise
