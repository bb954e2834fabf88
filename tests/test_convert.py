"""The converter: GGUF layout, values against the official modules, libllama loading, types, errors."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import TokenType
from page_cache import cached_pages

import kazeia_stream
from kazeia_stream.errors import ModelFileError, UsageError
from kazeia_stream.model import gguf_layout as L
from kazeia_stream.model.convert import DECODER_TYPES, TYPES, convert
from kazeia_stream.model.gguf_file import GGUFFile

KINDS = ("custom_voice", "base", "voice_design")
REFS = Path(__file__).parent / "data" / "refs"
TEXT_VOCAB = 151936


@functools.cache
def gguf_file(path: Path) -> GGUFFile:
    return GGUFFile(path)


def tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF, dequantized to float32, in numpy axis order."""
    f = gguf_file(path)
    return {name: f.tensor(name) for name in f.tensor_names}


def types(path: Path) -> dict[str, QType]:
    f = gguf_file(path)
    return {name: f.tensor_type(name) for name in f.tensor_names}


def meta(path: Path, key: str):
    """A metadata value, arrays as lists; None when absent."""
    value = gguf_file(path).get(key)
    return value.tolist() if isinstance(value, np.ndarray) else value


def fields(path: Path):
    return functools.partial(meta, path)


def load_ref(kind: str) -> dict[str, np.ndarray]:
    path = REFS / f"convert_{kind}.npz"
    assert path.exists(), f"{path} is missing: make it with tools/make_references.py"
    return dict(np.load(path))


def ref_gguf(ref: dict[str, np.ndarray], tiny_checkpoint, tiny_gguf) -> tuple[Path, Path]:
    """The f32 conversion of the checkpoint the reference was computed from."""
    spec = json.loads(str(ref["checkpoint_json"]))
    assert spec["preset"] == "tiny"
    weights = tiny_checkpoint(spec["kind"], spec["seed"]) / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == str(ref["weights_sha256"]), (
        "the reference is stale: regenerate it with tools/make_references.py"
    )
    return tiny_gguf(spec["kind"], "f32", spec["seed"])


def assert_close(actual: np.ndarray, expected: np.ndarray, rel: float = 1e-5) -> None:
    np.testing.assert_allclose(actual, expected, rtol=rel, atol=rel * float(np.abs(expected).max()))


# ------------------------------------------------------------------------------------------------
# Values against the official modules
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_talker_embeddings_match_official(kind, tiny_checkpoint, tiny_gguf):
    ref = load_ref(kind)
    talker, _ = ref_gguf(ref, tiny_checkpoint, tiny_gguf)
    embd = gguf_file(talker).tensor(L.TALKER_TOKEN_EMBD)
    assert_close(embd[ref["text_ids"]], ref["text_rows"])
    assert_close(embd[TEXT_VOCAB + ref["codec_ids"]], ref["codec_rows"])


@pytest.mark.parametrize("kind", KINDS)
def test_mmproj_matches_official(kind, tiny_checkpoint, tiny_gguf):
    ref = load_ref(kind)
    t = tensors(ref_gguf(ref, tiny_checkpoint, tiny_gguf)[1])
    assert_close(t[L.CP_OUT_EMBD][ref["codec_ids"]], ref["codec_rows"])
    assert_close(t[L.CP_EMBD][:, ref["cp_embd_ids"]], ref["cp_embd_rows"])
    assert_close(np.einsum("gvh,nh->gnv", t[L.CP_HEAD], ref["cp_head_in"]), ref["cp_head_out"])
    if "mtp_proj_in" in ref:
        proj = ref["mtp_proj_in"] @ t[L.CP_PROJ_IN + ".weight"].T + t[L.CP_PROJ_IN + ".bias"]
        assert_close(proj, ref["mtp_proj_out"])
    else:
        assert L.CP_PROJ_IN + ".weight" not in t
    codes = ref["quant_codes"]  # [T, 16], time-major like quant_out
    first = t[L.WAV_QUANT_FIRST_CB][codes[:, 0]] @ t[L.WAV_QUANT_FIRST_OUT].T
    rest = sum(t[L.WAV_QUANT_REST_CB][i][codes[:, i + 1]] for i in range(codes.shape[1] - 1))
    assert_close(first + rest @ t[L.WAV_QUANT_REST_OUT].T, ref["quant_out"])


