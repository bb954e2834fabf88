"""What a Qwen3-TTS GGUF pair says about its model, read from the files alone.

Dimensions come from llama.cpp's own metadata keys and from tensor shapes; names and ids of
speakers, languages and control tokens come from the codec token names llama.cpp's converter
writes (`<|spk_ryan|>`, `<|codec_language_english|>`, `<|codec_bos|>`). Our converter adds a few
`kazeia.*` keys that published files lack; each has a documented fallback.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import ModelFileError
from . import gguf_layout as L
from .gguf_file import GGUFFile
from .prompt import CodecIds, TextIds

KINDS = ("custom_voice", "base", "voice_design")

# Published GGUFs lose the official `spk_is_dialect` table (it is not an `*_id` key, so llama.cpp's
# converter drops it); these are the official CustomVoice speakers that speak a dialect.
OFFICIAL_DIALECT_SPEAKERS = {"eric": "sichuan_dialect", "dylan": "beijing_dialect"}

# generation_config.json of every published Qwen3-TTS checkpoint (see the model notes).
OFFICIAL_GENERATION = {
    "do_sample": True,
    "temperature": 0.9,
    "top_k": 50,
    "top_p": 1.0,
    "repetition_penalty": 1.05,
    "max_new_tokens": 8192,
    "subtalker_do_sample": True,
    "subtalker_temperature": 0.9,
    "subtalker_top_k": 50,
    "subtalker_top_p": 1.0,
}

_CODEC_NAME = re.compile(r"<\|(.+)\|>")


@dataclass(frozen=True)
class LMConfig:
    """The shape of a Qwen3 decoder stack (the talker and the code predictor are both one)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float


def layer_shapes(cfg: LMConfig) -> dict[str, tuple[int, ...]]:
    """The shape (numpy order: [out, in]) of each weight of a layer, by role."""
    h, i, q, kv = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
    )
    return {
        "attn_norm": (h,),
        "q": (q, h),
        "k": (kv, h),
        "v": (kv, h),
        "o": (h, q),
        "q_norm": (cfg.head_dim,),
        "k_norm": (cfg.head_dim,),
        "ffn_norm": (h,),
        "gate": (i, h),
        "up": (i, h),
        "down": (h, i),
    }


@dataclass(frozen=True)
class TalkerConfig(LMConfig):
    text_vocab_size: int
    codec_vocab_size: int


@dataclass(frozen=True)
class CodePredictorConfig(LMConfig):
    vocab_size: int
    num_code_groups: int
    has_projection: bool


@dataclass(frozen=True)
class Sampling:
    """One sampler's settings (Hugging Face's warpers: temperature, top-k, top-p)."""

    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0


@dataclass(frozen=True)
class GenerationConfig:
    """The model's sampling defaults (its generation_config.json): codebook 0 from the talker,
    codebooks 1.. from the code predictor ("subtalker")."""

    talker: Sampling
    code_predictor: Sampling
    repetition_penalty: float
    max_new_tokens: int


