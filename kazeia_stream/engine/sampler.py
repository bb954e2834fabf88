"""Sampling, as the official code does it through Hugging Face `generate`.

Codebook 0 (talker): repetition penalty over the codes generated so far in the utterance, then
min_new_tokens (EOS masked early), then suppression of the control rows except EOS, then
temperature, top-k, top-p and a draw. Codebooks 1..15 (code predictor): temperature, top-k,
top-p and a draw. Greedy (argmax after the penalties) when sampling is off. Draws use numpy's
PCG64, so a seed gives the same codes on every machine (but where a uniform falls within
float rounding of a boundary of the cumulative probabilities: about never).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache
from typing import Any, Protocol

import numpy as np

from ..model.config import Sampling
from . import native

# logits, their count, temperature, top-k, top-p, the uniform
_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int64]
_ARGS += [ctypes.c_double, ctypes.c_double]


@cache
def _kernel() -> Callable[..., int] | None:
    """`kz_sampler_draw` (sampler.c), where it was built."""
    lib = native.library("sampler")
    if lib is None:
        return None
    fn: Any = lib.kz_sampler_draw  # a ctypes function
    fn.argtypes, fn.restype = _ARGS, ctypes.c_int64
    return fn


class Uniforms(Protocol):
    """Where a draw takes its uniform in [0, 1): a numpy generator, or one drawn ahead."""

    def random(self) -> float: ...


def warp_and_draw(logits: np.ndarray, p: Sampling, rng: Uniforms) -> int:
    """Temperature, top-k, top-p (Hugging Face's warpers, in that order; ties at the top-p cut
    in index order), then a draw: the draw of `rng.choice(len(probs), p=probs)`. On our C
    kernel where it was built (`sampler.c`: the same steps on the kept entries only; between
    two code predictor passes numpy's calls run on cold caches, 146 against 58 us a draw),
    else in numpy, bit for bit `rng.choice`'s steps."""
    if not p.do_sample:
        return int(np.argmax(logits))
    kernel = _kernel()
    if kernel is not None and logits.dtype == np.float32 and logits.flags.c_contiguous:
        code = int(kernel(native.data(logits), len(logits), p.temperature, p.top_k, p.top_p, rng.random()))
    else:
        code = _draw(logits, p, rng)
    if code < 0:
        raise ValueError("nothing to draw: every logit is -inf")
    return code


def _draw(logits: np.ndarray, p: Sampling, rng: Uniforms) -> int:
    """`warp_and_draw` in numpy: `rng.choice`'s own steps on the warped scores in place; -1
    where every logit is -inf (as the kernel returns)."""
    scores = logits.astype(np.float64)
    scores /= p.temperature
    if not scores.max() > -np.inf:
        return -1
    if 0 < p.top_k < len(scores):
        kth = np.partition(scores, -p.top_k)[-p.top_k]
        scores[scores < kth] = -np.inf
    if p.top_p < 1.0:
        order = np.argsort(scores, kind="stable")
        probs = _softmax(scores[order])
        drop = np.cumsum(probs) <= 1.0 - p.top_p
        drop[-1] = False
        scores[order[drop]] = -np.inf
    cdf = np.cumsum(_softmax(scores, out=scores), out=scores)
    cdf /= cdf[-1]
    return int(cdf.searchsorted(rng.random(), side="right"))


def _softmax(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    e = np.exp(np.subtract(x, np.max(x), out=out), out=out)
    e /= e.sum()
    return e


class CodeSampler:
    """Draws codebooks 1..15 from the code predictor's logits."""

    def __init__(self, params: Sampling, rng: np.random.Generator) -> None:
        self.params, self.rng = params, rng

    def __call__(self, logits: np.ndarray) -> int:
        return warp_and_draw(logits, self.params, self.rng)

    def with_uniform(self, logits: np.ndarray, uniform: float) -> int:
        """The draw `__call__` makes where its generator's next uniform is `uniform` (one drawn
        ahead: `code_step.CodeSteps`)."""
        return warp_and_draw(logits, self.params, _Drawn(uniform))


class _Drawn:
    """A uniform drawn ahead, where a draw takes its generator's next (`rng.random()`)."""

    def __init__(self, uniform: float) -> None:
        self._uniform = uniform

    def random(self) -> float:
        return self._uniform


class TalkerSampler:
    """Draws codebook 0 from the talker's codec logits; holds the codes the utterance drew."""

    def __init__(
        self,
        params: Sampling,
        rng: np.random.Generator,
        *,
        eos: int,
        suppress: np.ndarray,
        repetition_penalty: float = 1.05,
        min_new_tokens: int = 2,
    ) -> None:
        self.params, self.rng = params, rng
        self.eos, self.suppress = eos, suppress
        self.repetition_penalty, self.min_new_tokens = repetition_penalty, min_new_tokens
        self.drawn = 0
        # the codes drawn, once each (np.unique imported numpy.ma at its first call: 20 ms of
        # an utterance's first frame on Zen 1)
        self._seen: dict[int, None] = {}

    def __call__(self, logits: np.ndarray) -> int:
        scores = logits.astype(np.float32, copy=True)
        if self._seen and self.repetition_penalty != 1.0:
            seen = list(self._seen)
            s = scores[seen]
            scores[seen] = np.where(s < 0, s * self.repetition_penalty, s / self.repetition_penalty)
        if self.drawn < self.min_new_tokens:
            scores[self.eos] = -np.inf
        scores[self.suppress] = -np.inf
        code = warp_and_draw(scores, self.params, self.rng)
        self.drawn += 1
        self._seen[code] = None
        return code