def test_snake_and_codec_copies_match_checkpoint(tiny_checkpoint, tiny_gguf):
    """Codec tensors are F32 in the checkpoint: compare with safetensors' own reader."""
    from safetensors.numpy import load_file

    st = load_file(tiny_checkpoint("custom_voice") / "speech_tokenizer" / "model.safetensors")
    t = tensors(tiny_gguf("custom_voice")[1])
    np.testing.assert_allclose(
        t[L.WAV_DAC_POST_SNAKE + ".alpha"], np.exp(st["decoder.decoder.5.alpha"]), rtol=1e-6
    )
    np.testing.assert_allclose(
        t[L.WAV_DAC_POST_SNAKE + ".beta"], 1 / (np.exp(st["decoder.decoder.5.beta"]) + 1e-9), rtol=1e-6
    )
    np.testing.assert_array_equal(t[L.WAV_PRE_CONV + ".weight"], st["decoder.pre_conv.conv.weight"])
    np.testing.assert_array_equal(
        t[L.WAV_QUANT_REST_IN], st["decoder.quantizer.rvq_rest.input_proj.weight"][..., 0]
    )
    cb = "decoder.quantizer.rvq_rest.vq.layers.3._codebook."
    np.testing.assert_allclose(
        t[L.WAV_QUANT_REST_CB][3],
        st[cb + "embedding_sum"] / np.maximum(st[cb + "cluster_usage"], 1e-5)[:, None],
    )


# ------------------------------------------------------------------------------------------------
# Layout and metadata
# ------------------------------------------------------------------------------------------------


def test_talker_vocabulary(tiny_gguf):
    f = fields(tiny_gguf("custom_voice")[0])
    tokens, token_types = f(L.KEY_TOKENS), f(L.KEY_TOKEN_TYPES)
    assert len(tokens) == len(token_types) == TEXT_VOCAB + 3072
    assert f(L.KEY_TOKENIZER_MODEL) == "gpt2" and f(L.KEY_TOKENIZER_PRE) == "qwen2"
    assert (tokens[151644], token_types[151644]) == ("<|im_start|>", TokenType.CONTROL)
    assert (tokens[151671], token_types[151671]) == ("<tts_pad>", TokenType.CONTROL)
    assert (tokens[151657], token_types[151657]) == ("<tool_call>", TokenType.USER_DEFINED)
    assert token_types[151659] == TokenType.CONTROL  # <|fim_prefix|>: not special, but <|...|>
    assert (tokens[151700], token_types[151700]) == ("[PAD151700]", TokenType.UNUSED)
    codec = {name: i - TEXT_VOCAB for i, name in enumerate(tokens) if i >= TEXT_VOCAB}
    assert codec["<|codec_0|>"] == 0 and codec["<|codec_2047|>"] == 2047
    assert codec["<|codec_bos|>"] == 2149 and codec["<|codec_eos_token|>"] == 2150
    assert codec["<|codec_language_english|>"] == 2050 and codec["<|spk_ryan|>"] == 3061
    assert set(token_types[TEXT_VOCAB:]) == {TokenType.CONTROL}
    eos = TEXT_VOCAB + 2150
    assert f(L.KEY_EOS_TOKEN_ID) == eos and f(L.KEY_ADD_EOS) is False and f(L.KEY_ADD_BOS) is False
    assert f(L.KEY_SUPPRESS_TOKENS) == [i for i in range(TEXT_VOCAB + 2048, TEXT_VOCAB + 3072) if i != eos]
    assert f(L.KEY_CHAT_TEMPLATE) is None
    assert len(f(L.KEY_MERGES)) > 150_000


