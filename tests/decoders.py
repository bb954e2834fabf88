"""The tiny codec decoder, also with its dilated convs in Winograd's F(2, 7) as the real one's."""

from __future__ import annotations

from pathlib import Path

import pytest

from kazeia_stream.engine import codec, winograd
from kazeia_stream.engine.threads import DECODER_THREADS
from kazeia_stream.model.gguf_file import GGUFFile

PRODUCTS = ("direct", "winograd")


def tiny_decoder(mmproj: Path, products: str) -> codec.CodecDecoder:
    """The decoder of a tiny mmproj: "direct", as it runs (its few channels multiply directly),
    or "winograd": every residual unit's dilated conv tiled (`CausalConv.tile`), as the real
    decoder's wide ones (skipped where the transforms' kernel does not run)."""
    if products == "winograd" and not winograd.available():
        pytest.skip("the transforms' kernel is not built here")
    with pytest.MonkeyPatch.context() as mp:
        if products == "winograd":
            mp.setattr(codec, "WINOGRAD_CHANNELS", 1)
        return codec.CodecDecoder(GGUFFile(mmproj), DECODER_THREADS)
