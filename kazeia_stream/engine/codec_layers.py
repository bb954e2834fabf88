"""The codec decoder's layers around its transformer: activations, causal convolutions that
carry their context from one call to the next (`ContextBuffer`; a transposed convolution its
tail), the blocks made of them, and how each reads its weights from the mmproj GGUF. A layer
holds weights only; its state is an object of its own (`new_state()`). Activations are
channel-major, [channels, time * streams], stream index fastest, so that a convolution's tap is
one column view of its context buffer, which the producer writes into directly, and each
product reads its weights once for all the streams.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from ..model import gguf_layout as L
from ..model.gguf_file import GGUFFile
from . import snake, winograd
from .matrix import F32, Matrix, float32
from .overlap_add import overlap_add
from .weight_cache import UNSAVED, WeightCache

LAYER_NORM_EPS = 1e-6  # the ConvNeXt blocks' LayerNorm (hard-coded upstream)
DILATIONS = (1, 3, 9)  # residual units of each decoder block (hard-coded upstream)


def _erf(x: np.ndarray) -> np.ndarray:
    """erf in float32 to a few ulp: Eigen's rational approximation on [-4, 4] (outside,
    erf is +-1 in float32). numpy has no erf and scipy is not a dependency."""
    x = np.clip(x, -4.0, 4.0)
    x2 = x * x
    p = x2 * F32(-2.72614225801306e-10) + F32(2.77068142495902e-08)
    for c in (
        -2.10102402082508e-06,
        -5.69250639462346e-05,
        -7.34990630326855e-04,
        -2.95459980854025e-03,
        -1.60960333262415e-02,
    ):
        p *= x2
        p += F32(c)
    p *= x
    q = x2 * F32(-1.45660718464996e-05) + F32(-2.13374055278905e-04)
    for c in (-1.68282697438203e-03, -7.37332916720468e-03, -1.42647390514189e-02):
        q *= x2
        q += F32(c)
    p /= q
    return p


def gelu(x: np.ndarray) -> np.ndarray:
    """Exact (erf) GELU, in place."""
    e = _erf(x * F32(0.7071067811865476))
    e += F32(1.0)
    x *= F32(0.5)
    x *= e
    return x


def sum_squares(x: np.ndarray) -> np.ndarray:
    """The sum of squares over the channels of [C, n], per column, added in one order whatever
    n: numpy sums a lone contiguous column its own way (pairwise), so one column is summed as
    two copies."""
    n = x.shape[1]
    if n == 1:
        x = np.repeat(x, 2, axis=1)
    return np.einsum("ij,ij->j", x, x)[:n]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the channels of [C, n]; weight [C, 1]."""
    var = sum_squares(x) / F32(x.shape[0])
    return x * (F32(1.0) / np.sqrt(var + F32(eps))) * weight


class SnakeBeta:
    """y = x + beta * sin(alpha * x)^2 per channel; alpha and beta come folded from the GGUF.
    On our kernel where it runs (`snake`), else on numpy; x of strided columns (one stream's
    of several) is copied first, so that a stream's numbers are the same alone or not."""

    def __init__(self, alpha: np.ndarray, beta: np.ndarray) -> None:
        self.alpha, self.beta = alpha.astype(F32)[:, None], beta.astype(F32)[:, None]

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if snake.variants():
            x = x if x.strides[1] == 4 else np.ascontiguousarray(x)
            return snake.snake(x, self.alpha, self.beta, np.empty_like(x) if out is None else out)
        t = np.multiply(x, self.alpha)
        np.sin(t, out=t)
        np.multiply(t, t, out=t)
        np.multiply(t, self.beta, out=t)
        return np.add(x, t, out=out)


