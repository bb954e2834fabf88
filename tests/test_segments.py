"""Where a long text is split into utterances: the same split for pieces as for the whole."""

from __future__ import annotations

import numpy as np
import pytest

from kazeia_stream.model.segments import Segmenter, split_text

PROSE = (
    "The keeper climbed the stairs at dusk. He polished the lens, trimmed the wick, and "
    "watched the ships pass the rocks! Did anyone thank him? Perhaps not (he did not mind).\n\n"
    "A new paragraph starts here, \u201cquoted.\u201d And it goes on\u2026 "
)
CJK = "\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002\u6211\u4eec\u53bb\u516c\u56ed\u5427\uff01" * 12
TEXTS = [PROSE * 6, CJK, "x" * 300 + " tail", "Short.", PROSE + CJK + " mixed " * 20]


def pieces(text: str, rng: np.random.Generator) -> list[str]:
    cuts = sorted(set(rng.integers(0, len(text), size=len(text) // 3).tolist()))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if b > a]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("max_bytes", [40, 120, 454])
def test_pieces_are_split_as_the_whole_text(text, max_bytes):
    whole = split_text(text, max_bytes)
    rng = np.random.default_rng(max_bytes)
    for _ in range(5):
        segmenter = Segmenter(max_bytes)
        parts = [p for piece in pieces(text, rng) for p in segmenter.feed(piece)] + segmenter.finish()
        segments, current = [], ""
        for part, end in parts:
            current += part
            if end:
                segments.append(current)
                current = ""
        assert segments == whole and current == ""


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("max_bytes", [40, 120, 454])
def test_segments_fit_and_keep_every_character_but_the_whitespace_between_them(text, max_bytes):
    segments = split_text(text, max_bytes)
    assert all(0 < len(s.encode()) <= max_bytes for s in segments)
    assert all(s == s.strip() for s in segments)
    assert "".join(segments).replace(" ", "").replace("\n", "") == text.replace(" ", "").replace("\n", "")


def test_a_text_that_fits_is_one_segment_and_long_ones_end_at_sentences():
    assert split_text("  One. Two! Three?  ", 454) == ["One. Two! Three?"]
    segments = split_text(PROSE * 6, 200)
    assert len(segments) > 3
    # each but the last closes a sentence, after at least half the budget (or a paragraph)
    for s in segments[:-1]:
        assert s.rstrip("\u201d)\"'")[-1] in ".!?\u2026" or (PROSE * 6).count(s + "\n\n")
    assert split_text("First paragraph\n\nsecond one", 454) == ["First paragraph", "second one"]
    assert split_text("one line\nwrapped", 454) == ["one line\nwrapped"]


def test_full_width_sentence_ends_need_no_space_and_long_words_are_cut():
    assert split_text(CJK, 40)[0] == "\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002"
    assert split_text("a" * 25, 10) == ["a" * 10, "a" * 10, "a" * 5]


def test_nothing_but_whitespace_is_no_segment():
    assert split_text(" \n\t ", 100) == []
    with pytest.raises(ValueError):
        Segmenter(4)
