"""The tiny codec decoder three ways: its dilated convs in Winograd's F(4, 7), or direct; its
products of few columns on our float32 kernel, or on ggml's."""

from __future__ import annotations

from pathlib import Path

import pytest

from kazeia_stream.engine import f32_product, winograd
from kazeia_stream.engine.codec import CodecDecoder
from kazeia_stream.engine.threads import DECODER_THREADS
from kazeia_stream.model.gguf_file import GGUFFile

PRODUCTS = ("winograd", "direct", "ggml")


def tiny_decoder(mmproj: Path, products: str) -> CodecDecoder:
    """The decoder of a tiny mmproj: "winograd", as it runs where our transforms' and float32
    kernels do (skipped elsewhere); "direct", each tap's product (`KAZEIA_WINOGRAD=0`); "ggml", its
    products of few columns on ggml's kernels, its convolutions direct (`KAZEIA_F32_KERNEL=0`, as on
    a CPU without AVX2)."""
    if products == "winograd" and not winograd.available():
        pytest.skip("the transforms' kernel is not built here")
    with pytest.MonkeyPatch.context() as mp:
        if products == "direct":
            mp.setenv(winograd.ENV, "0")
        if products == "ggml":
            mp.setenv(f32_product.ENV, "0")
        f32_product.chosen.cache_clear()
        try:
            return CodecDecoder(GGUFFile(mmproj), DECODER_THREADS)
        finally:
            f32_product.chosen.cache_clear()
