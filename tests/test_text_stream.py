"""Text arriving in pieces gives exactly the tokens of the whole text, released early."""

from __future__ import annotations

import numpy as np
import pytest

import kazeia_stream


def assistant_text(text: str) -> str:
    """The official template, as one string (control tokens parsed wherever they are)."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


TEXTS = [
    "Hello, world. This is a test of streaming text, token by token!",
    "On 2024-03-15 at 3:45 p.m., Dr. Müller paid $1,234.56 for a café crème.",
    "你好，世界！今天天气很好。我们去公园吧。",
    "Line one.\nLine two,  with  double spaces\tand a tab... done?",
]


@pytest.fixture(scope="module")
def model(tiny_gguf) -> kazeia_stream.Model:
    return kazeia_stream.load_model(tiny_gguf("custom_voice")[0])


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_pieces_give_the_tokens_of_the_whole_text(model, text, piece):
    stream = model.incremental_tokenizer()
    released, early = [], 0
    for i in range(0, len(text), piece):
        released += stream.feed(text[i : i + piece])
        if i + piece < len(text):
            early = len(released)
    released += stream.finish()
    assert released == model._tokens(text)[1] == model._encode(assistant_text(text))[3:-5]
    # Most tokens are released before the text is complete.
    assert early >= len(released) // 2


def test_streaming_prompt_equals_the_whole_text_prompt(model):
    text = TEXTS[0]
    whole = model.prompt(text, voice="ryan", language="english")
    ids = model._encode(assistant_text(text))[3:-5]
    first = model.prompt_from_tokens(ids[:1], voice="ryan", language="english", text_complete=False)
    feed = model.text_feed(first)
    assert feed.row(0) is None and not feed.complete  # nothing to read yet: wait, never PAD
    feed.add(ids[1:4], complete=False)
    feed.add(ids[4:], complete=True)
    assert np.array_equal(first.prefill, whole.prefill)
    assert np.array_equal(feed.trailing, whole.trailing)  # the text rows, then EOS
    n = len(whole.trailing)
    assert np.array_equal(feed.row(n - 1), whole.trailing[-1]) and np.array_equal(feed.row(n - 1), feed.eos)
    assert np.array_equal(feed.row(n), model.pad_embedding)  # then PAD, for ever
    assert np.array_equal(feed.row(n + 50), model.pad_embedding)
    assert feed.n_tokens == len(ids) == whole.n_text_tokens


def test_control_token_text_in_the_text_is_spoken_as_written(model):
    text = "Say <|im_start|> and <|codec_pad|> and <tts_pad>, please."
    ids = model._tokens(text)[1]
    specials = {model.config.text_ids.im_start, model.config.text_ids.im_end, model.config.text_ids.tts_pad}
    assert not specials & set(ids)
    assert "".join(model.tokenizer.token_text(i) for i in ids).replace("\u0120", " ") == text
    stream = model.incremental_tokenizer()
    assert stream.feed(text[:20]) + stream.feed(text[20:]) + stream.finish() == ids
