"""The codec encoder (ICL reference codes) against the official one, its converter output and errors."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from kazeia_stream.engine.codec_encoder import CodecEncoder
from kazeia_stream.errors import ModelFileError
from kazeia_stream.model import gguf_layout as L
from kazeia_stream.model.convert import convert
from kazeia_stream.model.gguf_file import GGUFFile

REFS = Path(__file__).parent / "data" / "refs"


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    path = REFS / "encoders_base.npz"
    assert path.exists(), f"{path} is missing: make it with tools/make_references.py"
    return dict(np.load(path))


@pytest.fixture(scope="module")
def ref_checkpoint(ref, tiny_checkpoint) -> Path:
    """The tiny checkpoint the reference was computed from, checked by its weights' hashes."""
    spec = json.loads(str(ref["checkpoint_json"]))
    assert (spec["preset"], spec["kind"]) == ("tiny", "base")
    ckpt = tiny_checkpoint(spec["kind"], spec["seed"])
    for path, key in (
        (ckpt / "model.safetensors", "weights_sha256"),
        (ckpt / "speech_tokenizer" / "model.safetensors", "speech_tokenizer_sha256"),
    ):
        assert hashlib.sha256(path.read_bytes()).hexdigest() == str(ref[key]), (
            f"the reference is stale ({path.name}): regenerate it with tools/make_references.py"
        )
    return ckpt


def mmproj(ref: dict[str, np.ndarray], tiny_gguf, out_type: str) -> GGUFFile:
    spec = json.loads(str(ref["checkpoint_json"]))
    return GGUFFile(tiny_gguf(spec["kind"], out_type, spec["seed"])[1])


def ties_only(enc: CodecEncoder, wav: np.ndarray, expected: np.ndarray) -> int:
    """Where our codes differ from `expected`, follow the official codes instead (each choice
    changes the later residuals) and require every differing choice to be a tie: the two entries
    at the same distance from the residual, to float32 rounding. Returns the number of ties."""
    emb = enc.embeddings(wav).astype(np.float64)
    ties, first = 0, 0
    for rvq in (enc.semantic, enc.acoustic):
        r = emb if rvq.proj is None else rvq.proj.w.array.astype(np.float64) @ emb
        for i, cb in enumerate(rvq.codebooks.astype(np.float64)):
            want = expected[:, first + i]
            dist = ((r.T[:, None, :] - cb[None]) ** 2).sum(-1)  # [frames, size]
            best = dist.argmin(axis=1)
            differ = best != want
            near, far = dist[differ, best[differ]], dist[differ, want[differ]]
            np.testing.assert_allclose(far, near, rtol=1e-5, atol=1e-6 * float(dist.max()))
            ties += int(differ.sum())
            r = r - cb[want].T
        first += len(rvq.codebooks)
    return ties


