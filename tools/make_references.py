#!/usr/bin/env python3
"""Compute the committed reference values (tests/data/refs/*.npz) with the official implementation.

Why: the test suite must check our prompt building, converter, talker, code predictor, codec
decoder and tokenizer against the official `qwen-tts` package without depending on it (it needs
torch and ~2 GB). This script is run by hand, once, with the oracle environment; its small .npz
outputs are committed and the tests only need numpy.

It builds the tiny random checkpoints with tools/make_random_checkpoint.py (fixed seeds below),
loads each one the official way (Qwen3TTSModel.from_pretrained, float32, CPU, the default sdpa
attention) and checks that every tensor of both safetensors files lands in the official modules
unchanged: this also proves the checkpoint layout. Values are taken from the official code paths,
instrumented rather than re-implemented:

  prompts_<kind>.npz  talker prefill embeddings and trailing text, captured at the call of
                      talker.generate inside the official Qwen3TTSForConditionalGeneration.generate;
  talker_<kind>.npz   the official decode loop, teacher-forced: talker.generate and
                      code_predictor.generate run with a logits processor that forces a fixed
                      code sequence, and record the raw logits (output_logits) and hidden states;
  convert_<kind>.npz  embedding rows and head outputs of the official modules;
  codec_<kind>.npz    the official decoder's waveform for 80 frames in one forward call;
  tokenizer.npz       the official processor's ids, and plain Qwen2 BPE ids for comparison.

Every file stores checkpoint_json (preset, kind, seed) and weights_sha256 (sha256 of the
checkpoint's model.safetensors), so a test can rebuild the same checkpoint and notice numpy RNG
drift instead of reporting a bogus mismatch.

Usage (the oracle venv is never a runtime or CI dependency):
    /root/oracle/bin/python tools/make_references.py [--out tests/data/refs]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.machinery
import json
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np


def _stub_modules() -> None:
    """qwen_tts imports torchaudio and sox for its 25 Hz tokenizer only; the CPU venv has a CUDA
    torchaudio that fails to import and no sox binary, so stand-ins are put in their place."""
    for name in ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi", "sox"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules[name] = module
    sys.modules["torchaudio"].compliance = sys.modules["torchaudio.compliance"]
    sys.modules["torchaudio.compliance"].kaldi = sys.modules["torchaudio.compliance.kaldi"]


_stub_modules()

import torch  # noqa: E402
from qwen_tts import Qwen3TTSModel  # noqa: E402
from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_random_checkpoint as mrc  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PRESET = "tiny"
SEEDS = {"custom_voice": 1, "voice_design": 2, "base": 3}
CODEC_EOS = 2150

PROMPT_CASES = {
    "custom_voice": [
        dict(
            name="ryan_english_streaming",
            text="Hello, world. This is a test.",
            voice="ryan",
            language="english",
            instruct=None,
            non_streaming=False,
        ),
        dict(
            name="ryan_english_non_streaming",
            text="Hello, world. This is a test.",
            voice="ryan",
            language="english",
            instruct=None,
            non_streaming=True,
        ),
        dict(
            name="vivian_auto_cjk",
            text="你好，世界！今天天气很好。",
            voice="vivian",
            language="auto",
            instruct=None,
            non_streaming=False,
        ),
        dict(
            name="eric_chinese_dialect",
            text="我叫通义千问，是阿里云的开源大模型。",
            voice="eric",
            language="chinese",
            instruct=None,
            non_streaming=True,
        ),
        dict(
            name="dylan_auto_dialect",
            text="Good morning, Beijing!",
            voice="dylan",
            language="auto",
            instruct=None,
            non_streaming=False,
        ),
        dict(
            name="aiden_long_text",
            text="On 2024-03-15 at 3:45 p.m., Dr. Müller paid $1,234.56 for a café crème; "
            "naïve? Perhaps — but 99.9% of résumés say so!",
            voice="aiden",
            language="english",
            instruct=None,
            non_streaming=True,
        ),
    ],
    "voice_design": [
        dict(
            name="instruct_english_streaming",
            text="The quick brown fox jumps over the lazy dog.",
            voice=None,
            language="english",
            instruct="A calm, deep male voice, speaking slowly.",
            non_streaming=False,
        ),
        dict(
            name="instruct_english_non_streaming",
            text="The quick brown fox jumps over the lazy dog.",
            voice=None,
            language="english",
            instruct="A calm, deep male voice, speaking slowly.",
            non_streaming=True,
        ),
        dict(
            name="instruct_chinese_cjk",
            text="欢迎收听今天的新闻。",
            voice=None,
            language="chinese",
            instruct="用温柔的女声，语速稍慢。",
            non_streaming=False,
        ),
        dict(
            name="no_instruct_auto",
            text="No instruction at all.",
            voice=None,
            language="auto",
            instruct=None,
            non_streaming=True,
        ),
    ],
}
# Base models clone the voice of a recording (espeak-ng speech, 22.05 kHz: the encoders' input is
# resampled to 24 kHz). "ref_text" None is the x-vector-only mode, a reference text ICL.
REF_AUDIO = ROOT / "tests" / "data" / "voice" / "north_wind.wav"
REF_TEXT = "The north wind and the sun were disputing which was the stronger."
PROMPT_CASES["base"] = [
    dict(
        name="xvector_english_streaming",
        text="Hello, world. This is a test.",
        ref_text=None,
        language="english",
        non_streaming=False,
    ),
    dict(
        name="xvector_auto_non_streaming",
        text="Hello, world. This is a test.",
        ref_text=None,
        language="auto",
        non_streaming=True,
    ),
    dict(
        name="icl_english_streaming_short",  # text rows fewer than the reference frames
        text="Hello, world. This is a test.",
        ref_text=REF_TEXT,
        language="english",
        non_streaming=False,
    ),
    dict(
        name="icl_auto_streaming_long",  # more text rows than reference frames: trailing text
        text="On 2024-03-15 at 3:45 p.m., Dr. Müller paid $1,234.56 for a café crème; naïve? "
        "Perhaps, but 99.9% of résumés say so, and the rest of them are written by people who "
        "have never once been asked about it, which is a shame.",
        ref_text=REF_TEXT,
        language="auto",
        non_streaming=False,
    ),
    dict(
        name="icl_english_non_streaming",
        text="Hello, world. This is a test.",
        ref_text=REF_TEXT,
        language="english",
        non_streaming=True,
    ),
]
# Teacher-forced talker references use this case of each kind (streaming: its trailing text is
# shorter than the code sequence, so the PAD branch of the decode loop is exercised too).
TALKER_CASE = {"custom_voice": 0, "voice_design": 0, "base": 2}
TALKER_FRAMES = 12

TOKENIZER_SENTENCES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I bought an iPhone and a MacBook.",
    "It's 3:45 p.m. on 2024-03-15; the total is $1,234.56 (≈ €1.100).",
    "Café, naïve, résumé, façade, jalapeño, Zürich, Ångström.",
    "你好，世界！今天天气很好。",
    "我叫通义千问，是阿里云的开源大模型。",
    "こんにちは、元気ですか？カタカナとひらがな。",
    "안녕하세요, 반갑습니다.",
    "Привет, как дела? Всё хорошо.",
    "Emoji test: 😀🎉👍🏽 and ❤️ done.",
    "Multiple   spaces    here.",
    "Line one\nLine two\n\nLine four",
    "Tabs\tand\ttabs",
    "  leading and trailing  ",
    "Mixed 中文 and English 混合 text 123.",
    "Numbers: 0 1 22 333 4444 55555 3.14159 1e-10",
    "URL https://example.com/path?q=1&x=y#frag",
    "Don't, won't, I'll, you're, they've, she'd.",
    "UPPERCASE WORDS AND CamelCaseWords",
    "Ellipsis… “curly quotes”, ‘single’ — em dash – en dash",
    "العربية نص قصير",
    "हिन्दी पाठ",
    "Ελληνικά κείμενο",
    "<|im_start|>assistant\nHello there.<|im_end|>\n<|im_start|>assistant\n",
    "<tts_pad><tts_text_bos>text<tts_text_eod>",
    "NFC: e\u0301 vs é, ﬁ ligature, ß",
    "Windows\r\nline ending and a/b/c paths",
    "a",
    "",
]

# Qwen2's pre-tokenizer pattern (what llama.cpp's "qwen2" pre-tokenizer implements).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


class Checkpoint:
    def __init__(self, kind: str, root: Path) -> None:
        self.kind, self.seed = kind, SEEDS[kind]
        self.dir = root / kind
        mrc.make_checkpoint(PRESET, kind, self.seed, self.dir)
        self.sha256 = hashlib.sha256((self.dir / "model.safetensors").read_bytes()).hexdigest()
        self.speech_sha256 = hashlib.sha256(
            (self.dir / "speech_tokenizer" / "model.safetensors").read_bytes()
        ).hexdigest()
        self.tts = Qwen3TTSModel.from_pretrained(str(self.dir), dtype=torch.float32)
        check_layout(self)

    def header(self) -> dict:
        """The identification every reference file carries."""
        return {
            "checkpoint_json": np.array(json.dumps({"preset": PRESET, "kind": self.kind, "seed": self.seed})),
            "weights_sha256": np.array(self.sha256),
        }


def check_layout(ck: Checkpoint) -> None:
    """Every stored tensor must be a parameter/buffer of the official modules, none missing,
    with the same shape and (after BF16 -> F32) the same values."""
    pairs = (
        (ck.tts.model, ck.dir / "model.safetensors"),
        (ck.tts.model.speech_tokenizer.model, ck.dir / "speech_tokenizer" / "model.safetensors"),
    )
    for module, path in pairs:
        expected, stored = module.state_dict(), load_file(str(path))
        if set(expected) != set(stored):
            raise SystemExit(
                f"{path}: missing {sorted(set(expected) - set(stored))[:5]}, "
                f"unexpected {sorted(set(stored) - set(expected))[:5]}"
            )
        for name, tensor in stored.items():
            if not torch.equal(tensor.float(), expected[name]):
                raise SystemExit(f"{path}: {name} did not load unchanged")


@contextlib.contextmanager
def patched(obj, name: str, make_wrapper):
    """Replace obj.name (a bound method) by make_wrapper(original) for the duration."""
    original = getattr(obj, name)
    setattr(obj, name, make_wrapper(original))
    try:
        yield
    finally:
        delattr(obj, name)


def synthesize(tts: Qwen3TTSModel, case: dict) -> np.ndarray:
    """Call the official public API the way a user would; the audio it returns."""
    if tts.model.tts_model_type == "base":
        wavs, _ = tts.generate_voice_clone(
            text=case["text"],
            language=case["language"],
            ref_audio=str(REF_AUDIO),
            ref_text=case["ref_text"],
            x_vector_only_mode=case["ref_text"] is None,
            non_streaming_mode=case["non_streaming"],
        )
    elif tts.model.tts_model_type == "custom_voice":
        wavs, _ = tts.generate_custom_voice(
            text=case["text"],
            speaker=case["voice"],
            language=case["language"],
            instruct=case["instruct"],
            non_streaming_mode=case["non_streaming"],
        )
    else:
        wavs, _ = tts.generate_voice_design(
            text=case["text"],
            instruct=case["instruct"] or "",
            language=case["language"],
            non_streaming_mode=case["non_streaming"],
        )
    return wavs[0]


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


class _Captured(Exception):
    pass


def capture_prompt(tts: Qwen3TTSModel, case: dict) -> dict[str, np.ndarray]:
    """Talker inputs exactly as the official generate builds them, stopped before decoding."""
    seen: dict[str, torch.Tensor] = {}

    def outer(original):
        def generate(**kwargs):
            seen["input_ids"] = kwargs["input_ids"][0][0]
            none = [None]
            instruct = (kwargs.get("instruct_ids") or none)[0]
            seen["instruct_ids"] = instruct[0] if instruct is not None else torch.zeros(0, dtype=torch.long)
            ref = (kwargs.get("ref_ids") or none)[0]
            seen["ref_ids"] = ref[0] if ref is not None else torch.zeros(0, dtype=torch.long)
            return original(**kwargs)

        return generate

    def talker(original):
        def generate(**kwargs):
            assert bool(kwargs["attention_mask"].all()), "a single prompt is never padded"
            seen["prefill"] = kwargs["inputs_embeds"][0]
            seen["trailing"] = kwargs["trailing_text_hidden"][0]
            raise _Captured

        return generate

    with (
        patched(tts.model, "generate", outer),
        patched(tts.model.talker, "generate", talker),
        contextlib.suppress(_Captured),
    ):
        synthesize(tts, case)
    return {
        "prefill": seen["prefill"].float().numpy(),
        "trailing": seen["trailing"].float().numpy(),
        "input_ids": seen["input_ids"].numpy().astype(np.int64),
        "instruct_ids": seen["instruct_ids"].numpy().astype(np.int64),
        "ref_ids": seen["ref_ids"].numpy().astype(np.int64),
    }


def prompt_refs(ck: Checkpoint) -> dict[str, np.ndarray]:
    cases = PROMPT_CASES[ck.kind]
    out = dict(ck.header(), cases_json=np.array(json.dumps(cases, ensure_ascii=False)))
    for i, case in enumerate(cases):
        for key, value in capture_prompt(ck.tts, case).items():
            out[f"c{i}_{key}"] = value
    return out


# ---------------------------------------------------------------------------------------------
# Teacher-forced talker and code predictor
# ---------------------------------------------------------------------------------------------


class ForceTokens(LogitsProcessor):
    """Make generate pick tokens[step] whatever the logits say (step = tokens generated so far;
    with inputs_embeds, HF generate starts from an empty input_ids)."""

    def __init__(self, tokens) -> None:
        self.tokens = [int(t) for t in tokens]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.tokens[input_ids.shape[1]]] = 0.0
        return forced


def teacher_forced(tts: Qwen3TTSModel, case: dict, codes: np.ndarray) -> dict[str, np.ndarray]:
    """Run the official decode loop with the code sequence forced; keep the raw logits
    (before repetition penalty, suppression and sampling) and the final-norm hidden states."""
    n = len(codes)
    record: dict = {"cp_logits": [], "cp_inputs": []}

    def talker(original):
        def generate(**kwargs):
            kwargs.update(
                do_sample=False,
                max_new_tokens=n + 1,
                output_logits=True,
                logits_processor=LogitsProcessorList([ForceTokens([*codes[:, 0], CODEC_EOS])]),
            )
            record["talker"] = original(**kwargs)
            return record["talker"]

        return generate

    def predictor(original):
        def generate(**kwargs):
            frame = len(record["cp_logits"])
            record["cp_inputs"].append(kwargs["inputs_embeds"][0].clone())
            kwargs.update(
                do_sample=False,
                output_logits=True,
                logits_processor=LogitsProcessorList([ForceTokens(codes[frame, 1:])]),
            )
            result = original(**kwargs)
            record["cp_logits"].append(torch.cat(result.logits, dim=0))
            return result

        return generate

    talker_module = tts.model.talker
    with (
        patched(talker_module, "generate", talker),
        patched(talker_module.code_predictor, "generate", predictor),
    ):
        audio = synthesize(tts, case)

    result = record["talker"]
    # Step k of HF generate: k = 0 is the prefill; k >= 1 fed frame k-1. The last step's token
    # is the forced EOS and is dropped.
    talker_logits = torch.cat(result.logits[:n], dim=0)
    talker_hidden = torch.stack([step[0][-1][0, -1] for step in result.hidden_states[:n]])
    fed = torch.stack([step[1][0] for step in result.hidden_states[1 : n + 1]])
    assert np.array_equal(fed.numpy(), codes), "the decode loop did not run on the forced codes"
    assert len(record["cp_logits"]) == n
    for t, inputs in enumerate(record["cp_inputs"]):  # predictor input 0 is the talker hidden
        assert torch.equal(inputs[0], talker_hidden[t])
    return {
        "talker_logits": talker_logits.float().numpy(),
        "talker_hidden": talker_hidden.float().numpy(),
        "cp_logits": torch.stack(record["cp_logits"]).float().numpy(),
        "audio": np.asarray(audio, dtype=np.float32),
    }


def talker_refs(ck: Checkpoint, rng: np.random.Generator) -> dict[str, np.ndarray]:
    case = PROMPT_CASES[ck.kind][TALKER_CASE[ck.kind]]
    codes = rng.integers(0, mrc.CODEBOOK_SIZE, (TALKER_FRAMES, mrc.NUM_CODE_GROUPS)).astype(np.int64)
    prompt = capture_prompt(ck.tts, case)
    assert len(prompt["trailing"]) < TALKER_FRAMES
    return dict(
        ck.header(),
        case_json=np.array(json.dumps(case, ensure_ascii=False)),
        codes=codes,
        prefill=prompt["prefill"],
        trailing=prompt["trailing"],
        **teacher_forced(ck.tts, case, codes),
    )


# ---------------------------------------------------------------------------------------------
# Encoders (Base): what create_voice_clone_prompt feeds them and what they return
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def encoder_refs(ck: Checkpoint) -> dict[str, np.ndarray]:
    """The 24 kHz samples, log-mel, x-vector and reference codes of REF_AUDIO, captured inside the
    official create_voice_clone_prompt (which resamples with librosa for both encoders)."""
    model = ck.tts.model
    seen: dict[str, np.ndarray] = {}

    def speaker(original):
        def extract(audio, sr):
            seen["ref_wav_24k"] = np.asarray(audio, dtype=np.float32).copy()
            mel = mel_spectrogram(
                torch.from_numpy(audio).unsqueeze(0),
                n_fft=1024,
                num_mels=128,
                sampling_rate=24000,
                hop_size=256,
                win_size=1024,
                fmin=0,
                fmax=12000,
            ).transpose(1, 2)
            seen["mel"] = mel[0].numpy()
            return original(audio=audio, sr=sr)

        return extract

    def codec(original):
        def encode(input_values, padding_mask=None, return_dict=None):
            seen["codec_input"] = input_values[0].numpy().copy()
            return original(input_values, padding_mask, return_dict=return_dict)

        return encode

    with (
        patched(model, "extract_speaker_embedding", speaker),
        patched(model.speech_tokenizer.model, "encode", codec),
    ):
        (item,) = ck.tts.create_voice_clone_prompt(ref_audio=str(REF_AUDIO), ref_text=REF_TEXT)
    wav = seen["ref_wav_24k"]
    # both encoders get the same samples (the feature extractor pads nothing for one input)
    assert np.array_equal(seen["codec_input"], wav), "the codec encoder saw other samples"
    return dict(
        ck.header(),
        speech_tokenizer_sha256=np.array(ck.speech_sha256),
        ref_audio_sha256=np.array(hashlib.sha256(REF_AUDIO.read_bytes()).hexdigest()),
        ref_text=np.array(REF_TEXT),
        ref_wav_24k=wav,
        mel=seen["mel"],
        x_vector=item.ref_spk_embedding.float().numpy(),
        ref_codes=item.ref_code.numpy().astype(np.int64),
    )


# ---------------------------------------------------------------------------------------------
# Converter and codec
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def convert_refs(ck: Checkpoint, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Rows of the official embedding tables and outputs of the official heads."""
    talker = ck.tts.model.talker
    cp = talker.code_predictor
    cfg = ck.tts.model.config.talker_config
    special_text = [151643, 151644, 151645, 151671, 151672, 151673, 77091, 198, 872, 0, 151935]
    text_ids = np.array(special_text + list(rng.integers(0, mrc.TEXT_VOCAB, 9)), dtype=np.int64)
    codec_special = sorted(
        {0, 1, 2047, 2048, 3071, *range(2148, 2158), *cfg.codec_language_id.values(), *cfg.spk_id.values()}
    )
    codec_ids = np.array(codec_special + list(rng.integers(0, mrc.CODEC_VOCAB, 4)), dtype=np.int64)
    cp_ids = np.array([0, 1, 2047, *rng.integers(0, mrc.CODEBOOK_SIZE, 3)], dtype=np.int64)
    cp_head_in = rng.standard_normal((4, cp.config.hidden_size)).astype(np.float32)
    quant_codes = rng.integers(0, mrc.CODEBOOK_SIZE, (10, mrc.NUM_CODE_GROUPS)).astype(np.int64)

    def t(a):
        return torch.from_numpy(a)

    quant_out = ck.tts.model.speech_tokenizer.model.decoder.quantizer.decode(t(quant_codes).T[None])
    out = dict(
        ck.header(),
        speech_tokenizer_sha256=np.array(ck.speech_sha256),
        text_ids=text_ids,
        text_rows=talker.text_projection(talker.get_text_embeddings()(t(text_ids))).numpy(),
        codec_ids=codec_ids,
        codec_rows=talker.get_input_embeddings()(t(codec_ids)).numpy(),
        cp_embd_ids=cp_ids,
        # The predictor's input tables have the talker's width; the projection (if any) is applied
        # after the lookup, so these rows are raw table rows.
        cp_embd_rows=torch.stack([emb(t(cp_ids)) for emb in cp.model.codec_embedding]).numpy(),
        cp_head_in=cp_head_in,
        cp_head_out=torch.stack([head(t(cp_head_in)) for head in cp.lm_head]).numpy(),
        quant_codes=quant_codes,
        quant_out=quant_out[0].T.numpy(),
    )
    if isinstance(cp.small_to_mtp_projection, torch.nn.Linear):
        mtp_in = rng.standard_normal((4, talker.config.hidden_size)).astype(np.float32)
        out.update(mtp_proj_in=mtp_in, mtp_proj_out=cp.small_to_mtp_projection(t(mtp_in)).numpy())
    return out