def test_talker_metadata(tiny_checkpoint, tiny_gguf):
    config = json.loads((tiny_checkpoint("custom_voice") / "config.json").read_text())["talker_config"]
    f = fields(tiny_gguf("custom_voice")[0])
    assert f(L.KEY_ARCHITECTURE) == "qwen3tts" and f(L.KEY_FILE_TYPE) == 0
    assert f(L.KEY_BLOCK_COUNT) == config["num_hidden_layers"]
    assert f(L.KEY_EMBEDDING_LENGTH) == config["hidden_size"]
    assert f(L.KEY_KEY_LENGTH) == f(L.KEY_VALUE_LENGTH) == config["head_dim"]
    assert f(L.KEY_ROPE_SECTIONS) == config["rope_scaling"]["mrope_section"] + [0]
    assert f(L.KEY_CONTEXT_LENGTH) == 32768 and f(L.KEY_ROPE_FREQ_BASE) == 1e6
    assert f(L.KEY_TTS_MODEL_TYPE) == "custom_voice" and f(L.KEY_TTS_MODEL_SIZE) == "0b6"
    assert dict(zip(f(L.KEY_DIALECT_SPEAKERS), f(L.KEY_DIALECT_LANGUAGES))) == {
        "eric": "sichuan_dialect",
        "dylan": "beijing_dialect",
    }
    assert f(L.KEY_GENERATION_PREFIX + "subtalker_do_sample") is True
    assert f(L.KEY_GENERATION_PREFIX + "top_k") == 50
    assert f(L.KEY_GENERATION_PREFIX + "repetition_penalty") == pytest.approx(1.05)


@pytest.mark.parametrize("kind", KINDS)
def test_mmproj_layout(kind, tiny_gguf):
    path = tiny_gguf(kind)[1]
    f, names = fields(path), set(types(path))
    assert f(L.KEY_ARCHITECTURE) == "clip" and f(L.KEY_GEN_PROJECTOR_TYPE) == "qwen3tts_gen"
    assert f(L.KEY_CODEC_SAMPLES_PER_FRAME) == 1920 and f(L.KEY_CODEC_UPSAMPLE_RATES) == [8, 5, 4, 3]
    assert f(L.KEY_CP_NUM_CODE_GROUPS) == 16
    has_spkenc = kind == "base"
    assert bool(f(L.KEY_HAS_AUDIO_ENCODER)) is has_spkenc
    assert (L.SPK_FC + ".weight" in names) is has_spkenc
    assert (L.SPK_RES2.format(bid=3, xid=6) + ".bias" in names) is has_spkenc
    # the tiny voice_design talker is wider than its code predictor
    assert (L.CP_PROJ_IN + ".weight" in names) is (kind == "voice_design")
    assert {
        L.CP_EMBD,
        L.CP_HEAD,
        L.CP_OUT_EMBD,
        L.WAV_QUANT_REST_CB,
        L.WAV_UP_GAMMA.format(bid=1),
        L.WAV_DAC_RES_CONV2.format(bid=3, xid=2) + ".weight",
        L.WAV_DAC_POST_CONV + ".bias",
    } <= names


# ------------------------------------------------------------------------------------------------
# libllama
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    llama_cpp.llama_backend_init()
    return llama_cpp


def load_model(llama, path: Path):
    params = llama.llama_model_default_params()
    params.n_gpu_layers = 0
    model = llama.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"libllama could not load {path}"
    return model


def tokenize(llama, vocab, text: str) -> list[int]:
    data = text.encode()
    buf = (llama.llama_token * 256)()
    n = llama.llama_tokenize(vocab, data, len(data), buf, len(buf), False, True)
    assert n >= 0
    return list(buf[:n])


