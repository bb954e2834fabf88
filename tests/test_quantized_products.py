"""Our kernels of quantized weights times float32 rows (`q8_product` for Q8_0, `kquant_product`
for Q4_K, Q5_K and Q6_K; each variant this CPU runs) against ggml's products, and what the
engines need of them: a row's numbers whatever rows come with it, on any thread count."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType
from kernels import on_variant, replays

from kazeia_stream.engine import kquant_product, native, q8_product
from kazeia_stream.engine.ggml_graph import Allocator, ArrayTensor, Graph, products, view_of
from kazeia_stream.ggml_lib import quantize

# Q8_0: 200 x 96 has rows that fill no tile of 16 and an odd block count per row (3, no group of
# eight); 64 x 1024 an even one (32, four groups of eight); 40 x 352 a group of eight and three
# blocks beyond it. K-quants: one block a row, four, twelve. 200 rows fill no chunk of 64.
CASES = [(q8_product.KERNEL, shape) for shape in ((200, 96), (64, 1024), (40, 352))]
CASES += [
    (k, shape)
    for k in (kquant_product.Q4_K, kquant_product.Q5_K, kquant_product.Q6_K)
    for shape in ((200, 256), (64, 1024), (40, 3072))
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0].qtype.name}-{c[1][0]}x{c[1][1]}")
def weight(request):
    """(kernel, a weight [m, k] of its type (libggml's quantizer) as a ggml tensor over its
    bytes, (m, k)); skipped where the kernel was not built or the CPU lacks AVX2."""
    kernel, (m, k) = request.param
    if not kernel.variants():
        pytest.skip("the kernel is not built, or this CPU lacks AVX2")
    rng = np.random.default_rng(m)
    tensor = ArrayTensor(
        quantize(rng.standard_normal((m, k), dtype=np.float32), kernel.qtype), kernel.qtype, (m, k)
    )
    yield kernel, tensor.tensor, (m, k)
    tensor.close()


@pytest.fixture(params=native.VARIANTS)
def op(request, weight):
    """The weight's kernel on each variant (`on_variant`)."""
    return on_variant(weight[0], request.param)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_gives_ggml_s_products_to_float_rounding(weight, op, threads):
    _, w, shape = weight
    x = np.random.default_rng(1).standard_normal((9, shape[1]), dtype=np.float32)
    x[3] = 0.0  # a row whose blocks quantize to zeros
    ours, ggml = (products(w, x, Allocator(), threads, kernel) for kernel in (op, None))
    assert ours.shape == ggml.shape == (9, shape[0])
    assert np.abs(ours - ggml).max() <= 1e-6 * np.abs(ggml).max()
    assert not np.any(ours[3]) and np.all(np.any(ours, axis=1)[[0, 1, 2, 4]])


@pytest.mark.parametrize("variant", native.VARIANTS)
def test_a_q8_0_weight_of_minus_128_multiplies_as_ggml_s_does(variant):
    """ggml's quantizer writes weights in [-127, 127], but a Q8_0 block may hold -128 (another
    writer's file): its magnitude, 128, still fits the unsigned side of the AVX2 variant's
    products, and x signed by it is -x."""
    op = on_variant(q8_product.KERNEL, variant)
    rng = np.random.default_rng(5)
    m, k = 48, 256
    data = quantize(rng.standard_normal((m, k), dtype=np.float32), QType.Q8_0)
    values, size = GGML_QUANT_SIZES[QType.Q8_0]
    blocks = data.reshape(m, k // values, size)  # each block: an fp16 scale, then its int8
    blocks[:, :, 2::3] = np.uint8(0x80)  # every third weight -128
    tensor = ArrayTensor(data, QType.Q8_0, (m, k))
    try:
        x = rng.standard_normal((5, k), dtype=np.float32)
        x[1] = -np.abs(x[1])  # a row of negative values, signed by the weights
        ours, ggml = (products(tensor.tensor, x, Allocator(), 1, kernel) for kernel in (op, None))
        assert np.abs(ours - ggml).max() <= 1e-6 * np.abs(ggml).max()
    finally:
        tensor.close()


def test_a_row_s_numbers_do_not_depend_on_the_rows_beside_it_or_the_threads(weight, op):
    _, w, shape = weight
    x = np.random.default_rng(2).standard_normal((9, shape[1]), dtype=np.float32)
    alone = np.concatenate([products(w, x[i : i + 1], Allocator(), 1, op) for i in range(len(x))])
    for count in (2, 4, 5, 9):
        for threads in (1, 2):
            assert np.array_equal(products(w, x[:count], Allocator(), threads, op), alone[:count])


@pytest.mark.parametrize("threads", [1, 2])
def test_a_norm_and_a_residual_in_the_operation_give_ggml_s_operations_numbers(weight, op, threads):
    """A product that RMS-norms its rows first and adds a residual after (a layer's q, k, v,
    gate and up; its o and down) gives, bit for bit, the numbers of ggml's rms_norm, mul and
    add around the product."""
    _, w, (m, k) = weight
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, k), dtype=np.float32) * rng.uniform(0.1, 30, (5, 1)).astype(np.float32)
    allocator, g = Allocator(), Graph(16)
    try:
        columns, scale = g.input(QType.F32, (5, k)), g.input(QType.F32, (k,))
        residual = g.input(QType.F32, (5, m))
        inside = g.output(op(g, w, columns, norm=(scale, 1e-6), residual=residual))
        apart = g.output(g.add(residual, op(g, w, g.mul(g.rms_norm(columns, 1e-6), scale))))
        g.allocate(allocator)
        view_of(columns, QType.F32, (5, k))[...] = x
        view_of(scale, QType.F32, (k,))[...] = rng.standard_normal(k, dtype=np.float32)
        view_of(residual, QType.F32, (5, m))[...] = rng.standard_normal((5, m), dtype=np.float32)
        g.compute(threads)
        assert np.array_equal(view_of(inside, QType.F32, (5, m)), view_of(apart, QType.F32, (5, m)))
        assert np.any(view_of(inside, QType.F32, (5, m)))
    finally:
        g.close()
        allocator.close()