@dataclass(frozen=True)
class CodecConfig:
    sample_rate: int
    samples_per_frame: int
    num_quantizers: int
    codebook_size: int


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runtime needs to know about a model, read from its two files."""

    kind: str
    size: str
    talker: TalkerConfig
    code_predictor: CodePredictorConfig
    codec: CodecConfig
    text_ids: TextIds
    codec_ids: CodecIds
    speakers: dict[str, int]
    languages: dict[str, int]
    dialects: dict[str, str]
    generation: GenerationConfig
    has_speaker_encoder: bool
    suppress_codes: np.ndarray = field(repr=False)
    codec_tokens: dict[str, int] = field(repr=False, default_factory=dict)

    @property
    def sample_rate(self) -> int:
        return self.codec.sample_rate


def read_config(
    talker: GGUFFile,
    mmproj: GGUFFile,
    codec_token_names: list[str],
    text_token_id: Callable[[str], int],
) -> ModelConfig:
    """Build the config; `codec_token_names` lists the codec rows' token texts in order and
    `text_token_id(text)` maps a special token's text to its id."""
    tokens = {}
    for i, name in enumerate(codec_token_names):
        m = _CODEC_NAME.fullmatch(name)
        if m:
            tokens[m.group(1)] = i

    def codec_id(name: str) -> int:
        if name not in tokens:
            raise ModelFileError(f"{talker.path}: codec token <|{name}|> is missing")
        return tokens[name]

    prefix = L.SPEAKER_TOKEN_PREFIX
    speakers = {k[len(prefix) :]: v for k, v in tokens.items() if k.startswith(prefix)}
    prefix = L.LANGUAGE_TOKEN_PREFIX
    languages = {k[len(prefix) :]: v for k, v in tokens.items() if k.startswith(prefix)}
    dialects = _dialects(talker, speakers)
    has_spkenc = bool(mmproj.get(L.KEY_HAS_AUDIO_ENCODER, False))
    kind = talker.get(L.KEY_TTS_MODEL_TYPE) or (
        "base" if has_spkenc else "custom_voice" if speakers else "voice_design"
    )
    if kind not in KINDS:
        raise ModelFileError(f"{talker.path}: unknown model type {kind!r}")

    tcfg = _talker_config(talker, len(codec_token_names))
    cp_cfg = _code_predictor_config(mmproj)
    _check_tensors(
        talker,
        "talker",
        tcfg,
        L.TALKER_LAYER,
        {
            L.TALKER_OUTPUT_NORM: (tcfg.hidden_size,),
            L.TALKER_OUTPUT: (tcfg.codec_vocab_size, tcfg.hidden_size),
        },
    )
    _check_tensors(
        mmproj,
        "code predictor",
        cp_cfg,
        L.CP_LAYER,
        {
            L.CP_OUTPUT_NORM: (cp_cfg.hidden_size,),
            L.CP_HEAD: (cp_cfg.num_code_groups - 1, cp_cfg.vocab_size, cp_cfg.hidden_size),
        },
    )
    size = talker.get(L.KEY_TTS_MODEL_SIZE) or ("0b6" if tcfg.hidden_size <= 1024 else "1b7")
    generation = _generation_config(talker)
    codec_ids = CodecIds(
        pad=codec_id("codec_pad"),
        bos=codec_id("codec_bos"),
        eos=codec_id("codec_eos_token"),
        think=codec_id("codec_think"),
        nothink=codec_id("codec_nothink"),
        think_bos=codec_id("codec_think_bos"),
        think_eos=codec_id("codec_think_eos"),
    )
    return ModelConfig(
        kind=kind,
        size=size,
        talker=tcfg,
        code_predictor=cp_cfg,
        codec=_codec_config(mmproj),
        text_ids=TextIds(
            im_start=text_token_id("<|im_start|>"),
            im_end=text_token_id("<|im_end|>"),
            tts_pad=text_token_id("<tts_pad>"),
            tts_bos=text_token_id("<tts_text_bos>"),
            tts_eos=text_token_id("<tts_text_eod>"),
        ),
        codec_ids=codec_ids,
        speakers=speakers,
        languages=languages,
        dialects=dialects,
        generation=generation,
        has_speaker_encoder=has_spkenc,
        suppress_codes=_suppressed(talker, tcfg, codec_ids.eos),
        codec_tokens=tokens,
    )


def _check_tensors(
    f: GGUFFile, what: str, cfg: LMConfig, layer: dict[str, str], others: dict[str, tuple[int, ...]]
) -> None:
    """Every weight of a Qwen3 stack is in the file with the shape its config gives (the
    engines build their graphs from these shapes)."""
    shapes = layer_shapes(cfg)
    expected = {name: shapes[role] for (_, role), name in L.layer_tensors(layer, cfg.num_layers).items()}
    for name, shape in {**expected, **others}.items():
        if not f.has_tensor(name):
            raise ModelFileError(f"{f.path}: {what} tensor {name!r} is missing")
        if f.tensor_shape(name) != shape:
            raise ModelFileError(f"{f.path}: {what} tensor {name!r} is {f.tensor_shape(name)}, not {shape}")


def _generation_config(talker: GGUFFile) -> GenerationConfig:
    """The file's `kazeia.generation.*` keys, else the official values."""
    g = {
        k: L.GENERATION_KEYS[k](talker.get(L.KEY_GENERATION_PREFIX + k, v))
        for k, v in OFFICIAL_GENERATION.items()
    }
    return GenerationConfig(
        talker=Sampling(g["do_sample"], g["temperature"], g["top_k"], g["top_p"]),
        code_predictor=Sampling(
            g["subtalker_do_sample"], g["subtalker_temperature"], g["subtalker_top_k"], g["subtalker_top_p"]
        ),
        repetition_penalty=g["repetition_penalty"],
        max_new_tokens=g["max_new_tokens"],
    )


