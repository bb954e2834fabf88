"""Q4_K weights times float32 rows on a kernel of our own (`q4k_product.c`), as a ggml custom
operation in our graphs: the talker's products in a Q4_K_M file (its Q6_K ones stay on
ggml's), where the CPU has AVX2 (two variants: AVX512-VNNI where it runs, else AVX2).

ggml's Q4_K product is arithmetic-bound on one thread and its threads take chunks in turn:
on Zen 4 (family 25 model 17), a random 160 MB Q4_K weight, one row (`python -m
kazeia_stream.engine.q4k_product --mb 160 --rows 1`): one thread 16.2-16.6 GB/s against
19.5-21 on the AVX512-VNNI variant, 17.1 on AVX2; two threads 21-22 against 32-33 (numpy's
max read 31-34 on one thread). x is quantized as ggml's Q8_K (per 256 values, int8), so each
block's product is integer but for its two scales; the AVX512-VNNI variant lays x's sub-blocks
out so that the low and the high nibbles of 64 bytes of values each meet 64 contiguous int8
(one mask, one shift and one mask for 128 values), with each sub-block's scale applied to its
int16 pair sums by vpdpwssd. A row's numbers do not depend on the rows beside it, and they are
within float rounding of ggml's (2-3e-7 of the largest output). Threads claim weight rows as
`q8_product`'s do (`ggml_op.h`).

A plain shared library that setuptools builds at install with the package (optional: without
a C compiler the products stay on ggml's kernels, as on a CPU without AVX2, or with
`KAZEIA_Q4K_KERNEL=0`; `KAZEIA_Q4K_KERNEL=avx2` holds a CPU with AVX512-VNNI to the AVX2 variant).
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as QType

from .quantized_product import Kernel

ENV = "KAZEIA_Q4K_KERNEL"  # "0": ggml's kernels for every Q4_K product; "avx2": our AVX2 variant
KERNEL = Kernel("q4k_product", QType.Q4_K, ENV)

if (
    __name__ == "__main__"
):  # python -m kazeia_stream.engine.q4k_product [--mb MB] [--rows 1,4] [--threads 1,2]
    KERNEL.bench()