class Linear:
    """y = W x + b on [C_in, n]; W [C_out, C_in]."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None = None) -> None:
        self.w = Matrix(weight)
        self.b = None if bias is None else bias.astype(F32)[:, None]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = self.w(x)
        if self.b is not None:
            y += self.b
        return y


class ContextBuffer:
    """A causal convolution's state and input for S streams (one utterance's: S = 1),
    [C, (context + n) * S], stream index fastest: `context` time steps of left context (the
    previous inputs; zeros at the start of an utterance), then the n new ones. The producer
    writes them into `input(n * S)`; after the layer ran, `advance(n * S)` keeps the last
    `context` time steps. A tap shifted by j time steps is the column view shifted by j * S."""

    def __init__(self, context: int, channels: int, streams: int = 1) -> None:
        self.context, self.channels, self.streams = context, channels, streams
        self.width = context * streams  # columns of context
        self.buf = np.zeros((channels, self.width), F32)

    def input(self, cols: int) -> np.ndarray:
        if self.buf.shape[1] != self.width + cols:
            buf = np.empty((self.channels, self.width + cols), F32)
            buf[:, : self.width] = self.buf[:, : self.width]
            self.buf = buf
        return self.buf[:, self.width :]

    def advance(self, cols: int) -> None:
        if self.width:
            self.buf[:, : self.width] = self.buf[:, cols:]  # numpy copes with the overlap

    @classmethod
    def stack(cls, parts: Sequence[ContextBuffer]) -> ContextBuffer:
        """One buffer for the streams of `parts` (one each): a copy of their contexts."""
        first = parts[0]
        stacked = cls(first.context, first.channels, len(parts))
        view = stacked.buf.reshape(first.channels, first.context, len(parts))
        np.stack([p.buf[:, : p.width] for p in parts], axis=2, out=view)
        return stacked

    def unstack(self, parts: Sequence[ContextBuffer]) -> None:
        """Copy each stream's context back to its own buffer in `parts`."""
        view = self.buf[:, : self.width].reshape(self.channels, self.context, self.streams)
        for s, part in enumerate(parts):
            part.buf[:, : part.width] = view[:, :, s]


class CausalConv:
    """Causal Conv1d, stride 1, left-padded by (k - 1) * dilation; weight [C_out, C_in, k].

    y = b + W [C_out, C_in * k] X, one product with the weight as the file holds it (in place),
    over X [C_in * k, n * S] gathered from the context buffer of S streams: row c * k + j is
    channel c shifted by j * d time steps (im2col). Once `split`, y = b + sum_j W_j X_j instead:
    one product per tap, on a copy of its weight, reading the shifted buffer in place (for many
    columns, where gathering X costs more: `SPLIT_COLUMNS`). Once `tile`d, in Winograd's F(m,
    7) (`winograd`, m `outputs`): m + 6 products of 1/m of the columns each, between two
    transforms of ours, its tiles planned frame by frame (`frame_columns` a stream's columns a
    frame)."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray, dilation: int = 1) -> None:
        c_out, c_in, k = weight.shape
        self.k, self.dilation = k, dilation
        self.products = [Matrix(weight.reshape(c_out, c_in * k))]  # W, the W_j, or the U_k
        self.bias = bias.astype(F32)[:, None]
        self.context, self.c_in = (k - 1) * dilation, c_in
        self.method = "gathered"  # "taps" once `split`, "winograd" once `tile`d
        self.frame_columns = 0
        self._winograd: winograd.Products | None = None  # the products as winograd.c takes them

    def split(self) -> None:
        """Multiply tap by tap from now on (the weight in place is let go)."""
        if self.k > 1 and self.method == "gathered":
            weight = self.products[0].array.reshape(-1, self.c_in, self.k)
            self.products = [Matrix(weight[:, :, j]) for j in range(self.k)]
            self.method = "taps"

    def tile(self, frame_columns: int, cache: WeightCache = UNSAVED) -> None:
        """Multiply in Winograd's F(m, 7) from now on, where it runs (7 taps, our kernel built),
        m the tiling with the fewest multiply-adds for `frame_columns` columns a frame
        (`winograd.fewest`): 2/7 of the direct products' in F(6, 7), 5/14 in F(4, 7), within
        float rounding of them. The transformed weights only matter packed (`cache`: where it
        holds those, they are not computed)."""
        if self.k != winograd.TAPS or not winograd.available() or self.method != "gathered":
            return
        self.frame_columns = frame_columns
        m = winograd.fewest(frame_columns, self.dilation)
        weight = self.products[0].array
        shape = (winograd.size(m), weight.shape[0], self.c_in)
        make = lambda: winograd.kernel_weights(float32(weight).reshape(-1, self.c_in, self.k), m)
        u = cache.interim(shape, np.dtype(F32), make)
        self.products = [Matrix(u_k, column_major=True) for u_k in u]
        self.method = "winograd"
        winograd.float32_matrices(m)  # the transforms' matrices made now, not in the first frame

    @property
    def outputs(self) -> int:
        """The tile's outputs m once `tile`d (its m + 6 products), else 0."""
        return len(self.products) - winograd.TAPS + 1 if self.method == "winograd" else 0

    def _tiled(self) -> winograd.Products:
        """The products of `tile` as our kernels take them, once the load has placed the
        weights (`Matrix.multiply_directly`: in panels)."""
        if self._winograd is None:
            first, weights = self.products[0], [m.array for m in self.products]
            assert first.variant is not None and first.panels, "Winograd's products run on our kernel"
            self._winograd = winograd.Products.of(weights, first.shape, first.variant, self.outputs)
        return self._winograd

    def calls(self, n: int) -> Iterator[tuple[Matrix, int]]:
        """The products of a call on n columns, in order: (weight, columns it multiplies)."""
        if self.method != "winograd":
            yield from ((m, n) for m in self.products)
            return
        for chunk in winograd.chunks(n, self.dilation, self.outputs, self.frame_columns):
            yield from ((m, chunk.tiles) for m in self.products)

    def new_state(self) -> ContextBuffer:
        return ContextBuffer(self.context, self.c_in)

    def run(self, state: ContextBuffer, n: int) -> np.ndarray:
        """The output for the n columns written into `state.input(n)`."""
        buf, d, products = state.buf, self.dilation * state.streams, self.products
        if self.method == "winograd":
            y, frame = np.empty((len(self.bias), n), F32), self.frame_columns * state.streams
            winograd.convolve(buf, n, d, frame, self._tiled(), self.bias[:, 0], y)
            state.advance(n)
            return y
        if self.k == 1:
            y = products[0](buf[:, :n])
        elif self.method == "taps":
            y = products[0](buf[:, 0:n])
            t = np.empty_like(y)
            for j in range(1, self.k):
                products[j](buf[:, j * d : j * d + n], out=t)
                y += t
        else:  # gathered column by column: ggml's kernels take X's columns as rows
            x = np.empty((n, self.c_in, self.k), F32)
            for j in range(self.k):
                x[:, :, j] = buf[:, j * d : j * d + n].T
            y = products[0](x.reshape(n, self.c_in * self.k).T)
        y += self.bias
        state.advance(n)
        return y

    def __call__(self, state: ContextBuffer, x: np.ndarray) -> np.ndarray:
        state.input(x.shape[1])[...] = x
        return self.run(state, x.shape[1])