# ------------------------------------------------------------------------------------------------
# Against the official encoder
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_type", ["f32", "q8_0"])
def test_codes_match_official(out_type, ref, ref_checkpoint, tiny_gguf):
    enc = CodecEncoder(mmproj(ref, tiny_gguf, out_type))
    wav, expected = ref["ref_wav_24k"], ref["ref_codes"]
    codes = enc.encode(wav)
    assert codes.dtype == np.int64
    assert codes.shape == expected.shape == (-(-len(wav) // 1920), 16)
    if not np.array_equal(codes, expected):
        assert ties_only(enc, wav, expected) > 0


def test_short_input_and_bad_input(ref, ref_checkpoint, tiny_gguf):
    enc = CodecEncoder(mmproj(ref, tiny_gguf, "f32"), threads=1)
    assert enc.encode(ref["ref_wav_24k"][:1]).shape == (1, 16)
    assert enc.encode(ref["ref_wav_24k"][:1921]).shape == (2, 16)
    for bad in (np.zeros((2, 100), np.float32), np.zeros(0, np.float32)):
        with pytest.raises(ValueError):
            enc.encode(bad)


# ------------------------------------------------------------------------------------------------
# Converter
# ------------------------------------------------------------------------------------------------


def test_converter_writes_the_encoder_f32(tiny_checkpoint, tiny_gguf):
    f32, q8 = GGUFFile(tiny_gguf("base", "f32")[1]), GGUFFile(tiny_gguf("base", "q8_0")[1])
    names = [n for n in q8.tensor_names if n.startswith(L.ENC_PREFIX)]
    assert len(names) > 40 and all(len(n.encode()) < 64 for n in names)
    assert {q8.tensor_type(n) for n in names} == {QType.F32}
    assert names == [n for n in f32.tensor_names if n.startswith(L.ENC_PREFIX)]
    for n in names:
        np.testing.assert_array_equal(q8.tensor(n), f32.tensor(n), err_msg=n)
    # metadata from speech_tokenizer/config.json
    config = json.loads((tiny_checkpoint("base") / "speech_tokenizer" / "config.json").read_text())
    enc = config["encoder_config"]
    assert q8.get(L.KEY_ENC_UPSAMPLING_RATIOS).tolist() == enc["upsampling_ratios"]
    assert q8.get(L.KEY_ENC_VALID_QUANTIZERS) == config["encoder_valid_num_quantizers"] == 16
    assert q8.get(L.KEY_ENC_FRAME_SIZE) == config["encode_downsample_rate"] == 1920
    for key, typ in L.CODEC_ENCODER_KEYS.items():
        value = q8.get(L.KEY_ENC_PREFIX + key)
        assert value == (pytest.approx(enc[key], rel=1e-6) if typ is float else enc[key]), key
    assert q8.get(L.KEY_ENC_DOWNSAMPLE_STRIDE) == 2
    assert q8.get(L.KEY_ENC_DOWNSAMPLE_PAD_MODE) == "replicate"
    # only the codebooks the official encode keeps: 1 semantic + 15 acoustic
    assert q8.tensor_shape(L.ENC_QUANT_ACOUSTIC_CB) == (15, 2048, enc["codebook_dim"])


def test_converter_folds_the_codebooks(tiny_checkpoint, tiny_gguf):
    from safetensors.numpy import load_file

    st = load_file(tiny_checkpoint("base") / "speech_tokenizer" / "model.safetensors")
    f = GGUFFile(tiny_gguf("base")[1])
    q = "encoder.quantizer.acoustic_residual_vector_quantizer."
    cb = f"{q}layers.3.codebook."
    np.testing.assert_allclose(
        f.tensor(L.ENC_QUANT_ACOUSTIC_CB)[3],
        st[cb + "embed_sum"] / np.maximum(st[cb + "cluster_usage"], 1e-5)[:, None],
    )
    np.testing.assert_array_equal(f.tensor(L.ENC_QUANT_ACOUSTIC_IN), st[q + "input_proj.weight"][..., 0])
    np.testing.assert_array_equal(
        f.tensor(L.ENC_DOWN_CONV.format(bid=2) + ".weight"), st["encoder.encoder.layers.9.conv.weight"]
    )


@pytest.mark.parametrize("kind", ["custom_voice", "voice_design"])
def test_other_kinds_have_no_encoder(kind, tiny_gguf):
    f = GGUFFile(tiny_gguf(kind)[1])
    assert not CodecEncoder.available(f)
    assert not any(n.startswith(L.ENC_PREFIX) for n in f.tensor_names)
    with pytest.raises(ModelFileError) as e:
        CodecEncoder(f)
    message = str(e.value)
    assert "\n" not in message and str(f.path) in message and "no codec encoder" in message, message
    assert CodecEncoder.available(GGUFFile(tiny_gguf("base")[1]))


def test_missing_encoder_config_key(tiny_checkpoint, tmp_path):
    ckpt = Path(shutil.copytree(tiny_checkpoint("base"), tmp_path / "ckpt"))
    path = ckpt / "speech_tokenizer" / "config.json"
    config = json.loads(path.read_text())
    del config["encoder_config"]["rope_theta"]
    path.write_text(json.dumps(config))
    with pytest.raises(ModelFileError) as e:
        convert(ckpt, tmp_path / "out", "f16")
    message = str(e.value)
    assert "\n" not in message and "encoder_config.rope_theta" in message, message
    assert not list((tmp_path / "out").glob("*.gguf"))