@pytest.mark.parametrize("kind", KINDS)
def test_talker_loads_in_libllama(kind, llama, tiny_gguf):
    model = load_model(llama, tiny_gguf(kind)[0])
    try:
        vocab = llama.llama_model_get_vocab(model)
        assert llama.llama_vocab_n_tokens(vocab) == TEXT_VOCAB + 3072
        assert llama.llama_vocab_eos(vocab) == TEXT_VOCAB + 2150
        assert llama.llama_vocab_get_text(vocab, TEXT_VOCAB + 2149) == b"<|codec_bos|>"
        assert llama.llama_vocab_get_attr(vocab, 151644) & llama.LLAMA_TOKEN_ATTR_CONTROL
    finally:
        llama.llama_model_free(model)


def test_talker_tokenizes_like_qwen2(llama, tiny_checkpoint, tiny_gguf):
    ids = json.loads((tiny_checkpoint("custom_voice") / "vocab.json").read_text(encoding="utf-8"))
    model = load_model(llama, tiny_gguf("custom_voice")[0])
    try:
        vocab = llama.llama_model_get_vocab(model)
        got = tokenize(llama, vocab, "<|im_start|>assistant\nHello world 2024<|im_end|>\n")
        # Qwen2 splits numbers into single digits
        expected = [
            151644,
            ids["assistant"],
            ids["Ċ"],
            ids["Hello"],
            ids["Ġworld"],
            ids["Ġ"],
            ids["2"],
            ids["0"],
            ids["2"],
            ids["4"],
            151645,
            ids["Ċ"],
        ]
        assert got == expected
        assert tokenize(llama, vocab, "<tts_pad><tts_text_bos>") == [151671, 151672]
    finally:
        llama.llama_model_free(model)


def test_talker_decodes_codec_logits(llama, tiny_gguf):
    """A decode runs; the text part of the logits is -inf, the codec part (codec_head) finite."""
    model = load_model(llama, tiny_gguf("voice_design")[0])
    params = llama.llama_context_default_params()
    params.n_ctx = params.n_batch = 32
    params.n_threads = params.n_threads_batch = 1
    ctx = llama.llama_init_from_model(model, params)
    try:
        tokens = (llama.llama_token * 3)(151644, TEXT_VOCAB + 2149, 5)
        assert llama.llama_decode(ctx, llama.llama_batch_get_one(tokens, 3)) == 0
        logits = np.ctypeslib.as_array(llama.llama_get_logits_ith(ctx, -1), shape=(TEXT_VOCAB + 3072,))
        assert np.all(np.isneginf(logits[:TEXT_VOCAB])) and np.all(np.isfinite(logits[TEXT_VOCAB:]))
    finally:
        llama.llama_free(ctx)
        llama.llama_model_free(model)


# ------------------------------------------------------------------------------------------------
# Output types
# ------------------------------------------------------------------------------------------------


def expected_type(name: str, shape: tuple[int, ...], out_type: str) -> QType:
    cp_ffn_down = name.startswith("a.gen.code.blk.") and name.endswith(".ffn_down.weight")
    speaker_encoder = not name.startswith(("a.gen.", L.ENC_PREFIX)) and name.startswith(("a.", "mm.a."))
    f32 = name.startswith((L.WAV_PREFIX, L.ENC_PREFIX)) or speaker_encoder
    if out_type == "f32" or len(shape) < 2 or f32:
        return QType.F32
    if out_type == "q8_0" and shape[-1] % 32 == 0:
        return QType.Q8_0
    return QType.F32 if cp_ffn_down else QType.F16


