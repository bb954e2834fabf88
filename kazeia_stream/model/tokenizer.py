"""Text to token ids with libllama's tokenizer, read from the talker GGUF.

llama.cpp's `qwen2` pre-tokenizer keeps the Qwen2 regex. The official loader, under transformers
4.57.3, swaps in Mistral's regex (`fix_mistral_regex`), so a few strings split differently there
("iPhone" becomes "Ġi Phone"); README.md documents this.
"""

from __future__ import annotations

import unicodedata

import numpy as np

from . import gguf_layout as L
from . import libllama
from .gguf_file import GGUFFile


class Tokenizer:
    """Tokenizes with the vocabulary of a loaded libllama model."""

    def __init__(self, vocab: int) -> None:
        """`vocab`: a loaded model's `llama_vocab *`."""
        self._vocab = vocab

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Ids of `text`, no BOS added; with `special`, the texts of special tokens such as
        <|im_start|> are those tokens, else plain text like any other.

        Text is NFC-normalised first, as the official (Hugging Face) Qwen2 tokenizer does.
        """
        data = unicodedata.normalize("NFC", text).encode("utf-8")
        n_max = len(data) + 16
        buf = (libllama.token * n_max)()
        n = libllama.lib.llama_tokenize(self._vocab, data, len(data), buf, n_max, False, special)
        if n < 0:
            raise RuntimeError(f"tokenizer needs {-n} slots for {len(data)} bytes")
        return list(buf[:n])

    def token_text(self, token: int) -> str:
        return libllama.lib.llama_vocab_get_text(self._vocab, token).decode("utf-8", errors="replace")


# gguf token types that libllama's tokenizer takes whole where their text appears (UNKNOWN,
# CONTROL, USER_DEFINED: llama-vocab.cpp's cache_special_tokens)
_SPECIAL_TYPES = (2, 3, 4)


def special_tokens(f: GGUFFile) -> dict[str, int]:
    """The ids of the special tokens of a talker file's vocabulary by their texts (e.g.
    "<|im_start|>"), as libllama's tokenizer finds them, read without loading it."""
    ids = np.flatnonzero(np.isin(f.require(L.KEY_TOKEN_TYPES), _SPECIAL_TYPES)).tolist()
    return dict(zip(f.strings(L.KEY_TOKENS, ids), ids))
