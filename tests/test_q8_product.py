"""What only our Q8_0 product kernel has (each variant this CPU runs): strided columns, its
claims of weight rows, stacks of matrices, a file's weights; what it shares with the Q4_K
kernel (ggml's products to float rounding, a row's numbers whatever rows come with it) is
tested in test_quantized_products.py."""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf.quants import quantize
from kernels import on_each_variant, replays

from kazeia_stream.engine import native, q8_product
from kazeia_stream.engine.ggml_graph import (
    Allocator,
    ArrayTensor,
    Graph,
    _Claims,
    dims,
    products,
    type_of,
    view_of,
)

pytestmark, op = on_each_variant(q8_product.KERNEL)


@pytest.fixture(scope="module", params=[(200, 96), (64, 1024), (40, 352)], ids=lambda s: f"{s[0]}x{s[1]}")
def weight(request):
    """A Q8_0 weight [m, k] as a ggml tensor over its bytes: 200 x 96 has rows that fill no
    tile of 16 and an odd block count per row (3, no group of eight); 64 x 1024 an even one (32,
    four groups of eight); 40 x 352 a group of eight and three blocks beyond it."""
    m, k = request.param
    rng = np.random.default_rng(m)
    data = quantize(rng.standard_normal((m, k), dtype=np.float32), QType.Q8_0)
    tensor = ArrayTensor(data, QType.Q8_0, (m, k))
    yield tensor.tensor, (m, k)
    tensor.close()


def test_columns_of_strided_elements_are_made_contiguous_first(weight, op):
    """A transposed input (each column's numbers 16 bytes apart), as a graph may hand it."""
    w, (m, k) = weight
    x = np.random.default_rng(3).standard_normal((4, k), dtype=np.float32)
    allocator, g = Allocator(), Graph(8)
    try:
        transposed = g.input(QType.F32, (k, 4))  # ggml [4, k]: the columns' numbers interleaved
        y = g.output(op(g, w, g.permute(transposed, 1, 0, 2, 3)))
        g.allocate(allocator)
        view_of(transposed, QType.F32, (k, 4))[...] = x.T
        g.compute(1)
        got = view_of(y, QType.F32, (4, m)).copy()
    finally:
        g.close()
        allocator.close()
    assert np.array_equal(got, products(w, x, Allocator(), 1, op))


def test_the_claims_the_graph_allocates_are_the_kernel_s_size():
    size = native.library("q8_product").kz_q8_product_claims_size
    size.restype = ctypes.c_size_t
    assert ctypes.sizeof(_Claims) == size()


def test_a_thread_held_back_leaves_its_share_to_the_others(weight, op):
    """Each thread takes its own contiguous share of the rows first, then the others' from
    their backs: one thread of three, the two others not yet begun, computes every row, and
    the next run begins afresh once all three found none left."""
    w, (m, k) = weight
    x = np.random.default_rng(7).standard_normal((2, k), dtype=np.float32)
    expected = products(w, x, Allocator(), 1, op)
    body = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p)(
        native.address("q8_product", op.keywords["variant"])
    )
    allocator, g, claims = Allocator(), Graph(8), _Claims()
    try:
        columns = g.input(QType.F32, (len(x), k))
        y = g.output(op(g, w, columns))
        g.allocate(allocator)
        view_of(columns, QType.F32, (len(x), k))[...] = x
        for run in range(2):
            view_of(y, QType.F32, (len(x), m))[...] = np.nan
            for ith in (run, (run + 1) % 3, (run + 2) % 3):  # the first alone does all the rows
                body(y, ith, 3, ctypes.addressof(claims))
                assert np.array_equal(view_of(y, QType.F32, (len(x), m)), expected)
        assert claims.done == 0 and not any(claims.shares)
    finally:
        g.close()
        allocator.close()


def test_graphs_replayed_at_once_in_two_threads_do_not_share_their_counts(weight, op):
    w, shape = weight
    x = np.random.default_rng(6).standard_normal((2, shape[1]), dtype=np.float32)
    expected = products(w, x, Allocator(), 1, op)
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda n: replays(w, shape, op, x, [n] * 200), [1, 2]))
    for run in runs:
        for replay in run:
            for y in replay:
                assert np.array_equal(y, expected)


def test_it_can_be_turned_off_or_held_to_avx2(q8_kernel):
    q8_kernel("0")
    assert not q8_product.KERNEL.available() and q8_product.KERNEL.chosen() is None
    q8_kernel("avx2")
    assert q8_product.KERNEL.chosen() == "avx2"


def test_a_q8_0_file_s_weights_go_to_the_kernel(tiny_runtime):
    """Every Q8_0 matrix of the talker and the code predictor, and the code predictor's stack
    of heads (applied by index)."""
    runtime = tiny_runtime("custom_voice", "q8_0")
    stacks = 0
    for lm in (runtime.talker.lm, runtime.code_predictor.lm):
        q8 = [w for w in lm.weights.tensors.values() if type_of(w) == QType.Q8_0]
        assert q8 and all(q8_product.KERNEL.takes(w) for w in q8)
        stacks += sum(dims(w)[2] > 1 for w in q8)
    assert stacks == 1


def test_a_stack_s_columns_each_take_their_matrix(op):
    """Columns that name matrices of a stack (the code predictor's heads, several streams in
    one product): ggml's mul_mat_id's numbers to float rounding, and each column bit for bit
    its numbers by its matrix alone, whatever matrices the columns beside it take."""
    (count, m, k), rng = (3, 70, 96), np.random.default_rng(7)
    data = quantize(rng.standard_normal((count, m, k), dtype=np.float32), QType.Q8_0)
    stack = ArrayTensor(data, QType.Q8_0, (count, m, k))
    matrices = [ArrayTensor(np.ascontiguousarray(data[i]), QType.Q8_0, (m, k)) for i in range(count)]
    x = rng.standard_normal((9, k), dtype=np.float32)
    ids = np.array([2, 0, 0, 1, 2, 2, 2, 2, 1], np.int32)

    def run(product):
        allocator, g = Allocator(), Graph(8)
        try:
            columns, index = g.input(QType.F32, (len(x), k)), g.input(QType.I32, (len(x), 1))
            y = g.output(product(g, columns, index))
            g.allocate(allocator)
            view_of(columns, QType.F32, (len(x), k))[...] = x
            view_of(index, QType.I32, (len(x),))[...] = ids
            g.compute(2)
            return view_of(y, QType.F32, (len(x), m)).copy()
        finally:
            g.close()
            allocator.close()

    ours = run(lambda g, columns, index: op(g, stack.tensor, columns, ids=index))
    ggml = run(
        lambda g, columns, index: g.reshape(
            g.mul_mat_id(stack.tensor, g.reshape(columns, k, 1, len(x)), index), m, len(x)
        )
    )
    assert np.abs(ours - ggml).max() <= 1e-6 * np.abs(ggml).max()
    for i, matrix in enumerate(ids):
        assert np.array_equal(ours[i], products(matrices[matrix].tensor, x[i : i + 1], Allocator(), 1, op)[0])
    for tensor in (stack, *matrices):
        tensor.close()
