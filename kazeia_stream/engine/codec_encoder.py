"""The codec encoder: 24 kHz audio -> 16 codes per 80 ms frame, the reference codes of in-context
(ICL) voice cloning.

A Base model clones a voice in ICL mode by putting the reference recording's codes in the
talker's prompt. The official code gets them from the speech tokenizer's encoder
(`Qwen3TTSTokenizerV2Encoder`: transformers' `MimiModel` without its decoder), which llama.cpp
does not convert. It runs once per voice, so this is plain numpy float32, one shot over the whole
clip (not streaming), written to give the official codes:

- SEANet: Mimi's causal convolutions (left pad (k - 1) * dilation + 1 - stride, right pad up to
  a whole number of strides, with the config's `pad_mode`: zeros), ELU, residual blocks
  x + conv2(elu(conv1(elu(x)))), one strided conv per ratio (the reversed upsampling_ratios),
  ELU, the last conv; 24 kHz -> 25 Hz;
- the transformer: x += ls1 * attn(LayerNorm(x)), x += ls2 * fc2(gelu(fc1(LayerNorm(x)))), with
  NeoX RoPE and causal attention;
- the downsample conv (stride 2 with replicate padding, as MimiModel fixes it): -> 12.5 Hz;
- the split RVQ: the semantic and the acoustic quantizers each project the same embeddings, then
  codebook after codebook take the nearest entry of the residual and subtract it; distances as
  torch.cdist computes them (sqrt(max(|x|^2 - 2 x.e + |e|^2, 0)), the first index on a tie).
  The first `valid_num_quantizers` codes are kept (semantic first), and the frames are trimmed
  to ceil(samples / frame_size), as `Qwen3TTSTokenizerV2Model.encode` does.

The sliding window: the config says 250 frames (10 s), but transformers 4.57 (which qwen-tts
pins) builds this transformer's mask with `create_causal_mask`, which ignores it, so with the
default sdpa attention (and eager) every frame sees all the earlier ones; only its
flash_attention_2 path applies the window (checked on a 13 s clip: 92 codes differ with it).
`encode` matches the default.

Layout and speed: activations are channel-major, [channels, time] float32; a convolution is a few
sgemms on numpy's BLAS (one per tap on a shifted view of the padded input for stride 1, one per
stride-long phase of the kernel for strided ones, over a copy of the input regrouped by phase);
a narrow stride-1 conv (the first, on the samples) is one sgemm over an im2col copy instead. A
10 s clip takes about 0.6 s on the 0.6B's encoder (2 cores; 0.9 s on one; `kazeia-stream voice
create ... -v` logs the time of a voice).

Weights come from the mmproj of a Base model converted by our converter (`kazeia.enc.*` and
`kazeia.codec_encoder.*`, see gguf_layout): every width and count is read from the tensor shapes
and the metadata, so the tiny test models run through the same code as the real ones.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from threadpoolctl import ThreadpoolController

from ..errors import ModelFileError
from ..model import gguf_layout as L
from ..model.gguf_file import GGUFFile
from .codec_layers import Linear, gelu
from .codec_transformer import rope

F32 = np.float32
# np.pad modes of Mimi's pad modes (MimiConv1d._pad1d: torch.nn.functional.pad).
PAD_MODES = {"constant": "constant", "replicate": "edge"}
QUERY_BLOCK = 512  # attention rows computed at once: bounds the [heads, rows, T] scores
# A stride-1 conv with at most this many input values per output column (C_in * k) runs as one
# sgemm over an im2col copy: per-tap sgemms would be outer products (the first conv, C_in = 1,
# took 13x longer on a 10 s clip).
IM2COL_MAX_ROWS = 64


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


def _elu(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """ELU (alpha 1) into `out`: expm1(min(x, 0)) + max(x, 0), which is torch's
    x > 0 ? x : expm1(x) exactly (one of the two terms is 0)."""
    np.minimum(x, F32(0.0), out=out)
    np.expm1(out, out=out)
    out += np.maximum(x, F32(0.0))
    return out


class CausalConv:
    """MimiConv1d with use_causal_conv: pad (k - 1) * dilation + 1 - stride columns on the left
    and, on the right, up to a whole number of strides; then Conv1d. L input columns give
    ceil(L / stride). Weight [C_out, C_in, k]."""

    def __init__(
        self,
        weight: np.ndarray,
        bias: np.ndarray | None,
        stride: int = 1,
        dilation: int = 1,
        pad_mode: str = "constant",
    ) -> None:
        c_out, c_in, k = weight.shape
        if stride > 1 and dilation > 1:
            raise ValueError("a strided convolution with a dilation is not supported")
        self.c_in, self.c_out, self.k, self.stride, self.dilation = c_in, c_out, k, stride, dilation
        self.pad_left = (k - 1) * dilation + 1 - stride
        if self.pad_left < 0:
            raise ValueError(f"kernel {k} shorter than its stride {stride}")
        self.pad_mode = PAD_MODES[pad_mode]
        self.bias = None if bias is None else bias.astype(F32)[:, None]
        self.im2col = stride == 1 and dilation == 1 and c_in * k <= IM2COL_MAX_ROWS
        if self.im2col:
            self.taps = np.ascontiguousarray(weight.reshape(1, c_out, c_in * k), dtype=F32)
        elif stride == 1:
            self.taps = np.ascontiguousarray(weight.transpose(2, 0, 1), dtype=F32)  # [k, C_out, C_in]
        else:
            # phases[j][o, c * s + r] = W[o, c, j * s + r] (zero past k): output t is
            # sum_j phases[j] @ P[:, t + j], where P[c * s + r, f] = x_padded[c, f * s + r]
            m = -(-k // stride)
            w = np.zeros((c_out, c_in, m * stride), F32)
            w[:, :, :k] = weight
            w = w.reshape(c_out, c_in, m, stride).transpose(2, 0, 1, 3)
            self.taps = np.ascontiguousarray(w.reshape(m, c_out, c_in * stride))

    def __call__(self, x: np.ndarray, elu: bool = False) -> np.ndarray:
        """conv(x), or conv(elu(x)): the activation is written into the padded buffer."""
        c, length = x.shape
        s, left = self.stride, self.pad_left
        n = -(-length // s)
        m = self.taps.shape[0] if s > 1 else 1
        # the padded input, plus (strided) zero columns up to whole phases, which meet zero weights
        buf = np.empty((c, left + n if s == 1 else (n + m - 1) * s), F32)
        mid = buf[:, left : left + length]
        if elu:
            _elu(x, out=mid)
        else:
            mid[...] = x
        right = n * s - length
        if self.pad_mode == "edge":
            buf[:, :left] = mid[:, :1]
            buf[:, left + length : left + length + right] = mid[:, -1:]
        else:
            buf[:, :left] = 0.0
            buf[:, left + length : left + length + right] = 0.0
        buf[:, left + length + right :] = 0.0
        if self.im2col:
            cols = sliding_window_view(buf[:, : n + self.k - 1], n, axis=1)  # [C_in, k, n], a view
            y = self.taps[0] @ cols.reshape(c * self.k, n)
        elif s == 1:
            d = self.dilation
            y = self.taps[0] @ buf[:, :n]
            for j in range(1, self.k):
                y += self.taps[j] @ buf[:, j * d : j * d + n]
        else:
            frames = buf.reshape(c, -1, s).transpose(0, 2, 1).reshape(c * s, -1)  # a copy
            y = self.taps[0] @ frames[:, :n]
            for j in range(1, m):
                y += self.taps[j] @ frames[:, j : j + n]
        if self.bias is not None:
            y += self.bias
        return y


class ResnetBlock:
    """MimiResnetBlock without shortcut conv: x + conv2(elu(conv1(elu(x))))."""

    def __init__(self, conv1: CausalConv, conv2: CausalConv) -> None:
        self.conv1, self.conv2 = conv1, conv2

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = self.conv2(self.conv1(x, elu=True), elu=True)
        y += x
        return y


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the channels of [C, n] (biased variance, as torch); weight, bias [C, 1]."""
    h = x - x.mean(axis=0)
    var = np.einsum("ij,ij->j", h, h) / F32(h.shape[0])
    h *= F32(1.0) / np.sqrt(var + F32(eps))
    h *= weight
    h += bias
    return h