@torch.no_grad()
def codec_refs(ck: Checkpoint, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One forward of the official decoder over 80 frames (more than its 72-frame attention
    window). The official Qwen3TTSTokenizerV2Model.decode goes through chunked_decode(chunk 300,
    left context 25), which restarts positions and caches per window; for 80 frames that is one
    window and gives the same samples as this single forward."""
    codes = rng.integers(0, mrc.CODEBOOK_SIZE, (80, mrc.NUM_CODE_GROUPS)).astype(np.int64)
    audio = ck.tts.model.speech_tokenizer.model.decoder(torch.from_numpy(codes).T[None])
    return dict(
        ck.header(),
        speech_tokenizer_sha256=np.array(ck.speech_sha256),
        codes=codes,
        audio=audio.flatten().numpy(),
    )


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def plain_qwen2_tokenizer(checkpoint_dir: Path):
    """Qwen2 byte-level BPE with the Qwen2 pre-tokenizer, built with the tokenizers library."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tok = Tokenizer(
        models.BPE.from_file(str(checkpoint_dir / "vocab.json"), str(checkpoint_dir / "merges.txt"))
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    added = json.loads((checkpoint_dir / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    for token_id, spec in sorted(added.items(), key=lambda kv: int(kv[0])):
        tok.add_tokens([AddedToken(spec["content"], special=spec["special"], normalized=False)])
        assert tok.token_to_id(spec["content"]) == int(token_id)
    return tok


def tokenizer_refs(ck: Checkpoint) -> tuple[dict[str, np.ndarray], list[int]]:
    """Ids for each sentence alone: the official processor (as Qwen3TTSModel._tokenize_texts
    calls it) and the plain Qwen2 tokenizer; also returns the sentences where they differ."""
    plain = plain_qwen2_tokenizer(ck.dir)
    # transformers' own Qwen2 fast tokenizer without fix_mistral_regex must agree with ours.
    unfixed = AutoTokenizer.from_pretrained(str(ck.dir))
    out = dict(ck.header(), sentences_json=np.array(json.dumps(TOKENIZER_SENTENCES, ensure_ascii=False)))
    differ = []
    for i, sentence in enumerate(TOKENIZER_SENTENCES):
        official = ck.tts.processor(text=sentence, return_tensors="pt", padding=True)["input_ids"][0]
        qwen2 = plain.encode(sentence).ids
        assert qwen2 == unfixed(sentence)["input_ids"], sentence
        out[f"t{i}_ids"] = official.numpy().astype(np.int64)
        out[f"t{i}_ids_qwen2"] = np.array(qwen2, dtype=np.int64)
        if official.tolist() != qwen2:
            differ.append(i)
    return out, differ


# ---------------------------------------------------------------------------------------------


def save(out_dir: Path, name: str, arrays: dict[str, np.ndarray]) -> None:
    path = out_dir / name
    np.savez_compressed(path, **arrays)
    print(f"  {name}: {path.stat().st_size / 1024:.0f} KiB, {len(arrays)} arrays")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "refs")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qwen3tts-refs-") as tmp:
        for kind in ("custom_voice", "voice_design", "base"):
            ck = Checkpoint(kind, Path(tmp))
            print(
                f"{kind}: seed {ck.seed}, layout checked against the official modules "
                f"({time.perf_counter() - start:.1f} s)"
            )
            rng = np.random.default_rng(1000 + ck.seed)
            if kind == "base":
                save(args.out, f"convert_{kind}.npz", convert_refs(ck, rng))
                save(args.out, f"encoders_{kind}.npz", encoder_refs(ck))
            save(args.out, f"prompts_{kind}.npz", prompt_refs(ck))
            save(args.out, f"talker_{kind}.npz", talker_refs(ck, rng))
            if kind != "base":
                save(args.out, f"convert_{kind}.npz", convert_refs(ck, rng))
            if kind == "custom_voice":
                save(args.out, f"codec_{kind}.npz", codec_refs(ck, rng))
                arrays, differ = tokenizer_refs(ck)
                save(args.out, "tokenizer.npz", arrays)
                print(
                    "  official (fix_mistral_regex) and plain Qwen2 ids differ for: "
                    + "; ".join(repr(TOKENIZER_SENTENCES[i]) for i in differ)
                )
    total = sum(p.stat().st_size for p in args.out.glob("*.npz"))
    print(f"done in {time.perf_counter() - start:.1f} s; {total / 2**20:.2f} MiB in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
