"""Tokens of a text that arrives in pieces (an LLM's output), released once they are final.

BPE must see whole words: tokenizing pieces separately would split "Hel" + "lo" differently
from "Hello". So the text so far is tokenized whole, inside the same chat-template prefix the
prompt uses, and tokens are released only up to a cut before whitespace or punctuation after which
later text cannot change them (checked: the tokens of the text up to the cut must be a prefix of
the tokens of the whole text so far).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

from .prompt import ASSISTANT


def _is_cut(ch: str) -> bool:
    return ch.isspace() or unicodedata.category(ch).startswith("P")


class IncrementalTokenizer:
    """Feed text pieces, get the text's final token ids in order."""

    def __init__(self, encode: Callable[[str], list[int]]) -> None:
        self._encode = encode
        self._prefix_len = len(encode(ASSISTANT))
        self.text = ""
        self.released = 0  # tokens of the body released so far
        self._cut = 0  # text[:_cut] is fully released

    def _tokens(self, text: str) -> list[int]:
        return self._encode(ASSISTANT + text)[self._prefix_len :]

    def feed(self, piece: str) -> list[int]:
        """Add a piece; return the tokens that became final."""
        self.text += piece
        tokens = None
        for cut in self._cuts():
            stable = self._tokens(self.text[:cut])
            tokens = tokens if tokens is not None else self._tokens(self.text)
            if tokens[: len(stable)] == stable:
                self._cut = cut
                return self._release(stable)
        return []

    def finish(self) -> list[int]:
        """The text is complete: return every token not released yet."""
        self._cut = len(self.text)
        return self._release(self._tokens(self.text)) if self.text else []

    def _cuts(self) -> list[int]:
        """Candidate cut positions, latest first: a whitespace or punctuation character after
        the released text, right after a non-space character (a word just ended)."""
        text = self.text
        cuts = [
            i for i in range(len(text) - 1, self._cut, -1) if _is_cut(text[i]) and not text[i - 1].isspace()
        ]
        return cuts[:3]

    def _release(self, tokens: list[int]) -> list[int]:
        new = tokens[self.released :]
        self.released = len(tokens)
        return new
