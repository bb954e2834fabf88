"""Long texts as several utterances: where a text is split so that each part fits the talker.

An utterance takes one talker position per prompt row and per frame, and its frames are capped
per text token (a text sometimes never gets its EOS), so a long enough text would run out of
positions. A text is therefore spoken as segments, each its own utterance with the session's
voice, language and instruction, back to back:

- a segment ends at the first sentence end (. ! ? ... or a full-width form, then any closing
  quotes or brackets, then whitespace) once it holds at least `min_bytes` of UTF-8 (by default
  half of `max_bytes`, so shorter texts are not split), and at a paragraph break (a blank line);
- it never holds more than `max_bytes` bytes (a token is at least one byte): a segment that
  would grow past it ends before the word that would not fit, and a longer word is cut;
- the whitespace between two segments is dropped, and so is whitespace around the text.

The rule is incremental: text arriving in pieces (an LLM's reply) is split exactly as the same
text given whole, and each whole word is released at once, so speech starts after the first.
"""

from __future__ import annotations

SENTENCE_ENDS = frozenset(".!?\u2026\u203c\u2047\u2048\u2049\u3002\uff01\uff1f\uff61")
CLOSERS = frozenset("\"')]}\u00bb\u201d\u2019\u300d\u300f\uff09\u3011\u300b")
# Full-width sentence ends are not followed by a space: they end a word themselves.
FULLWIDTH_ENDS = frozenset("\u3002\uff01\uff1f\uff61")

Part = tuple[str, bool]  # text of the current segment, and whether the segment ends after it


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))  # invalid text is refused by the tokenizer


class Segmenter:
    """Feed text pieces; get the parts of the current segment and where each segment ends."""

    def __init__(self, max_bytes: int, min_bytes: int | None = None) -> None:
        if max_bytes < 8:
            raise ValueError(f"a segment must hold at least 8 bytes, not {max_bytes}")
        self.max_bytes = max_bytes
        self.min_bytes = max_bytes // 2 if min_bytes is None else min(min_bytes, max_bytes)
        self._size = 0  # bytes released into the current segment
        self._space = ""  # whitespace after the released text, released with the next word
        self._word = ""  # characters since the last word break, not released yet
        self._newlines = 0  # newlines in the current run of whitespace
        self._parts: list[Part] = []

    def feed(self, piece: str) -> list[Part]:
        for ch in piece:
            self._push(ch)
        return self._take()

    def finish(self) -> list[Part]:
        """The text is complete: release the rest and end the last segment."""
        if self._word:
            self._word_end()
        self._end()
        return self._take()

    def _push(self, ch: str) -> None:
        if ch.isspace():
            if self._word:
                self._word_end()
            if ch == "\n":
                self._newlines += 1
                if self._newlines >= 2:  # a paragraph break
                    self._end()
            if self._size:  # whitespace that starts a segment is dropped
                self._space += ch
                self._fit()
            return
        self._newlines = 0
        self._word += ch
        self._fit()
        if ch in FULLWIDTH_ENDS:
            self._word_end()

    def _fit(self) -> None:
        """End the segment before the pending text if it would not fit, and cut a word that
        alone would not (it grows one character at a time, so all but its last one fit)."""
        if self._size + _nbytes(self._space + self._word) <= self.max_bytes:
            return
        self._end()
        if _nbytes(self._word) > self.max_bytes:
            head, self._word = self._word[:-1], self._word[-1]
            self._release(head)
            self._end()

    def _word_end(self) -> None:
        word, self._word = self._word, ""
        self._release(self._space + word)
        if self._size >= self.min_bytes and word.rstrip("".join(CLOSERS))[-1:] in SENTENCE_ENDS:
            self._end()

    def _release(self, text: str) -> None:
        self._space = ""
        if not text:
            return
        self._size += _nbytes(text)
        if self._parts and not self._parts[-1][1]:
            self._parts[-1] = (self._parts[-1][0] + text, False)
        else:
            self._parts.append((text, False))

    def _end(self) -> None:
        self._space = ""
        if not self._size:
            return
        self._size = 0
        text, _ = self._parts.pop() if self._parts and not self._parts[-1][1] else ("", True)
        self._parts.append((text, True))

    def _take(self) -> list[Part]:
        parts, self._parts = self._parts, []
        return parts


def split_text(text: str, max_bytes: int, min_bytes: int | None = None) -> list[str]:
    """The segments of a whole text."""
    segmenter = Segmenter(max_bytes, min_bytes)
    segments, current = [], ""
    for text_part, end in segmenter.feed(text) + segmenter.finish():
        current += text_part
        if end:
            segments.append(current)
            current = ""
    return segments
