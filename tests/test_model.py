"""Loading a GGUF pair, reading its config, tokenizing, and building prompts like the official code."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from page_cache import cached_pages, resident

import kazeia_stream
from kazeia_stream import ModelFileError, UsageError
from kazeia_stream.model import gguf_layout as L
from kazeia_stream.model.prompt import ASSISTANT, ASSISTANT_TAIL

REFS = Path(__file__).parent / "data" / "refs"


def _refs(name: str) -> np.lib.npyio.NpzFile:
    return np.load(REFS / f"{name}.npz")


@pytest.fixture(scope="module")
def custom_voice(tiny_gguf) -> kazeia_stream.Model:
    return kazeia_stream.load_model(tiny_gguf("custom_voice")[0])


@pytest.fixture(scope="module")
def voice_design(tiny_gguf) -> kazeia_stream.Model:
    return kazeia_stream.load_model(tiny_gguf("voice_design")[0].parent)


def test_config_is_read_from_the_files(custom_voice, voice_design, tiny_checkpoint):
    hf = json.loads((tiny_checkpoint("custom_voice") / "config.json").read_text())
    tc = hf["talker_config"]
    cfg = custom_voice.config
    assert custom_voice.kind == "custom_voice" and cfg.size == "0b6"
    assert voice_design.kind == "voice_design" and voice_design.config.size == "1b7"
    assert cfg.talker.hidden_size == tc["hidden_size"]
    assert cfg.talker.num_layers == tc["num_hidden_layers"]
    assert cfg.talker.head_dim == tc["head_dim"]
    assert cfg.talker.text_vocab_size == tc["text_vocab_size"]
    assert cfg.talker.codec_vocab_size == tc["vocab_size"]
    assert cfg.code_predictor.num_layers == tc["code_predictor_config"]["num_hidden_layers"]
    assert cfg.code_predictor.num_code_groups == 16 and cfg.code_predictor.vocab_size == 2048
    assert not cfg.code_predictor.has_projection and voice_design.config.code_predictor.has_projection
    assert cfg.codec.samples_per_frame == 1920 and custom_voice.sample_rate == 24000
    assert cfg.codec_ids.eos == tc["codec_eos_token_id"] and cfg.codec_ids.bos == tc["codec_bos_id"]
    assert cfg.text_ids.tts_pad == hf["tts_pad_token_id"] and cfg.text_ids.im_start == hf["im_start_token_id"]
    assert cfg.speakers == tc["spk_id"]
    assert cfg.languages == tc["codec_language_id"]
    assert cfg.dialects == {k: v for k, v in tc["spk_is_dialect"].items() if v}
    assert voice_design.voices == [] and "english" in voice_design.languages


def _prefill_cases(kind: str):
    refs = _refs(f"prompts_{kind}")
    for i, case in enumerate(json.loads(str(refs["cases_json"]))):
        yield case, refs[f"c{i}_prefill"], refs[f"c{i}_trailing"], refs[f"c{i}_input_ids"]


@pytest.mark.parametrize("kind", ["custom_voice", "voice_design"])
def test_prefill_matches_the_official_embeddings(kind, request):
    model = request.getfixturevalue(kind)
    for case, prefill_ref, trailing_ref, ids_ref in _prefill_cases(kind):
        assert model._turn(ASSISTANT, case["text"], ASSISTANT_TAIL) == ids_ref.tolist(), case["name"]
        prefill, trailing = model.prefill(
            case["text"],
            voice=case["voice"],
            language=case["language"],
            instruct=case["instruct"],
            text_streaming=not case["non_streaming"],
        )
        assert prefill.shape == prefill_ref.shape and trailing.shape == trailing_ref.shape, case["name"]
        scale = np.abs(prefill_ref).max()
        assert np.abs(prefill - prefill_ref).max() <= 1e-6 * scale, case["name"]
        assert np.abs(trailing - trailing_ref).max() <= 1e-6 * scale, case["name"]


@pytest.mark.parametrize("kind", ["custom_voice", "voice_design"])
def test_fixed_rows_are_exactly_what_prompts_of_one_voice_share(kind, request):
    model = request.getfixturevalue(kind)
    for case, *_ in _prefill_cases(kind):
        settings = dict(
            voice=case["voice"],
            language=case["language"],
            instruct=case["instruct"],
            text_streaming=not case["non_streaming"],
        )
        a = model.prompt(case["text"], **settings)
        b = model.prompt("Quite another text, 42.", **settings)
        assert a.n_fixed == b.n_fixed < min(len(a.prefill), len(b.prefill)), case["name"]
        assert np.array_equal(a.prefill[: a.n_fixed], b.prefill[: b.n_fixed]), case["name"]
        assert not np.array_equal(a.prefill[a.n_fixed], b.prefill[b.n_fixed]), case["name"]


def test_names_are_case_insensitive(custom_voice):
    a = custom_voice.prefill("Hi.", voice="Ryan", language="English")[0]
    b = custom_voice.prefill("Hi.", voice="ryan", language="english")[0]
    assert np.array_equal(a, b)


def test_dialect_speaker_uses_its_dialect_only_for_chinese_and_auto(custom_voice):
    ids = custom_voice.config.languages
    rows = custom_voice._rows
    auto = custom_voice.prefill("Hi.", voice="eric", language="auto")[0]
    english = custom_voice.prefill("Hi.", voice="eric", language="english")[0]
    pad = rows.text([custom_voice.config.text_ids.tts_pad])[0]
    # Position 3 + 2 holds PAD + the language row in the control block.
    assert np.allclose(auto[5], pad + rows.codec([ids["sichuan_dialect"]])[0], atol=1e-6)
    assert np.allclose(english[5], pad + rows.codec([ids["english"]])[0], atol=1e-6)


def test_bad_requests_are_clear_errors(custom_voice, voice_design):
    with pytest.raises(UsageError, match="empty"):
        custom_voice.prefill("   ")
    with pytest.raises(UsageError, match="unknown voice 'nobody'.*ryan"):
        custom_voice.prefill("Hi.", voice="nobody")
    with pytest.raises(UsageError, match="unknown language 'klingon'"):
        custom_voice.prefill("Hi.", language="klingon")
    with pytest.raises(UsageError, match="no built-in voices"):
        voice_design.prefill("Hi.", voice="ryan")


def test_tokenizer_matches_the_official_qwen2_tokenizer(custom_voice):
    refs = _refs("tokenizer")
    sentences = json.loads(str(refs["sentences_json"]))
    differ = []
    for i, text in enumerate(sentences):
        ours = custom_voice.tokenizer.encode(text)
        assert ours == refs[f"t{i}_ids_qwen2"].tolist(), text
        if ours != refs[f"t{i}_ids"].tolist():
            differ.append(text)
    # Only the Mistral-regex split of the official loader differs (documented in README.md).
    assert differ == [t for t in sentences if "iPhone" in t]


# --- bad files ---------------------------------------------------------------------------------


def _copy_pair(tiny_gguf, tmp_path: Path) -> tuple[Path, Path]:
    talker, mmproj = tiny_gguf("custom_voice")
    return Path(shutil.copy(talker, tmp_path)), Path(shutil.copy(mmproj, tmp_path))


def test_missing_files(tiny_gguf, tmp_path):
    with pytest.raises(ModelFileError, match="no such file"):
        kazeia_stream.load_model(tmp_path / "nothing")
    talker, mmproj = _copy_pair(tiny_gguf, tmp_path)
    mmproj.unlink()
    with pytest.raises(ModelFileError, match="expected one mmproj.*found none"):
        kazeia_stream.load_model(talker)


def test_truncated_file_names_the_file(tiny_gguf, tmp_path):
    talker, _ = _copy_pair(tiny_gguf, tmp_path)
    with open(talker, "r+b") as f:
        f.truncate(talker.stat().st_size - 1000)
    with pytest.raises(ModelFileError, match=f"{talker.name}: truncated"):
        kazeia_stream.load_model(tmp_path)


def test_not_a_gguf(tiny_gguf, tmp_path):
    talker, _ = _copy_pair(tiny_gguf, tmp_path)
    talker.write_bytes(b"not a model at all")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        kazeia_stream.load_model(tmp_path)


def test_damaged_header(tiny_gguf, tmp_path):
    talker, _ = _copy_pair(tiny_gguf, tmp_path)
    with open(talker, "r+b") as f:
        f.truncate(64)
    with pytest.raises(ModelFileError, match="damaged or truncated"):
        kazeia_stream.load_model(tmp_path)


def test_wrong_gguf_in_either_place(tiny_gguf, tmp_path):
    talker, mmproj = _copy_pair(tiny_gguf, tmp_path)
    original = talker.read_bytes()
    shutil.copy(mmproj, talker)
    with pytest.raises(ModelFileError, match=f"{talker.name}: architecture is 'clip'"):
        kazeia_stream.load_model(tmp_path)
    talker.write_bytes(original)
    shutil.copy(talker, mmproj)
    with pytest.raises(ModelFileError, match=f"{mmproj.name}: not a Qwen3-TTS mmproj"):
        kazeia_stream.load_model(tmp_path)


def one_layer_more(talker: Path) -> None:
    """Make a talker file claim one layer more than it holds (its metadata alone is wrong)."""
    data = bytearray(talker.read_bytes())
    key = b"qwen3tts.block_count"
    at = data.index(key) + len(key) + 4  # the key, its u32 type, then its u32 value
    data[at : at + 4] = (int.from_bytes(data[at : at + 4], "little") + 1).to_bytes(4, "little")
    talker.write_bytes(bytes(data))


def test_a_talker_missing_a_layer_s_tensors_is_refused_at_load(tiny_gguf, tmp_path):
    talker, _ = _copy_pair(tiny_gguf, tmp_path)
    one_layer_more(talker)
    with pytest.raises(ModelFileError, match=r"talker tensor 'blk\.2\.attn_norm\.weight' is missing"):
        kazeia_stream.load_model(tmp_path)


def unknown_tokenizer(talker: Path) -> None:
    """Rewrite the talker file in place with a tokenizer model libllama does not know ("zzzz")."""
    data = bytearray(talker.read_bytes())
    at = data.index(b"tokenizer.ggml.model") + len(b"tokenizer.ggml.model") + 4 + 8  # its type, length
    assert data[at : at + 4] == b"gpt2"
    data[at : at + 4] = b"zzzz"
    talker.write_bytes(bytes(data))


def test_a_vocabulary_libllama_refuses_fails_where_the_model_is_first_used(tiny_gguf, tmp_path):
    talker, _ = _copy_pair(tiny_gguf, tmp_path)
    unknown_tokenizer(talker)
    model = kazeia_stream.load_model(tmp_path)  # libllama loads the vocabulary in the background
    for use in (model.ready, lambda: kazeia_stream.Runtime(model), lambda: model.prompt("Hi."), model.ready):
        with pytest.raises(ModelFileError, match="libllama could not load it"):
            use()


def test_ambiguous_folder(tiny_gguf, tmp_path):
    talker, _ = _copy_pair(tiny_gguf, tmp_path)
    shutil.copy(talker, tmp_path / "other.gguf")
    with pytest.raises(ModelFileError, match="expected one talker"):
        kazeia_stream.load_model(tmp_path)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise")
def test_rows_not_in_the_page_cache_are_read_together_not_faulted_in_one_by_one(tiny_gguf, tmp_path):
    """A prompt's text rows are read, each asked of the page cache first, so that the disk
    gives them together: the page cache then holds about their pages, where a mapping's page
    faults would each have waited for 16 pages or more around its row."""
    from kazeia_stream.model.gguf_file import GGUFFile, drop_from_page_cache

    talker, _ = _copy_pair(tiny_gguf, tmp_path)
    f = GGUFFile(talker)
    ids = np.linspace(0, f.tensor_shape(L.TALKER_TOKEN_EMBD)[0] - 1, 8).astype(np.int64)  # far apart
    drop_from_page_cache(talker)
    rows = f.rows(L.TALKER_TOKEN_EMBD, ids)
    assert cached_pages(talker) <= 2 * len(ids)
    assert np.array_equal(rows, f.tensor(L.TALKER_TOKEN_EMBD)[ids])


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux")
def test_the_talker_s_text_embedding_stays_out_of_memory(tiny_runtime):
    runtime = tiny_runtime("custom_voice", "q8_0")
    model = runtime.model
    talker = model.talker_path
    assert model.prompt("Hello.", voice=model.default_voice).prefill.shape[0] > 0  # rows we read
    embd = model.talker_file.span(L.TALKER_TOKEN_EMBD)[1]
    mapped = [(size, rss) for size, rss in resident(talker) if size > embd]  # the engines'
    # the text embedding's pages none; every weight's mapped when the runtime was made, unless
    # they were read onto huge pages (`Weights`)
    weights = runtime.talker.weights
    least = 0 if weights.copied else weights.nbytes
    assert mapped and all(least <= rss <= size - embd + 2 * 4096 for size, rss in mapped)


@pytest.mark.parametrize("out_type, kv_f32", [("f32", True), ("q8_0", False)])
def test_the_talker_s_kv_cache_has_the_type_that_goes_with_its_weights(tiny_runtime, out_type, kv_f32):
    runtime = tiny_runtime("custom_voice", out_type)
    assert runtime.talker.lm.kv_f32 is kv_f32


@pytest.mark.parametrize("out_type", ["f32", "f16", "q8_0"])
def test_load_and_read_give_every_tensor_as_the_mapping_does(tiny_gguf, out_type):
    from kazeia_stream.model.gguf_file import GGUFFile

    for path in tiny_gguf("custom_voice", out_type):
        f = GGUFFile(path)
        for name in f.tensor_names[::7]:
            read, mapped = f.read(name), f.tensor(name)
            assert read.dtype == np.float32 and np.array_equal(read, mapped)
            loaded, raw = f.load(name), f.raw(name)
            assert loaded.dtype == raw.dtype and np.array_equal(loaded, raw)
            view = f.view(name)  # of the file's one mapping
            assert view.dtype == raw.dtype and view.shape == raw.shape and np.array_equal(view, raw)
            assert not isinstance(read, np.memmap) and not isinstance(loaded, np.memmap)


def test_llama_log_passes_on_the_levels_the_logger_shows(tiny_gguf, caplog):
    """The levels of libllama's log passed on to the "llama.cpp" logger are those it shows when
    a model loads: after a load at WARNING, one at DEBUG gets libllama's whole log."""
    from kazeia_stream.model.llama import LlamaVocab

    talker = tiny_gguf("custom_voice")[0]
    with caplog.at_level(logging.WARNING, logger="llama.cpp"):
        LlamaVocab(talker)
    with caplog.at_level(logging.DEBUG, logger="llama.cpp"):
        LlamaVocab(talker)
    levels = {r.levelno for r in caplog.records if r.name == "llama.cpp"}
    assert {logging.DEBUG, logging.INFO} <= levels
    assert any("vocab" in r.getMessage() for r in caplog.records if r.levelno < logging.WARNING)


