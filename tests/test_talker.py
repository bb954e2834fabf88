"""The talker on libllama against the official implementation, teacher-forced along fixed codes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kazeia_stream
from kazeia_stream.engine.dump import teacher_forced_talker

REFS = Path(__file__).parent / "data" / "refs"


def _case_prompt(model: kazeia_stream.Model, ref) -> kazeia_stream.model.prompt.Prompt:
    case = json.loads(str(ref["case_json"]))
    return model.prompt(case["text"], voice=case["voice"], language=case["language"],
                        instruct=case["instruct"], text_streaming=not case["non_streaming"])


@pytest.mark.parametrize("kind", ["custom_voice", "voice_design"])
def test_teacher_forced_talker_matches_the_official_logits(kind, tiny_gguf):
    ref = np.load(REFS / f"talker_{kind}.npz")
    model = kazeia_stream.load_model(tiny_gguf(kind)[0])
    prompt = _case_prompt(model, ref)
    assert np.abs(prompt.prefill - ref["prefill"]).max() < 1e-5
    logits, hidden = teacher_forced_talker(model.engines, prompt, ref["codes"])
    assert np.abs(logits - ref["talker_logits"]).max() <= 1e-3
    assert np.abs(hidden - ref["talker_hidden"]).max() <= 1e-3
    assert (logits.argmax(-1) == ref["talker_logits"].argmax(-1)).mean() >= 0.99


def test_each_utterance_starts_from_an_empty_cache(tiny_gguf):
    model = kazeia_stream.load_model(tiny_gguf("custom_voice")[0])
    talker = model.engines.talker
    prompt = model.prompt("Hello there.", voice="ryan")
    first = talker.prefill(prompt.prefill)
    talker.step(model.pad_embedding)
    again = talker.prefill(prompt.prefill)
    assert np.array_equal(first[0], again[0]) and np.array_equal(first[1], again[1])
