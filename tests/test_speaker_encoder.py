"""The Base models' speaker encoder: log-mel and x-vector against the official implementation."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from kazeia_stream.engine.speaker_encoder import N_MELS, SpeakerEncoder, log_mel, mel_bank
from kazeia_stream.errors import ModelFileError
from kazeia_stream.model import gguf_layout as L
from kazeia_stream.model.gguf_file import GGUFFile

REFS = Path(__file__).parent / "data" / "refs"
SPK_PREFIXES = tuple(
    name.split("{")[0]
    for name in (
        L.SPK_STEM,
        L.SPK_TDNN1,
        L.SPK_RES2,
        L.SPK_TDNN2,
        L.SPK_SE_CONV1,
        L.SPK_SE_CONV2,
        L.SPK_MFA,
        L.SPK_ASP_TDNN,
        L.SPK_ASP_CONV,
        L.SPK_FC,
    )
)


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@pytest.fixture(scope="module")
def ref(tiny_checkpoint) -> dict[str, np.ndarray]:
    """encoders_base.npz, after checking that the fixture rebuilds the checkpoint it came from."""
    with np.load(REFS / "encoders_base.npz") as f:
        data = {k: f[k] for k in ("ref_wav_24k", "mel", "x_vector", "checkpoint_json", "weights_sha256")}
    spec = json.loads(str(data["checkpoint_json"]))
    weights = tiny_checkpoint(spec["kind"], spec["seed"]) / "model.safetensors"
    assert (spec["preset"], spec["kind"]) == ("tiny", "base")
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == str(data["weights_sha256"]), (
        "the reference is stale: regenerate it with tools/make_references.py"
    )
    return data


@pytest.fixture(scope="module")
def encoders(tiny_gguf) -> dict[str, SpeakerEncoder]:
    return {t: SpeakerEncoder(GGUFFile(tiny_gguf("base", t)[1])) for t in ("f32", "q8_0")}


def test_log_mel_matches_the_official_front_end(ref):
    mel = log_mel(ref["ref_wav_24k"])
    assert mel.dtype == np.float32
    assert mel.shape == ref["mel"].shape == (len(ref["ref_wav_24k"]) // 256, N_MELS)
    # The official STFT runs in float32: its rounding noise (~1e-7 of a frame's energy) reaches a
    # few 1e-4 in the log of its weakest bins. Ours is float64 (it matches a float64 torch STFT
    # to 5e-7): as a whole the two agree to ~1.5e-6, and 99.7 % of the values to 1e-5.
    assert rel_err(mel, ref["mel"]) < 1e-5
    np.testing.assert_allclose(mel, ref["mel"], rtol=1e-4, atol=1e-6)
    close = np.abs(mel - ref["mel"]) <= 1e-5 * np.abs(ref["mel"]) + 1e-6
    assert close.mean() > 0.99


def test_mel_bank_is_built_once():
    bank = mel_bank()
    assert bank is mel_bank()
    assert bank.shape == (N_MELS, 513) and bank.dtype == np.float32 and not bank.flags.writeable
    assert bank.min() == 0 and np.all(bank.max(axis=1) > 0)  # no empty filter


@pytest.mark.parametrize("out_type", ["f32", "q8_0"])
def test_x_vector_matches_the_official_encoder(ref, encoders, out_type):
    enc = encoders[out_type]
    assert enc.enc_dim == ref["x_vector"].shape[0] == 64
    from_ref_mel = enc.x_vector(ref["mel"])
    assert from_ref_mel.dtype == np.float32 and from_ref_mel.shape == (64,)
    assert rel_err(from_ref_mel, ref["x_vector"]) <= 1e-4
    # end to end, from the samples
    assert rel_err(enc.x_vector(log_mel(ref["ref_wav_24k"])), ref["x_vector"]) <= 1e-4


@pytest.mark.parametrize("out_type", ["f16", "q8_0"])
def test_the_speaker_encoder_stays_f32(tiny_gguf, out_type):
    f = GGUFFile(tiny_gguf("base", out_type)[1])
    names = [n for n in f.tensor_names if n.startswith(SPK_PREFIXES)]
    assert len(names) == 2 * (1 + 3 * (7 + 4) + 4)  # stem, 3 blocks, mfa, asp x 2, fc; weight + bias
    assert {f.tensor_type(n) for n in names} == {QType.F32}


def test_threads_do_not_change_the_result(ref, encoders):
    enc = encoders["f32"]
    np.testing.assert_allclose(enc.x_vector(ref["mel"], threads=1), enc.x_vector(ref["mel"]), rtol=1e-5)


def test_short_and_bad_inputs(ref, encoders):
    enc = encoders["f32"]
    assert enc.min_frames == 5  # the dilation-4 blocks pad 4 frames by reflection on each side
    assert np.all(np.isfinite(enc.x_vector(ref["mel"][: enc.min_frames])))
    with pytest.raises(ValueError, match="needs at least 5"):
        enc.x_vector(ref["mel"][:4])
    with pytest.raises(ValueError, match=r"mel must be \[frames, 128\]"):
        enc.x_vector(ref["mel"][:, :64])
    with pytest.raises(ValueError, match="too short"):
        log_mel(np.zeros(384, np.float32))
    with pytest.raises(ValueError, match="1-D"):
        log_mel(np.zeros((2, 4000), np.float32))
    assert log_mel(np.zeros(385, np.float32)).shape == (1, N_MELS)


def test_an_mmproj_without_speaker_encoder_is_refused(tiny_gguf):
    _, mmproj = tiny_gguf("custom_voice")
    with pytest.raises(ModelFileError) as e:
        SpeakerEncoder(GGUFFile(mmproj))
    message = str(e.value)
    assert "\n" not in message and str(mmproj) in message and "no speaker encoder" in message


@pytest.mark.subprocess
def test_imports_neither_torch_nor_librosa():
    code = (
        "import sys, kazeia_stream.engine.speaker_encoder;"
        " print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'librosa', 'trio')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
