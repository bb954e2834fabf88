"""The tiny codec decoder both ways: its dilated convs in Winograd's F(4, 7), or direct."""

from __future__ import annotations

from pathlib import Path

import pytest

from kazeia_stream.engine import winograd
from kazeia_stream.engine.codec import CodecDecoder
from kazeia_stream.engine.threads import DECODER_THREADS
from kazeia_stream.model.gguf_file import GGUFFile

PRODUCTS = ("winograd", "direct")


def tiny_decoder(mmproj: Path, products: str) -> CodecDecoder:
    """The decoder of a tiny mmproj: "winograd", as it runs where the transforms' kernel does
    (skipped elsewhere), or "direct", each tap's product (`KAZEIA_WINOGRAD=0`)."""
    if products == "winograd" and not winograd.available():
        pytest.skip("the transforms' kernel is not built here")
    with pytest.MonkeyPatch.context() as mp:
        if products == "direct":
            mp.setenv(winograd.ENV, "0")
        return CodecDecoder(GGUFFile(mmproj), DECODER_THREADS)
