"""What the tests of our ggml custom operations (`q8_product`, `f32_product`) share: each runs
on every variant of its kernel that this CPU runs."""

from __future__ import annotations

from functools import partial
from types import ModuleType

import pytest

from kazeia_stream.engine import native


def on_each_variant(kernel: ModuleType):
    """The mark that skips a test module where `kernel` was not built or the CPU lacks AVX2,
    and the `op` fixture: `kernel.product` on each variant (skipped where the CPU does not run
    it)."""
    mark = pytest.mark.skipif(not kernel.variants(), reason="the kernel is not built, or this CPU lacks AVX2")

    @pytest.fixture(params=native.VARIANTS)
    def op(request):
        if request.param not in kernel.variants():
            pytest.skip(f"this CPU does not run the {request.param} variant")
        return partial(kernel.product, variant=request.param)

    return mark, op