@pytest.mark.parametrize("out_type", ["f16", "q8_0"])
def test_types(out_type, tiny_gguf):
    for f32_path, path in zip(tiny_gguf("base", "f32"), tiny_gguf("base", out_type)):
        reference, got, got_types = tensors(f32_path), tensors(path), types(path)
        assert got_types.keys() == reference.keys()
        assert meta(path, L.KEY_FILE_TYPE) == {"f16": 1, "q8_0": 7}[out_type]
        assert path.stat().st_size < f32_path.stat().st_size
        for name, qtype in got_types.items():
            assert qtype == expected_type(name, reference[name].shape, out_type), name
            err = np.linalg.norm(got[name] - reference[name]) / max(np.linalg.norm(reference[name]), 1e-30)
            assert err < (1e-2 if qtype == QType.Q8_0 else 1e-3), name
    # the tiny widths are 64 or 96 wide: whole Q8_0 blocks for the talker and code predictor
    if out_type == "q8_0":
        assert types(tiny_gguf("base", "q8_0")[0])[L.TALKER_TOKEN_EMBD] == QType.Q8_0


def test_codec_stays_f32(tiny_gguf):
    for out_type in ("f16", "q8_0"):
        codec = {
            n: t
            for n, t in types(tiny_gguf("custom_voice", out_type)[1]).items()
            if n.startswith(L.WAV_PREFIX)
        }
        assert len(codec) > 100 and set(codec.values()) == {QType.F32}


def test_a_float16_decoder_has_its_matrices_and_kernels_float16(tiny_gguf):
    """`decoder="f16"`: the codec decoder's matrices and conv kernels F16 (not its codebooks,
    which are looked up, nor its vectors); every other tensor as the type writes it."""
    talker, mmproj = tiny_gguf("custom_voice", "q8_0", decoder="f16")
    plain_talker, plain_mmproj = tiny_gguf("custom_voice", "q8_0")
    assert types(talker) == types(plain_talker)
    f, plain = gguf_file(mmproj), types(plain_mmproj)
    tables = (L.WAV_QUANT_FIRST_CB, L.WAV_QUANT_REST_CB)
    decoder = [n for n in f.tensor_names if n.startswith(L.WAV_PREFIX) and n not in tables]
    half = {n for n in decoder if len(f.tensor_shape(n)) > 1}
    assert len(half) > 50
    assert types(mmproj) == {n: QType.F16 if n in half else t for n, t in plain.items()}
    reference, got = tensors(plain_mmproj), tensors(mmproj)
    for name in half:
        np.testing.assert_array_equal(got[name], reference[name].astype(np.float16).astype(np.float32))


def test_the_decoder_type_is_offered_on_the_command_line(tiny_checkpoint, tmp_path):
    import subprocess
    import sys

    ckpt = tiny_checkpoint("custom_voice")
    cmd = [sys.executable, "-m", "kazeia_stream", "convert", str(ckpt), str(tmp_path), "--type", "f32"]
    subprocess.run([*cmd, "--decoder", "f16"], check=True, capture_output=True)
    mmproj = gguf_file(next(tmp_path.glob("mmproj-*.gguf")))
    assert mmproj.tensor_type(L.WAV_PRE_CONV + ".weight") == QType.F16
    bad = subprocess.run([*cmd, "--decoder", "q8_0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--decoder" in bad.stderr


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise")
def test_the_pair_written_leaves_the_page_cache(tiny_checkpoint, tmp_path):
    """Written back and dropped: the first load reads it afresh (in huge pieces, where the
    weights ask for them; a file just written stays cached in small ones)."""
    paths = convert(tiny_checkpoint("custom_voice"), tmp_path, "q8_0")
    assert all(cached_pages(path) == 0 for path in paths)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)


@pytest.mark.parametrize("out_type", ["q4_k_m", "q5_k_m", "q6_k"])
def test_talker_types_from_llama_cpps_quantizer(out_type, tiny_gguf):
    """llama_model_quantize makes the talker (every matrix quantized; the tiny widths are not
    whole 256-wide K blocks, so its recipe falls back to its smaller blocks there), keeps our
    keys (the checkpoint id pairs it with its mmproj) and the mmproj is the q8_0 one."""
    f32_talker = tiny_gguf("custom_voice", "f32")[0]
    talker, mmproj = tiny_gguf("custom_voice", out_type)
    assert meta(talker, L.KEY_FILE_TYPE) == {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}[out_type]
    assert meta(talker, L.KEY_CHECKPOINT_ID) == meta(f32_talker, L.KEY_CHECKPOINT_ID)
    assert types(mmproj) == types(tiny_gguf("custom_voice", "q8_0")[1])
    reference, got, got_types = tensors(f32_talker), tensors(talker), types(talker)
    assert got_types.keys() == reference.keys()
    for name, qtype in got_types.items():
        if reference[name].ndim < 2:
            assert qtype == QType.F32, name
            continue
        assert qtype not in (QType.F32, QType.F16, QType.BF16), name
        err = np.linalg.norm(got[name] - reference[name]) / max(np.linalg.norm(reference[name]), 1e-30)
        assert err < 0.05, name
    model = kazeia_stream.load_model(talker)
    audio, _ = kazeia_stream.Runtime(model).synthesize("Hello.", voice=model.default_voice, seed=1)
    assert len(audio) > 0 and np.isfinite(audio).all()


def test_types_are_described():
    assert set(TYPES) == {"f32", "f16", "q8_0", "q4_k_m", "q5_k_m", "q6_k"} and all(TYPES.values())
    assert set(DECODER_TYPES) == {"f32", "f16"} and all(DECODER_TYPES.values())


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def broken(tiny_checkpoint, tmp_path):
    """A private copy of a tiny checkpoint to damage."""
    return Path(shutil.copytree(tiny_checkpoint("base"), tmp_path / "ckpt"))


def convert_fails(ckpt: Path, out: Path, *words: str) -> None:
    with pytest.raises(ModelFileError) as e:
        convert(ckpt, out, "f16")
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in words), message
    assert not list(out.glob("*.gguf*")), "a partial output was left behind"


