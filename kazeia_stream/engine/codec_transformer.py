"""The codec decoder's transformer: pre-norm layers over a causal sliding window, each stream's
keys and values in a ring of slots (`KVRing`), RoPE at positions counted from the start of the
utterance (`TransformerState`), as in the official one-shot decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..model import gguf_layout as L
from ..model.gguf_file import GGUFFile
from .codec_layers import Linear, count_blocks, read_pair, rms_norm
from .matrix import F32

# Official decoder_config values, for published files that lack our kazeia.codec.* keys.
OFFICIAL_HEAD_DIM = 64
OFFICIAL_RMS_EPS = 1e-5
OFFICIAL_ROPE_THETA = 10000.0
OFFICIAL_SLIDING_WINDOW = 72
# `push` decodes at most this many frames per pass: the intermediate buffers stay small (a frame
# is 1920 x 96 floats in the last block) and the result does not depend on it.
MAX_FRAMES_PER_PASS = 16


class TransformerLayer:
    """Pre-norm attention + SiLU-gated MLP, each scaled per channel (LayerScale). Attention has
    no bias and no q/k norm, NeoX RoPE, and a causal sliding window. Activations [C, n * S] of
    S streams, stream index fastest: the projections run on all the columns at once, the
    attention per stream.

    State: a ring of K/V slots (after RoPE) per stream, `KVRing`; the Transformer tracks which
    position each slot holds and hands every layer each stream's additive mask (0 or -inf) of
    the window."""

    def __init__(self, f: GGUFFile, bid: int, head_dim: int, eps: float) -> None:
        t = lambda name: f.read(name.format(bid=bid))
        m = lambda name: f.weight(name.format(bid=bid))  # weights in place: see `codec_layers.read_kernel`
        joined = lambda *names: f.joined([name.format(bid=bid) for name in names])
        self.head_dim, self.eps = head_dim, eps
        self.n_heads = f.tensor_shape(L.WAV_TFM_ATTN_Q.format(bid=bid))[0] // head_dim
        self.n_kv = f.tensor_shape(L.WAV_TFM_ATTN_K.format(bid=bid))[0] // head_dim
        self.qkv = Linear(joined(L.WAV_TFM_ATTN_Q, L.WAV_TFM_ATTN_K, L.WAV_TFM_ATTN_V))
        self.out = Linear(m(L.WAV_TFM_ATTN_OUT))
        self.gate_up = Linear(joined(L.WAV_TFM_FFN_GATE, L.WAV_TFM_FFN_UP))
        self.down = Linear(m(L.WAV_TFM_FFN_DOWN))
        self.ln1, self.ln2 = t(L.WAV_TFM_ATTN_NORM)[:, None], t(L.WAV_TFM_FFN_NORM)[:, None]
        self.ls1, self.ls2 = t(L.WAV_TFM_ATTN_SCALE)[:, None], t(L.WAV_TFM_FFN_SCALE)[:, None]

    def new_state(self, slots: int) -> KVRing:
        return KVRing(
            np.zeros((self.n_kv, self.head_dim, slots), F32), np.zeros((self.n_kv, self.head_dim, slots), F32)
        )

    def __call__(
        self,
        kvs: Sequence[KVRing],
        x: np.ndarray,
        cos: np.ndarray,
        sin: np.ndarray,
        slots: np.ndarray,
        masks: Sequence[np.ndarray],
    ) -> np.ndarray:
        """x [C, n * S]; cos, sin [head_dim, n * S]; `slots` [n, S] where the new K/V go; each
        stream's ring and mask [n, slots]."""
        hd, nh, nkv, streams = self.head_dim, self.n_heads, self.n_kv, len(kvs)
        n, rep = x.shape[1] // streams, nh // nkv
        qkv = self.qkv(rms_norm(x, self.ln1, self.eps))
        qk = rope(qkv[: (nh + nkv) * hd].reshape(nh + nkv, hd, n * streams), cos, sin)
        qk = qk.reshape(nh + nkv, hd, n, streams)
        v = qkv[(nh + nkv) * hd :].reshape(nkv, hd, n, streams)
        attn = np.empty((nh * hd, n * streams), F32)
        attn_heads = attn.reshape(nkv, rep, hd, n, streams)
        for s, (kv, mask) in enumerate(zip(kvs, masks)):
            kv.keys[:, :, slots[:, s]] = qk[nh:, :, :, s]
            kv.values[:, :, slots[:, s]] = v[..., s]
            # one frame's queries at a time, contiguous: the products' shapes and layouts,
            # hence their rounding, are those of a push of one frame. Grouped-query attention:
            # the `rep` query heads of a kv head share its keys.
            for t in range(n):
                q = np.ascontiguousarray(qk[:nh, :, t, s]).reshape(nkv, rep, hd)
                scores = q @ kv.keys  # [kv heads, rep, slot]
                scores *= F32(hd**-0.5)
                scores += mask[t]
                scores -= scores.max(axis=-1, keepdims=True)
                np.exp(scores, out=scores)
                scores /= scores.sum(axis=-1, keepdims=True)
                # [nkv, hd, slot] x [nkv, slot, rep] -> [nkv, hd, rep]
                a = kv.values @ scores.transpose(0, 2, 1)
                attn_heads[:, :, :, t, s] = a.transpose(0, 2, 1)
        x = x + self.ls1 * self.out(attn)
        gu = self.gate_up(rms_norm(x, self.ln2, self.eps))
        g, u = gu[: len(gu) // 2], gu[len(gu) // 2 :]
        h = g / (F32(1.0) + np.exp(-g))  # SiLU
        h *= u
        x += self.ls2 * self.down(h)
        return x


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """NeoX ("rotate_half") RoPE on [heads, head_dim, n] with cos, sin [head_dim, n]."""
    half = x.shape[1] // 2
    y = x * cos
    y[:, :half] -= x[:, half:] * sin[:half]
    y[:, half:] += x[:, :half] * sin[half:]
    return y


@dataclass
class KVRing:
    """A transformer layer's state: K (after RoPE) and V of the ring's slots,
    [kv heads, head_dim, slot]. Zeros until written (masked anyway; zeros keep products finite)."""

    keys: np.ndarray
    values: np.ndarray


@dataclass
class TransformerState:
    """The absolute RoPE position, the position each K/V ring slot holds (the same in every
    layer; far in the past when empty, outside every window), and each layer's ring."""

    pos: int
    slot_pos: np.ndarray
    layers: list[KVRing]


class Transformer:
    """in_proj, the layers, final RMSNorm, out_proj, on S streams' columns (stream index
    fastest), each with its own state. A pass of n <= `max_step` frames writes slots p % slots,
    which (slots >= window - 1 + n) never overwrites a key that a query of the pass still sees."""

    def __init__(self, f: GGUFFile, max_step: int = MAX_FRAMES_PER_PASS) -> None:
        key = lambda name, default: f.get(L.KEY_CODEC_PREFIX + name, default)
        head_dim = int(key("head_dim", OFFICIAL_HEAD_DIM))
        self.eps = float(key("rms_norm_eps", OFFICIAL_RMS_EPS))
        theta = float(key("rope_theta", OFFICIAL_ROPE_THETA))
        self.window = int(key("sliding_window", OFFICIAL_SLIDING_WINDOW))
        self.max_step = max_step
        self.n_slots = self.window - 1 + max_step
        self.in_proj = Linear(*read_pair(f, L.WAV_TFM_IN_PROJ))
        self.out_proj = Linear(*read_pair(f, L.WAV_TFM_OUT_PROJ))
        self.norm = f.read(L.WAV_TFM_OUTPUT_NORM)[:, None]
        self.layers = [
            TransformerLayer(f, bid, head_dim, self.eps) for bid in range(count_blocks(f, L.WAV_TFM_ATTN_Q))
        ]
        # as torch: inv_freq = 1 / theta ** (arange(0, d, 2) / d) in float32
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(F32) / F32(head_dim)
        self.inv_freq = (F32(1.0) / (F32(theta) ** exponents)).astype(F32)

    def new_state(self) -> TransformerState:
        return TransformerState(
            0,
            np.full(self.n_slots, -(1 << 40), np.int64),
            [layer.new_state(self.n_slots) for layer in self.layers],
        )

    def __call__(self, states: Sequence[TransformerState], x: np.ndarray) -> np.ndarray:
        """x [C, n * S] of the S streams of `states`."""
        step = self.max_step * len(states)
        if x.shape[1] > step:
            return np.concatenate(
                [self(states, x[:, i : i + step]) for i in range(0, x.shape[1], step)], axis=1
            )
        n = x.shape[1] // len(states)
        pos = np.arange(n)[:, None] + np.array([state.pos for state in states])[None, :]  # [n, S]
        freqs = self.inv_freq[:, None] * pos.reshape(-1).astype(F32)[None, :]
        emb = np.concatenate([freqs, freqs], axis=0)  # [head_dim, n * S]
        cos, sin = np.cos(emb), np.sin(emb)
        slots = pos % self.n_slots
        masks = []
        for state, p, slot in zip(states, pos.T, slots.T):
            state.pos += n
            state.slot_pos[slot] = p
            lag = p[:, None] - state.slot_pos[None, :]  # query position - key position
            masks.append(np.where((lag >= 0) & (lag < self.window), F32(0), F32(-np.inf)).astype(F32))
        h = self.in_proj(x)
        for i, layer in enumerate(self.layers):
            h = layer([state.layers[i] for state in states], h, cos, sin, slots, masks)
        return self.out_proj(rms_norm(h, self.norm, self.eps))
