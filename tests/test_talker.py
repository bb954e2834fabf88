"""The talker (graphs on libggml) against the official implementation, teacher-forced along fixed codes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kazeia_stream
from kazeia_stream.engine import cache_files
from kazeia_stream.engine.dump import teacher_forced_talker
from kazeia_stream.engine.talker import TalkerState

REFS = Path(__file__).parent / "data" / "refs"


def rows_counted(talker, monkeypatch) -> list[int]:
    """The row count of each forward call the talker makes from now on."""
    rows: list[int] = []
    forward = talker.lm.forward
    monkeypatch.setattr(
        talker.lm, "forward", lambda embeds, *a, **kw: rows.append(len(embeds)) or forward(embeds, *a, **kw)
    )
    return rows


def _case_prompt(model: kazeia_stream.Model, ref) -> kazeia_stream.model.prompt.Prompt:
    case = json.loads(str(ref["case_json"]))
    return model.prompt(
        case["text"],
        voice=case["voice"],
        language=case["language"],
        instruct=case["instruct"],
        text_streaming=not case["non_streaming"],
    )


@pytest.mark.parametrize("kind", ["custom_voice", "voice_design"])
def test_teacher_forced_talker_matches_the_official_logits(kind, tiny_runtime):
    ref = np.load(REFS / f"talker_{kind}.npz")
    runtime = tiny_runtime(kind)
    prompt = _case_prompt(runtime.model, ref)
    assert np.abs(prompt.prefill - ref["prefill"]).max() < 1e-5
    logits, hidden = teacher_forced_talker(
        runtime.talker, runtime.code_predictor, prompt, runtime.model.text_feed(prompt), ref["codes"]
    )
    assert np.abs(logits - ref["talker_logits"]).max() <= 1e-3
    assert np.abs(hidden - ref["talker_hidden"]).max() <= 1e-3
    assert (logits.argmax(-1) == ref["talker_logits"].argmax(-1)).mean() >= 0.99


def test_the_fixed_rows_are_computed_once_and_results_do_not_depend_on_history(tiny_runtime, monkeypatch):
    monkeypatch.setenv(cache_files.CACHE_ENV, "0")  # computed, not read from a file (test_rows_cache)
    runtime = tiny_runtime("custom_voice")
    model, talker = runtime.model, runtime.talker
    rows_run = rows_counted(talker, monkeypatch)
    hello, other = (model.prompt(t, voice="ryan") for t in ("Hello there.", "Something else."))
    eric = model.prompt("Hello there.", voice="eric")

    talker.prefill(TalkerState(), model.pad_embedding[None])  # no fixed rows cached

    def prefill(prompt):
        rows_run.clear()
        state = TalkerState()
        out = talker.prefill(state, prompt.prefill, prompt.n_fixed)
        assert state.pos == len(prompt.prefill)
        talker.step(state, model.pad_embedding)  # leave more positions behind in the cache
        return out, sum(rows_run) - 1

    first, n_first = prefill(hello)
    assert n_first == len(hello.prefill)
    again, n_again = prefill(hello)
    assert n_again == len(hello.prefill) - hello.n_fixed
    other_warm, n_other = prefill(other)
    assert n_other == len(other.prefill) - other.n_fixed
    _, n_eric = prefill(eric)
    assert n_eric == len(eric.prefill)  # another voice: computed from scratch
    other_cold, _ = prefill(other)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert all(np.array_equal(a, b) for a, b in zip(other_warm, other_cold))
    # The split into two batches changes only float rounding against one batch.
    talker.prefill(TalkerState(), eric.prefill)
    whole = talker.prefill(TalkerState(), other.prefill)
    assert np.abs(whole[1] - other_warm[1]).max() < 1e-4 * np.abs(whole[1]).max()


def test_keeping_a_prompt_s_fixed_rows_computes_those_rows_and_no_more(tiny_runtime, monkeypatch):
    """A session's rows computed ahead (`keep`) are its fixed rows only; an utterance after
    them computes the rest, and gets what it gets from scratch."""
    monkeypatch.setenv(cache_files.CACHE_ENV, "0")  # computed, not read from a file (test_rows_cache)
    runtime = tiny_runtime("custom_voice")
    model, talker = runtime.model, runtime.talker
    prompt = model.prompt("Kept ahead.", voice="ryan")
    talker.prefill(TalkerState(), model.pad_embedding[None])  # no fixed rows cached
    cold = talker.prefill(TalkerState(), prompt.prefill, prompt.n_fixed)
    talker.prefill(TalkerState(), model.pad_embedding[None])
    rows_run = rows_counted(talker, monkeypatch)
    talker.keep(0, prompt.prefill[: prompt.n_fixed])
    assert rows_run == [prompt.n_fixed]
    rows_run.clear()
    warm = talker.prefill(TalkerState(), prompt.prefill, prompt.n_fixed)
    assert rows_run == [len(prompt.prefill) - prompt.n_fixed]
    assert all(np.array_equal(a, b) for a, b in zip(cold, warm))
    rows_run.clear()
    talker.keep(0, prompt.prefill[: prompt.n_fixed])  # kept already: nothing to compute
    assert rows_run == []