def _suppressed(talker: GGUFFile, tcfg: TalkerConfig, eos: int) -> np.ndarray:
    """Codec ids codebook 0 may never take: the file's suppress list (global token ids), else
    the official rule, the last 1024 codec ids but EOS."""
    ids = talker.get(L.KEY_SUPPRESS_TOKENS)
    if ids is None:
        ids = [i for i in range(tcfg.codec_vocab_size - 1024, tcfg.codec_vocab_size) if i != eos]
    else:
        ids = np.asarray(ids, dtype=np.int64) - tcfg.text_vocab_size
    return np.asarray(ids, dtype=np.int64)


def _dialects(talker: GGUFFile, speakers: dict[str, int]) -> dict[str, str]:
    """Our converter writes the table (and omits it when empty); published files need the
    official one."""
    names = talker.get(L.KEY_DIALECT_SPEAKERS)
    if names is None:
        if L.KEY_TTS_MODEL_TYPE in talker:
            return {}
        return {s: d for s, d in OFFICIAL_DIALECT_SPEAKERS.items() if s in speakers}
    return dict(zip(names, talker.require(L.KEY_DIALECT_LANGUAGES)))


def _talker_config(f: GGUFFile, codec_vocab: int) -> TalkerConfig:
    hidden = f.require(L.KEY_EMBEDDING_LENGTH)
    heads = f.require(L.KEY_HEAD_COUNT)
    return TalkerConfig(
        hidden_size=hidden,
        num_layers=f.require(L.KEY_BLOCK_COUNT),
        num_heads=heads,
        num_kv_heads=f.require(L.KEY_HEAD_COUNT_KV),
        head_dim=f.get(L.KEY_KEY_LENGTH, hidden // heads),
        intermediate_size=f.require(L.KEY_FEED_FORWARD_LENGTH),
        rms_norm_eps=f.require(L.KEY_RMS_EPS),
        rope_theta=f.require(L.KEY_ROPE_FREQ_BASE),
        text_vocab_size=f.tensor_shape(L.TALKER_TOKEN_EMBD)[0] - codec_vocab,
        codec_vocab_size=codec_vocab,
    )


def _code_predictor_config(f: GGUFFile) -> CodePredictorConfig:
    heads = f.require(L.KEY_GEN_HEAD_COUNT)
    q_rows = f.tensor_shape(L.CP_ATTN_Q.format(bid=0))[0]
    n_groups, vocab, _ = f.tensor_shape(L.CP_HEAD)
    return CodePredictorConfig(
        hidden_size=f.require(L.KEY_GEN_EMBEDDING_LENGTH),
        num_layers=f.require(L.KEY_GEN_BLOCK_COUNT),
        num_heads=heads,
        num_kv_heads=f.require(L.KEY_GEN_HEAD_COUNT_KV),
        head_dim=q_rows // heads,
        intermediate_size=f.require(L.KEY_GEN_FEED_FORWARD_LENGTH),
        rms_norm_eps=f.require(L.KEY_GEN_LAYERNORM_EPS),
        rope_theta=f.get(L.KEY_CP_ROPE_THETA, 1_000_000.0),
        vocab_size=vocab,
        num_code_groups=n_groups + 1,
        has_projection=f.has_tensor(L.CP_PROJ_IN + ".weight"),
    )


def _codec_config(f: GGUFFile) -> CodecConfig:
    """Samples per frame is the product of the transposed convolutions' strides, read from their
    kernels: the upsample stages have kernel == stride, the decoder blocks kernel == 2 * stride."""
    samples = 1
    for bid in range(_count(f, L.WAV_UP_CONV)):
        samples *= f.tensor_shape(L.WAV_UP_CONV.format(bid=bid) + ".weight")[-1]
    for bid in range(_count(f, L.WAV_DAC_UP_CONV)):
        samples *= f.tensor_shape(L.WAV_DAC_UP_CONV.format(bid=bid) + ".weight")[-1] // 2
    n_rest, codebook_size, _ = f.tensor_shape(L.WAV_QUANT_REST_CB)
    return CodecConfig(
        sample_rate=f.get(L.KEY_CODEC_SAMPLE_RATE, 24000),
        samples_per_frame=samples,
        num_quantizers=n_rest + 1,
        codebook_size=codebook_size,
    )


def _count(f: GGUFFile, pattern: str) -> int:
    """How many numbered blocks of a tensor pattern the file holds."""
    n = 0
    while f.has_tensor(pattern.format(bid=n) + ".weight"):
        n += 1
    return n