class DepthwiseCausalConv:
    """Causal depthwise Conv1d (groups = channels); weight [C, 1, k]."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray) -> None:
        c, _, k = weight.shape
        self.k = k
        self.taps = np.ascontiguousarray(weight[:, 0, :].T, dtype=F32)[:, :, None]  # [k, C, 1]
        self.bias = bias.astype(F32)[:, None]
        self.channels = c

    def new_state(self) -> ContextBuffer:
        return ContextBuffer(self.k - 1, self.channels)

    def __call__(self, state: ContextBuffer, x: np.ndarray) -> np.ndarray:
        n, s = x.shape[1], state.streams
        state.input(n)[...] = x
        buf = state.buf
        y = buf[:, 0:n] * self.taps[0]
        for j in range(1, self.k):
            y += buf[:, j * s : j * s + n] * self.taps[j]
        y += self.bias
        state.advance(n)
        return y


class CausalTransConv:
    """ConvTranspose1d(k, stride s) with the (k - s) last samples trimmed on the right, as the
    official CausalTransConvNet: n input time steps give n * s output time steps. Weight
    [C_in, C_out, k].

    One sgemm [C_out * k, C_in] x [C_in, n * S] (S streams; the left one the stored weight's
    2-D transpose, copied once) gives Z[:, m, t], the contribution of input t to output t * s + m; then
    an overlap-add (`overlap_add`): output t * s + m = Z[m, t] (m < s) + Z[s + m, t - 1] (m < k - s).
    Z[:, s:, last t], the tail [k - s, C_out, S], is the state carried into the next call."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray, stride: int) -> None:
        c_in, c_out, k = weight.shape
        if not stride <= k <= 2 * stride:
            raise ValueError(f"transposed conv kernel {k} with stride {stride} is not supported")
        self.k, self.s, self.c_out = k, stride, c_out
        # a copy: the transposed view as the left operand measured ~15% slower per frame
        self.w = Matrix(weight.reshape(c_in, c_out * k).T)
        self.bias = bias.astype(F32)[:, None, None]

    def new_state(self) -> np.ndarray:
        return np.zeros((self.k - self.s, self.c_out, 1), F32)

    def __call__(self, tail: np.ndarray, x: np.ndarray) -> np.ndarray:
        streams = tail.shape[2]
        z = self.w(x).reshape(self.c_out, self.k, x.shape[1] // streams, streams)
        return overlap_add(z, self.bias, tail, self.s)


class ConvNeXtBlock:
    """x + gamma * pw2(gelu(pw1(LayerNorm(dwconv(x)))))."""

    def __init__(self, f: GGUFFile, bid: int) -> None:
        self.dwconv = DepthwiseCausalConv(*read_conv(f, L.WAV_UP_DWCONV.format(bid=bid)))
        norm_w, norm_b = read_pair(f, L.WAV_UP_NORM.format(bid=bid))
        self.norm_w, self.norm_b = norm_w[:, None], norm_b[:, None]
        self.pw1 = Linear(*read_kernel(f, L.WAV_UP_PW1.format(bid=bid)))
        self.pw2 = Linear(*read_kernel(f, L.WAV_UP_PW2.format(bid=bid)))
        self.gamma = f.read(L.WAV_UP_GAMMA.format(bid=bid))[:, None]

    def new_state(self) -> ContextBuffer:
        return self.dwconv.new_state()

    def __call__(self, state: ContextBuffer, x: np.ndarray) -> np.ndarray:
        h = self.dwconv(state, x)
        h -= h.mean(axis=0)
        var = sum_squares(h) / F32(h.shape[0])
        h *= F32(1.0) / np.sqrt(var + F32(LAYER_NORM_EPS))
        h *= self.norm_w
        h += self.norm_b
        h = self.pw2(gelu(self.pw1(h)))
        h *= self.gamma
        h += x
        return h


class ResidualUnit:
    """x + conv2(snake2(conv1(snake1(x)))), conv1 k=7 with a dilation, conv2 k=1."""

    def __init__(self, f: GGUFFile, bid: int, xid: int, dilation: int) -> None:
        ids = {"bid": bid, "xid": xid}
        self.act1 = SnakeBeta(*read_snake(f, L.WAV_DAC_RES_ACT1.format(**ids)))
        self.conv1 = CausalConv(*read_conv(f, L.WAV_DAC_RES_CONV1.format(**ids)), dilation=dilation)
        self.act2 = SnakeBeta(*read_snake(f, L.WAV_DAC_RES_ACT2.format(**ids)))
        self.conv2 = CausalConv(*read_conv(f, L.WAV_DAC_RES_CONV2.format(**ids)))

    def new_state(self) -> tuple[ContextBuffer, ContextBuffer]:
        return self.conv1.new_state(), self.conv2.new_state()

    def __call__(self, state: tuple[ContextBuffer, ContextBuffer], x: np.ndarray) -> np.ndarray:
        n = x.shape[1]
        s1, s2 = state
        self.act1(x, out=s1.input(n))
        h = self.conv1.run(s1, n)
        self.act2(h, out=s2.input(n))
        y = self.conv2.run(s2, n)
        y += x
        return y


class DecoderBlock:
    """SnakeBeta, CausalTransConv(k = 2 * rate, stride rate), three residual units."""

    def __init__(self, f: GGUFFile, bid: int) -> None:
        self.act = SnakeBeta(*read_snake(f, L.WAV_DAC_UP_SNAKE.format(bid=bid)))
        w, b = read_kernel(f, L.WAV_DAC_UP_CONV.format(bid=bid))
        w = w.reshape(-1, len(b), w.shape[-1])
        self.up = CausalTransConv(w, b, stride=w.shape[-1] // 2)
        self.units = [ResidualUnit(f, bid, xid, d) for xid, d in enumerate(DILATIONS)]

    @property
    def convs(self) -> list[CausalConv]:
        """Its residual units' convolutions, in order."""
        return [conv for unit in self.units for conv in (unit.conv1, unit.conv2)]

    def new_state(self) -> tuple[np.ndarray, list[tuple[ContextBuffer, ContextBuffer]]]:
        return self.up.new_state(), [unit.new_state() for unit in self.units]

    def __call__(
        self, state: tuple[np.ndarray, list[tuple[ContextBuffer, ContextBuffer]]], x: np.ndarray
    ) -> np.ndarray:
        tail, units = state
        h = self.up(tail, self.act(x))
        for unit, unit_state in zip(self.units, units):
            h = unit(unit_state, h)
        return h


def read_pair(f: GGUFFile, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    return f.read(prefix + ".weight"), f.read(prefix + ".bias")


def read_kernel(f: GGUFFile, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """A weight, mapped (float16 where the file stores it so: see `Matrix`), and its bias. The
    layer uses the weight in place where its layout is the file's; else it copies it into its
    own, reading the mapping once (fresh memory is slow to fault in, 0.3-2 GB/s on the hosts
    measured, so every copy costs startup)."""
    return f.weight(prefix + ".weight"), f.read(prefix + ".bias")


def read_conv(f: GGUFFile, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """A Conv1d kernel [C_out, C_in, k] and its bias; C_out from the bias, since the GGUF shape
    drops a leading 1 (the last conv's C_out)."""
    w, b = read_kernel(f, prefix)
    return w.reshape(len(b), -1, w.shape[-1]), b


def read_snake(f: GGUFFile, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    return f.read(prefix + ".alpha"), f.read(prefix + ".beta")


def count_blocks(f: GGUFFile, pattern: str) -> int:
    n = 0
    while f.has_tensor(pattern.format(bid=n) + ".weight") or f.has_tensor(pattern.format(bid=n)):
        n += 1
    return n
