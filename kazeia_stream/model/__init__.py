"""Model files: the GGUF pair, its config, tokenizer, prompt building and the converter."""

from .model import Model, find_pair, load_model

__all__ = ["Model", "find_pair", "load_model"]
