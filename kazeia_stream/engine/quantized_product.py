"""Quantized weights times float32 rows on kernels of our own, as ggml custom operations in
our graphs (`q8_product` for Q8_0, `kquant_product` for Q4_K, Q5_K and Q6_K): what every such
kernel shares, the choice of its variant, which weights it takes, the product's graph operation
and a benchmark from memory."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache, partial

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from . import native
from .ggml_graph import Graph, Tensor, dims, strides, type_of


class Kernel:
    """The kernel of library `name` (`{name}.c`; its operation `op` where it has several) for
    weights of `qtype`; `env` names the environment variable that sets its variant ("0":
    ggml's kernels; a variant's name: that one, where it runs)."""

    def __init__(self, name: str, qtype: QType, env: str, op: str = "") -> None:
        self.name, self.qtype, self.env, self.op = name, qtype, env, op
        self.chosen: Callable[[], str | None] = cache(self._chosen)

    def variants(self) -> tuple[str, ...]:
        """The variants of the kernel this CPU runs, best first (none where it was not built)."""
        return native.variants(self.name)

    def _chosen(self) -> str | None:
        """The variant the engines use (`chosen`, fixed at its first use): the best this CPU
        runs, unless the environment says otherwise; None for ggml's kernels."""
        return native.chosen(self.name, self.env)

    def available(self) -> bool:
        """Whether the engines' products of this type run on the kernel."""
        return self.chosen() is not None

    def takes(self, w: Tensor) -> bool:
        """Whether the kernel multiplies weight `w`: a matrix of its type, or a stack of them,
        with its rows in place, where the kernel runs."""
        block, size = GGML_QUANT_SIZES[self.qtype]
        return (
            type_of(w) == self.qtype
            and dims(w)[3] == 1
            and strides(w)[1] == dims(w)[0] // block * size
            and self.available()
        )

    def product(
        self,
        g: Graph,
        w: Tensor,
        x: Tensor,
        variant: str | None = None,
        ids: Tensor | None = None,
        norm: tuple[Tensor, float] | None = None,
        residual: Tensor | None = None,
    ) -> Tensor:
        """w @ x for `takes(w)` and the float32 columns of x [in, n]: [out, n], on `variant`
        (default: the chosen one). For a stack w, `ids` (int32, n in a row) names the matrix
        each column takes: the code predictor's heads, all the streams' columns in one product.
        `norm` and `residual` as `Graph.product` takes them."""
        assert (ids is None) == (dims(w)[2] == 1), "a stack's product needs ids, a matrix's none"
        return g.product(self._address(variant), w, x, ids, norm, residual)

    def products(
        self,
        g: Graph,
        ws: Sequence[Tensor],
        x: Tensor,
        norm: tuple[Tensor, float] | None = None,
        variant: str | None = None,
    ) -> list[Tensor]:
        """Each matrix of ws (`takes`, as wide) times x, in one operation on `variant`
        (default: the chosen one): x normed and quantized once, and one barrier where each
        product would end with one."""
        return g.fused(g.product(self._address(variant), ws[0], x, norm=norm, more=ws[1:]), ws)

    def _address(self, variant: str | None) -> int:
        """The operation's C function on `variant` (default: the chosen one)."""
        variant = variant or self.chosen()
        assert variant is not None, "the kernel does not run here"
        return native.address(self.name, variant, self.op)

    def bench(self, argv: list[str] | None = None) -> None:
        """ms per product of a random weight of about MB megabytes (larger than the caches:
        from memory), on ggml's kernel and on each variant of this one that runs here (median
        of 5, the kernels alternated)."""
        import argparse
        import time

        import numpy as np

        from ..ggml_lib import quantize
        from .ggml_graph import Allocator, ArrayTensor, products

        ap = argparse.ArgumentParser(description=f"{self.qtype.name}: {Kernel.bench.__doc__}")
        ap.add_argument("--mb", type=int, default=512)
        ap.add_argument("--rows", type=lambda v: [int(n) for n in v.split(",")], default=[1, 4])
        ap.add_argument("--threads", type=lambda v: [int(n) for n in v.split(",")], default=[1, 2])
        args = ap.parse_args(argv)
        if not self.variants():
            raise SystemExit("the kernel is not built here, or this CPU lacks AVX2")
        rng = np.random.default_rng(0)
        block = quantize(rng.standard_normal((1024, 1024), dtype=np.float32), self.qtype)
        data = np.tile(block, (max(1, args.mb * 10**6 // block.nbytes), 1))
        weight, allocator = ArrayTensor(data, self.qtype, (len(data), 1024)), Allocator()
        ops = {"ggml": None, **{v: partial(self.product, variant=v) for v in self.variants()}}
        for threads in args.threads:
            for n in args.rows:
                x = rng.standard_normal((n, 1024), dtype=np.float32)
                times: dict[str, list[float]] = {name: [] for name in ops}
                for _ in range(5):  # the kernels in turn: one measured first read 10-20% slower
                    for name, op in ops.items():
                        start = time.perf_counter()
                        products(weight.tensor, x, allocator, threads, op)
                        times[name].append(time.perf_counter() - start)
                figures = []
                for name in ops:
                    ms = 1e3 * float(np.median(times[name]))
                    ns = 1e6 * ms / (len(data) * 1024 // 32 * n)  # per 32 weights and row of x
                    figures.append(
                        f"{name} {ms:.1f} ms ({data.nbytes / ms / 1e6:.1f} GB/s, {ns:.2f} ns/32 MACs)"
                    )
                head = f"{data.nbytes / 1e6:.0f} MB, {threads} thread(s), {n} row(s)"
                print(f"{head}: {', '.join(figures)}", flush=True)
        allocator.close()
        weight.close()
