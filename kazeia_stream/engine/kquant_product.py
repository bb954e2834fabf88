"""Q4_K, Q5_K and Q6_K weights times float32 rows on a kernel of our own (`kquant_product.c`),
as ggml custom operations in our graphs: the talker's products in a K-quant file (Q4_K_M: Q4_K
and Q6_K; Q5_K_M: Q5_K and Q6_K; Q6_K), where the CPU has AVX2 (two variants: AVX512-VNNI where
it runs, else AVX2; the AVX512 variants of Q5_K and Q6_K are their AVX2 loops built for
AVX-512).

ggml's K-quant products are arithmetic-bound on one thread and its threads take chunks in
turn: on Zen 4 (family 25 model 17), a random 160 MB weight, one row (`python -m
kazeia_stream.engine.kquant_product --type q4_k --mb 160 --rows 1`): Q4_K one thread 16.2-16.6
GB/s against 19.5-21 on the AVX512-VNNI variant, 17.1 on AVX2; two threads 21-22 against 32-33
(numpy's max read 31-34 on one thread). x is quantized as ggml's Q8_K (per 256 values, int8),
so each block's product is integer but for its two scales. Q4_K on AVX512-VNNI: x's
sub-blocks laid out so that the low and the high nibbles of 64 bytes of values each meet 64
contiguous int8 (one mask, one shift and one mask for 128 values), each sub-block's scale
applied to its int16 pair sums by vpdpwssd. Q6_K: the 6-bit values unsigned, the 32 they carry
taken off once a block from x's group sums. Q5_K: Q4_K's AVX2 loops with each value's fifth
bit put above its four. A row's numbers do not depend on the rows beside
it, and they are within float rounding of ggml's (2-3e-7 of the largest output). Threads claim
weight rows as `q8_product`'s do (`ggml_op.h`).

A plain shared library that setuptools builds at install with the package (optional: without
a C compiler these products stay on ggml's kernels, as on a CPU without AVX2, or with
`KAZEIA_KQUANT_KERNEL=0`; `KAZEIA_KQUANT_KERNEL=avx2` holds a CPU with AVX512-VNNI to the AVX2
variant).
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as QType

from .quantized_product import Kernel

ENV = "KAZEIA_KQUANT_KERNEL"  # "0": ggml's kernels for every K-quant product; "avx2": our AVX2 variant
Q4_K = Kernel("kquant_product", QType.Q4_K, ENV, "q4k")
Q5_K = Kernel("kquant_product", QType.Q5_K, ENV, "q5k")
Q6_K = Kernel("kquant_product", QType.Q6_K, ENV, "q6k")

if __name__ == "__main__":  # [--type q4_k|q5_k|q6_k] [--mb MB] [--rows 1,4] [--threads 1,2]
    import argparse

    kernels = {k.qtype.name.lower(): k for k in (Q4_K, Q5_K, Q6_K)}
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--type", choices=list(kernels), default="q4_k")
    args, rest = ap.parse_known_args()
    kernels[args.type].bench(rest)