def test_llama_log_filter_passes_continuations_with_their_message():
    """The C filter (llama_log.c) passes a level at or above the one set, and a continuation
    line (CONT) exactly when the message it continues was passed."""
    import ctypes

    from kazeia_stream.model import libllama, llama

    if llama._filter is None:
        pytest.skip("llama_log.c was not built")
    got: list[tuple[int, bytes]] = []
    record = libllama.log_callback(lambda level, text, _: got.append((level, text)))
    debug, info, warn, error, cont = 1, 2, 3, 4, 5
    try:
        llama._filter.kz_log_set(record, warn)
        for level in (debug, cont, warn, cont, info, cont, error, cont):
            llama._filter.kz_log(level, f"{level}".encode(), ctypes.c_void_p(0))
    finally:
        llama.init_backend()  # the filter back to the logger's levels
    assert got == [(warn, b"3"), (cont, b"5"), (error, b"4"), (cont, b"5")]


def test_our_libllama_declarations_are_llama_cpp_python_s():
    """`libllama`'s struct and callback, against the package's own (ours spare its import)."""
    import ctypes

    import llama_cpp

    from kazeia_stream.model import libllama

    ours, theirs = libllama.ModelParams, llama_cpp.llama_model_params
    assert ctypes.sizeof(ours) == ctypes.sizeof(theirs)
    layout = lambda struct: [
        (name, getattr(struct, name).offset, getattr(struct, name).size) for name, *_ in struct._fields_
    ]
    assert layout(ours) == layout(theirs)
    assert libllama.log_callback._argtypes_ == llama_cpp.llama_log_callback._argtypes_
    assert libllama.token == llama_cpp.llama_token


@pytest.mark.subprocess
def test_a_model_loads_and_tokenizes_without_llama_cpp_python_s_import(tiny_gguf):
    """libllama and libggml are loaded from its files, the package left unimported (0.15-0.45
    s of a start on Zen 1), and llama.cpp's log stays ours: nothing on stderr (its import set
    a callback of its own, which printed the vocabulary's load)."""
    import subprocess
    import sys

    code = (
        "import sys; from kazeia_stream import load_model, Runtime; "
        f"m = load_model({str(tiny_gguf('custom_voice')[0])!r}); Runtime(m); "
        "assert m.tokenizer.encode('Hello there.'); assert 'llama_cpp' not in sys.modules"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