@pytest.mark.parametrize("variant", native.VARIANTS)
@pytest.mark.parametrize("threads", [1, 2])
def test_one_operation_of_several_matrices_gives_each_one_s_numbers(weight, variant, threads):
    """A layer's q, k and v (or its gate and up) in one operation, x normed and quantized once:
    each matrix's block holds, bit for bit, the numbers of its own product; the blocks' rows
    (the second's 72 from m on) fall across the threads' chunks of 64."""
    kernel, w, (m, k) = weight
    if variant not in kernel.variants():
        pytest.skip(f"this CPU does not run the {variant} variant")
    rng = np.random.default_rng(7)
    rows = (m, 72, 40)
    others = [
        ArrayTensor(
            quantize(rng.standard_normal((r, k), dtype=np.float32), kernel.qtype), kernel.qtype, (r, k)
        )
        for r in rows[1:]
    ]
    ws = [w, *(o.tensor for o in others)]
    allocator, g = Allocator(), Graph(32)
    try:
        columns, scale = g.input(QType.F32, (5, k)), g.input(QType.F32, (k,))
        fused = [g.output(t) for t in kernel.products(g, ws, columns, (scale, 1e-6), variant)]
        alone = [g.output(kernel.product(g, wi, columns, variant, norm=(scale, 1e-6))) for wi in ws]
        g.allocate(allocator)
        view_of(columns, QType.F32, (5, k))[...] = rng.standard_normal((5, k), dtype=np.float32)
        view_of(scale, QType.F32, (k,))[...] = rng.standard_normal(k, dtype=np.float32)
        g.compute(threads)
        for a, b, out in zip(fused, alone, rows):
            assert np.array_equal(view_of(a, QType.F32, (5, out)), view_of(b, QType.F32, (5, out)))
            assert np.all(np.any(view_of(a, QType.F32, (5, out)), axis=1))
    finally:
        g.close()
        allocator.close()
        for o in others:
            o.close()