class TransformerLayer:
    """MimiTransformerLayer: pre-LayerNorm attention and GELU MLP, each scaled per channel."""

    def __init__(self, f: GGUFFile, bid: int, heads: int, kv_heads: int, head_dim: int, eps: float) -> None:
        t = lambda name: f.read(name.format(bid=bid))
        names = [L.ENC_TFM_ATTN_Q, L.ENC_TFM_ATTN_K, L.ENC_TFM_ATTN_V]
        w = [t(n + ".weight") for n in names]
        if [len(a) for a in w] != [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]:
            raise ModelFileError(f"{f.path}: codec encoder layer {bid}: q/k/v widths do not fit the heads")
        biased = f.has_tensor(L.ENC_TFM_ATTN_Q.format(bid=bid) + ".bias")
        self.qkv = Linear(
            np.concatenate(w), np.concatenate([t(n + ".bias") for n in names]) if biased else None
        )
        out = L.ENC_TFM_ATTN_OUT
        self.out = Linear(t(out + ".weight"), t(out + ".bias") if biased else None)
        self.up, self.down = Linear(t(L.ENC_TFM_FFN_UP)), Linear(t(L.ENC_TFM_FFN_DOWN))
        self.ln1 = (t(L.ENC_TFM_ATTN_NORM + ".weight")[:, None], t(L.ENC_TFM_ATTN_NORM + ".bias")[:, None])
        self.ln2 = (t(L.ENC_TFM_FFN_NORM + ".weight")[:, None], t(L.ENC_TFM_FFN_NORM + ".bias")[:, None])
        self.ls1, self.ls2 = t(L.ENC_TFM_ATTN_SCALE)[:, None], t(L.ENC_TFM_FFN_SCALE)[:, None]
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps

    def __call__(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """x [C, T]; cos, sin [head_dim, T]; mask [T, T] additive (0 or -inf)."""
        n, hd, nh, nkv = x.shape[1], self.head_dim, self.heads, self.kv_heads
        qkv = self.qkv(_layer_norm(x, *self.ln1, self.eps))
        qk = rope(qkv[: (nh + nkv) * hd].reshape(nh + nkv, hd, n), cos, sin)
        rep = nh // nkv
        q = qk[:nh].transpose(0, 2, 1)  # [heads, T, hd]
        k = np.repeat(qk[nh:], rep, axis=0)  # [heads, hd, T]
        v = np.repeat(qkv[(nh + nkv) * hd :].reshape(nkv, hd, n), rep, axis=0)
        attn = np.empty((nh, hd, n), F32)
        for i in range(0, n, QUERY_BLOCK):
            scores = q[:, i : i + QUERY_BLOCK] @ k  # [heads, rows, T]
            scores *= F32(hd**-0.5)
            scores += mask[i : i + QUERY_BLOCK]
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            attn[:, :, i : i + QUERY_BLOCK] = v @ scores.transpose(0, 2, 1)
        x = x + self.ls1 * self.out(attn.reshape(nh * hd, n))
        h = self.down(gelu(self.up(_layer_norm(x, *self.ln2, self.eps))))
        h *= self.ls2
        x += h
        return x


class ResidualVQ:
    """One MimiResidualVectorQuantizer's encode: project (1x1 conv, if any), then per codebook
    the nearest entry of the residual, subtracted."""

    def __init__(self, proj: np.ndarray | None, codebooks: np.ndarray) -> None:
        self.proj = None if proj is None else Linear(proj)
        # torch.cdist's operand for the nearest entry: [e, 1, |e|^2] against [-2 x, |x|^2, 1]
        norms = np.einsum("nsd,nsd->ns", codebooks, codebooks)[..., None]
        self.augmented = np.concatenate([codebooks, np.ones_like(norms), norms], axis=-1)
        self.codebooks = self.augmented[..., : codebooks.shape[-1]]  # [n, size, dim], a view

    def encode(self, x: np.ndarray) -> np.ndarray:
        """x [C, T] -> codes [n, T] int64."""
        r = x if self.proj is None else self.proj(x)
        codes = np.empty((len(self.codebooks), r.shape[1]), np.int64)
        ones = np.ones((1, r.shape[1]), F32)
        for i, (cb, aug) in enumerate(zip(self.codebooks, self.augmented)):
            xa = np.concatenate([F32(-2.0) * r, np.einsum("dt,dt->t", r, r)[None], ones])
            dist = aug @ xa  # [size, T]: squared distances
            np.maximum(dist, F32(0.0), out=dist)
            np.sqrt(dist, out=dist)
            codes[i] = np.argmin(dist, axis=0)  # the first minimum, as torch.argmin
            r = r - cb[codes[i]].T
        return codes


# ---------------------------------------------------------------------------------------------
# The encoder
# ---------------------------------------------------------------------------------------------


class CodecEncoder:
    """24 kHz mono float32 samples -> codes [frames, valid_num_quantizers] int64, as the official
    `Qwen3TTSTokenizer.encode(wav, sr=24000).audio_codes[0]`. Holds weights only."""

    def __init__(self, mmproj: GGUFFile, threads: int | None = None) -> None:
        f = mmproj
        if not self.available(f):
            raise ModelFileError(
                f"{f.path}: no codec encoder (kazeia.enc.* tensors); in-context cloning needs the mmproj "
                "of a Base model converted by kazeia-stream convert; x-vector cloning works without it"
            )
        key = lambda name: f.require(L.KEY_ENC_PREFIX + name)
        self.path, self.threads = f.path, threads
        self.sample_rate = int(key("sampling_rate"))
        self.frame_size = int(f.require(L.KEY_ENC_FRAME_SIZE))
        self.num_quantizers = int(f.require(L.KEY_ENC_VALID_QUANTIZERS))
        pad_mode, down_pad = str(key("pad_mode")), str(f.require(L.KEY_ENC_DOWNSAMPLE_PAD_MODE))
        for name, value in (("pad_mode", pad_mode), ("downsample_pad_mode", down_pad)):
            if value not in PAD_MODES:
                raise ModelFileError(f"{f.path}: unsupported codec encoder {name} {value!r}")
        if key("hidden_act") != "gelu":
            raise ModelFileError(f"{f.path}: unsupported codec encoder hidden_act {key('hidden_act')!r}")

        conv = lambda name, **kw: CausalConv(*_conv(f, name), pad_mode=pad_mode, **kw)
        self.conv_in = conv(L.ENC_CONV_IN)
        self.stages: list[tuple[list[ResnetBlock], CausalConv]] = []
        growth, n_res = int(key("dilation_growth_rate")), int(key("num_residual_layers"))
        for bid, ratio in enumerate(reversed([int(r) for r in f.require(L.KEY_ENC_UPSAMPLING_RATIOS)])):
            blocks = [
                ResnetBlock(
                    conv(L.ENC_RES_CONV1.format(bid=bid, xid=xid), dilation=growth**xid),
                    conv(L.ENC_RES_CONV2.format(bid=bid, xid=xid)),
                )
                for xid in range(n_res)
            ]
            self.stages.append((blocks, conv(L.ENC_DOWN_CONV.format(bid=bid), stride=ratio)))
        self.conv_out = conv(L.ENC_CONV_OUT)

        heads, kv_heads = int(key("num_attention_heads")), int(key("num_key_value_heads"))
        head_dim, eps = int(key("head_dim")), float(key("norm_eps"))
        n_layers = 0
        while f.has_tensor(L.ENC_TFM_ATTN_Q.format(bid=n_layers) + ".weight"):
            n_layers += 1
        self.layers = [TransformerLayer(f, bid, heads, kv_heads, head_dim, eps) for bid in range(n_layers)]
        # as torch: inv_freq = 1 / theta ** (arange(0, d, 2) / d) in float32
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(F32) / F32(head_dim)
        self.inv_freq = (F32(1.0) / (F32(float(key("rope_theta"))) ** exponents)).astype(F32)

        down = f.read(L.ENC_DOWNSAMPLE)
        self.downsample = CausalConv(
            down, None, stride=int(f.require(L.KEY_ENC_DOWNSAMPLE_STRIDE)), pad_mode=down_pad
        )
        self.semantic = ResidualVQ(
            _optional(f, L.ENC_QUANT_SEMANTIC_IN), _codebooks(f, L.ENC_QUANT_SEMANTIC_CB)
        )
        self.acoustic = ResidualVQ(
            _optional(f, L.ENC_QUANT_ACOUSTIC_IN), _codebooks(f, L.ENC_QUANT_ACOUSTIC_CB)
        )
        n_codes = len(self.semantic.codebooks) + len(self.acoustic.codebooks)
        if n_codes != self.num_quantizers:
            raise ModelFileError(
                f"{f.path}: {n_codes} codec encoder codebooks, expected {self.num_quantizers}"
            )
        self._blas = ThreadpoolController()

    @staticmethod
    def available(mmproj: GGUFFile) -> bool:
        """Whether the mmproj holds the codec encoder (Base models converted by our converter;
        llama.cpp's converter does not write it)."""
        return mmproj.has_tensor(L.ENC_CONV_IN + ".weight") and L.KEY_ENC_FRAME_SIZE in mmproj

    def encode(self, wav: np.ndarray) -> np.ndarray:
        """1-D float32 samples at `sample_rate` -> codes [ceil(len / frame_size), num_quantizers]
        int64."""
        wav = np.asarray(wav, dtype=F32)
        if wav.ndim != 1 or len(wav) == 0:
            raise ValueError(f"wav must be 1-D samples, not empty, got shape {wav.shape}")
        if self.threads is None:
            codes = self._forward(wav)
        else:
            with self._blas.limit(limits=self.threads, user_api="blas"):
                codes = self._forward(wav)
        return codes[: -(-len(wav) // self.frame_size)]

    def embeddings(self, wav: np.ndarray) -> np.ndarray:
        """The quantizer's input [C, frames] float32 (after the downsample conv)."""
        h = self.conv_in(np.asarray(wav, dtype=F32)[None, :])
        for blocks, down in self.stages:
            for block in blocks:
                h = block(h)
            h = down(h, elu=True)
        h = self.conv_out(h, elu=True)
        n = h.shape[1]
        pos = np.arange(n)
        freqs = self.inv_freq[:, None] * pos.astype(F32)[None, :]
        emb = np.concatenate([freqs, freqs], axis=0)  # [head_dim, T]
        cos, sin = np.cos(emb), np.sin(emb)
        causal = pos[:, None] >= pos[None, :]  # query position >= key position
        mask = np.where(causal, F32(0.0), F32(-np.inf)).astype(F32)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.downsample(h)

    def _forward(self, wav: np.ndarray) -> np.ndarray:
        h = self.embeddings(wav)
        return np.concatenate([self.semantic.encode(h), self.acoustic.encode(h)]).T.copy()


# ---------------------------------------------------------------------------------------------
# Reading the weights
# ---------------------------------------------------------------------------------------------


def _conv(f: GGUFFile, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """A Conv1d kernel [C_out, C_in, k] and its bias; C_out from the bias, since the GGUF shape
    drops a leading 1."""
    w, b = f.read(prefix + ".weight"), f.read(prefix + ".bias")
    return w.reshape(len(b), -1, w.shape[-1]), b


def _optional(f: GGUFFile, name: str) -> np.ndarray | None:
    return f.read(name) if f.has_tensor(name) else None


def _codebooks(f: GGUFFile, name: str) -> np.ndarray:
    """[n, size, dim] (the GGUF shape drops n when it is 1)."""
    cb = f.read(name)
    return np.ascontiguousarray(cb.reshape(-1, *cb.shape[-2:]))