def test_missing_directory(tmp_path):
    convert_fails(tmp_path / "nope", tmp_path / "out", "nope")


@pytest.mark.parametrize(
    "file",
    [
        "config.json",
        "model.safetensors",
        "vocab.json",
        "merges.txt",
        "speech_tokenizer/model.safetensors",
        "generation_config.json",
    ],
)
def test_missing_file(file, broken, tmp_path):
    (broken / file).unlink()
    convert_fails(broken, tmp_path / "out", file, "not found")


def test_invalid_json(broken, tmp_path):
    (broken / "config.json").write_text("{not json")
    convert_fails(broken, tmp_path / "out", "config.json", "not valid JSON")


def test_missing_config_key(broken, tmp_path):
    config = json.loads((broken / "config.json").read_text())
    del config["talker_config"]["num_hidden_layers"]
    (broken / "config.json").write_text(json.dumps(config))
    convert_fails(broken, tmp_path / "out", "config.json", "talker_config.num_hidden_layers")


def test_truncated_safetensors(broken, tmp_path):
    path = broken / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    convert_fails(broken, tmp_path / "out", "model.safetensors", "truncated")


def test_not_safetensors(broken, tmp_path):
    (broken / "speech_tokenizer" / "model.safetensors").write_bytes(b"\xff" * 64)
    convert_fails(broken, tmp_path / "out", "model.safetensors", "not a safetensors file")


def test_missing_tensor(broken, tmp_path):
    """A Base checkpoint without one of its speaker-encoder tensors."""
    path = broken / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    del header["speaker_encoder.fc.weight"]
    path.write_bytes(raw[:8] + json.dumps(header, separators=(",", ":")).encode().ljust(n) + raw[8 + n :])
    convert_fails(broken, tmp_path / "out", "model.safetensors", "missing tensor speaker_encoder.fc.weight")


def test_unknown_type(tiny_checkpoint, tmp_path):
    with pytest.raises(UsageError):
        convert(tiny_checkpoint("base"), tmp_path, "q4_0")
    with pytest.raises(UsageError, match="decoder type"):
        convert(tiny_checkpoint("base"), tmp_path, "f16", decoder="q8_0")
    assert not list(tmp_path.glob("*.gguf*"))