def test_the_variants_differ_by_float_rounding_only(weight):
    """They quantize the rows alike; only the order of the float sums differs."""
    kernel, w, shape = weight
    if len(kernel.variants()) < 2:
        pytest.skip("this CPU runs one variant")
    x = np.random.default_rng(4).standard_normal((5, shape[1]), dtype=np.float32)
    a, *others = (
        products(w, x, Allocator(), 1, partial(kernel.product, variant=v)) for v in kernel.variants()
    )
    for b in others:
        assert np.abs(a - b).max() <= 1e-6 * np.abs(a).max()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(200, 96), (64, 1024), (40, 352), (48, 3072)])
def test_amx_s_tiles_give_the_avx512_variant_s_numbers_bit_for_bit(shape, threads):
    """AMX's tiles take three or four rows of x at a time, whole tiles of 16 weight rows, and the
    blocks beyond the last group of eight as any other; their sums in the AVX512 variant's
    order, so that a stream's numbers are the same beside any others and on either."""
    if "amx" not in q8_product.KERNEL.variants():
        pytest.skip("this CPU has no AMX")
    rng = np.random.default_rng(6)
    w = ArrayTensor(quantize(rng.standard_normal(shape, dtype=np.float32), QType.Q8_0), QType.Q8_0, shape)
    x = rng.standard_normal((11, shape[1]), dtype=np.float32)
    try:
        amx, avx512 = (
            products(w.tensor, x, Allocator(), threads, partial(q8_product.KERNEL.product, variant=v))
            for v in ("amx", "avx512")
        )
    finally:
        w.close()
    assert np.array_equal(amx, avx512) and np.all(np.any(amx, axis=1))


def test_every_replay_computes_every_row_on_any_thread_count(weight, op):
    """The threads take the weight rows in chunks from shares of the operation's own, which
    the last thread to finish sets back for the next replay: a share left over would leave
    rows unwritten (NaN here) in the next."""
    _, w, shape = weight
    x = np.random.default_rng(5).standard_normal((3, shape[1]), dtype=np.float32)
    expected = products(w, x, Allocator(), 1, op)
    for replay in replays(w, shape, op, x, [1, 2, 2, 1, 2, 1, 1, 2]):
        for y in replay:
            assert np.array_equal(y, expected)


def test_the_engines_multiply_each_type_on_its_kernel(monkeypatch):
    """A Q8_0 weight goes to q8_product's kernel, Q4_K, Q5_K and Q6_K ones to kquant_product's,
    others (a Q3_K one) to ggml's; none to a kernel turned off."""
    from kazeia_stream.engine import qwen3

    rows = np.random.default_rng(8).standard_normal((32, 256), dtype=np.float32)
    kernels = [q8_product.KERNEL, kquant_product.Q4_K, kquant_product.Q5_K, kquant_product.Q6_K]
    weights = {
        t: ArrayTensor(quantize(rows, t), t, (32, 256)) for t in [k.qtype for k in kernels] + [QType.Q3_K]
    }
    for kernel in kernels:
        if kernel.available():
            assert qwen3.product_kernel(weights[kernel.qtype].tensor) is kernel
    assert qwen3.product_kernel(weights[QType.Q3_K].tensor) is None
    monkeypatch.setenv(kquant_product.ENV, "0")
    for kernel in kernels[1:]:
        kernel.chosen.cache_clear()
    try:
        for kernel in kernels[1:]:
            assert qwen3.product_kernel(weights[kernel.qtype].tensor) is None
    finally:
        monkeypatch.undo()
        for kernel in kernels[1:]:
            kernel.chosen.cache_clear()
