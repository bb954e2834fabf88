"""Text to token ids with libllama's tokenizer, read from the talker GGUF.

llama.cpp's `qwen2` pre-tokenizer keeps the Qwen2 regex. The official loader, under transformers
4.57.3, swaps in Mistral's regex (`fix_mistral_regex`), so a few strings split differently there
("iPhone" becomes "Ġi Phone"); README.md documents this.
"""

from __future__ import annotations

import unicodedata

import llama_cpp

from ..errors import ModelFileError


class Tokenizer:
    """Tokenizes with the vocabulary of a loaded libllama model."""

    def __init__(self, vocab: llama_cpp.llama_vocab_p) -> None:
        self._vocab = vocab
        self.n_tokens = llama_cpp.llama_vocab_n_tokens(vocab)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Ids of `text`, no BOS added; with `special`, the texts of special tokens such as
        <|im_start|> are those tokens, else plain text like any other.

        Text is NFC-normalised first, as the official (Hugging Face) Qwen2 tokenizer does.
        """
        data = unicodedata.normalize("NFC", text).encode("utf-8")
        n_max = len(data) + 16
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, n_max, False, special)
        if n < 0:
            raise RuntimeError(f"tokenizer needs {-n} slots for {len(data)} bytes")
        return list(buf[:n])

    def token_text(self, token: int) -> str:
        return llama_cpp.llama_vocab_get_text(self._vocab, token).decode("utf-8", errors="replace")

    def special_id(self, text: str) -> int:
        """The id of a special token given by its text, e.g. "<|im_start|>"."""
        ids = self.encode(text)
        if len(ids) != 1:
            raise ModelFileError(f"special token {text} is not in the vocabulary")
        return ids[0]
