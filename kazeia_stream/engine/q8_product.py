"""Q8_0 weights times float32 rows on a kernel of our own (`q8_product.c`), as a ggml custom
operation in our graphs: the talker's and the code predictor's products, where the CPU has
AVX2 (two variants of the same loops: AVX512-VNNI where it runs, else AVX2).

Generating a frame is reading the weights, and ggml's Q8_0 kernels do not read them at the
memory's speed: its arithmetic is the limit. On a Xeon (family 6 model 207), 160 MB of random
Q8_0 weights (`python -m kazeia_stream.engine.q8_product --mb 160`): one thread, one row, ggml
21.2 ms (7.5 GB/s) against 13.8 ms (11.5 GB/s) on either variant, four rows 38.0 against 17.4
(AVX512-VNNI) and 24.7 ms (AVX2); two threads, one row, 11.0 against 6.8 ms (23.5 GB/s; numpy's
max reads 15 and 26 GB/s on one and two threads). On an AMD Zen 1 (AVX2 at half width, no VNNI)
it keeps a small lead over ggml's in the engines (docs/measurements.md, 2026-12-03 afternoon)
once its threads claim the weight rows in chunks, as ggml's one-column product does, and its
tile bodies are inlined per row count: with fixed shares, a thread that the host or the codec
decoder held back held the whole product up, and the engines ran 25-35% slower than on ggml's.
Each thread takes its chunks from a contiguous share of its own first, the others' only once
it is done: on Zen 4 (family 25 model 17), two threads taking chunks in turn read 35-36 GB/s
where numpy's max read 61, from shares 49-52 (the same command).
This kernel: int8 products two blocks a register, weight rows in tiles that every row of x
passes, the weights prefetched far ahead. On AVX2 the two blocks are interleaved eight bytes at
a time (x laid out to match), so that one conversion to float, one product of the scales and
one fmadd serve both: on Zen 1 a third faster than a block a register from registers
(`tools/mac_rate.c`), 1.2x from memory (measured when each row of x signed the weights, its
magnitudes kept beside it). The weights' magnitudes are now taken once for every row of x that
passes, and each row signed by the weights, as ggml's kernels do: on Zen 3, four rows from
memory on one thread, 0.81-0.84 ns per 32 multiply-adds against 0.90-0.95 (`q8_product.c`).
A row's numbers do not depend on the rows beside it (the engines' batched streams rely on
it), and they are within float rounding of ggml's (1-3e-7 of the largest output: the rows are
quantized as ggml does, per block of 32 to int8).

Where the CPU has AMX's int8 tiles (a Xeon of family 6 model 167 here), three or four rows of x
(streams batched in the generator's passes) take them, to the AVX512 variant's numbers bit for
bit (its eight lanes a row, each the sums of every eighth block, are kept apart as AMX's blocks
come out, and added in the same order), so a stream's numbers do not depend on the streams
beside it: 78 MB of weights, four rows, one thread 4.2 ms against 5.3-5.4 (the earlier AVX512
order), two threads 2.1 against 2.8-2.9; one row runs the AVX512 variant's loops
(`python -m kazeia_stream.engine.q8_product --mb 79`). The AVX512 variant's lanes are those
blocks' sums since AMX came (its earlier sixteen lanes of half blocks, which AMX's tiles could
only give at twice the tile operations, measured no faster at one row, 3.1 against 3.1 ms in a
C loop over 79 MB).

A plain shared library that setuptools builds at install with the package (optional: without
a C compiler the products stay on ggml's kernels, as on a CPU without AVX2, or with
`KAZEIA_Q8_KERNEL=0`; `KAZEIA_Q8_KERNEL=avx2` holds a CPU with AVX512-VNNI to the AVX2 variant,
`avx512` one with AMX to AVX512's loops).
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as QType

from .quantized_product import Kernel

ENV = "KAZEIA_Q8_KERNEL"  # "0": ggml's kernels for every product; "avx2": our AVX2 variant
KERNEL = Kernel("q8_product", QType.Q8_0, ENV)

if __name__ == "__main__":  # [--mb MB] [--rows 1,4] [--threads 1,2]
    KERNEL.bench()
