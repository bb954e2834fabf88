"""The frame loop of one utterance: talker step, codebook 0, code predictor, next talker input.

`FrameGenerator` holds the loop's whole state explicitly, so offline synthesis, the benchmark and
the streaming actors drive the same object one frame at a time. The talker step that consumes a
frame runs at the start of the *next* call, so a frame's codes reach the decoder as soon as the
code predictor is done with them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .sampler import CodeSampler, SamplingParams, TalkerSampler

if TYPE_CHECKING:
    from ..model import Model
    from ..model.prompt import Prompt
    from .code_predictor import CodePredictor
    from .talker import Talker

FRAMES_PER_TEXT_TOKEN = 8  # 0.64 s of speech per text token: about twice a slow speaker's pace
MIN_FRAME_CAP = 25


def frame_cap(n_text_tokens: int, max_new_tokens: int) -> int:
    """Most frames an utterance may take: EOS sometimes never comes, so cap by the text length."""
    return min(max(MIN_FRAME_CAP, FRAMES_PER_TEXT_TOKEN * n_text_tokens), max_new_tokens - 1)


@dataclass(frozen=True)
class GenerationOptions:
    """Sampling settings; None takes the model's generation config."""

    seed: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    subtalker_do_sample: bool | None = None
    subtalker_temperature: float | None = None
    subtalker_top_k: int | None = None
    subtalker_top_p: float | None = None
    max_frames: int | None = None  # None: derived from the text length
    ignore_eos: bool = False  # generate exactly max_frames (benchmarks)

    def __post_init__(self) -> None:
        if self.ignore_eos and not self.max_frames:
            raise ValueError("ignore_eos needs max_frames")

    def resolve(self, defaults: dict) -> dict:
        """The model's generation config overridden by the options that are set."""
        merged = dict(defaults)
        for key in defaults:
            value = getattr(self, key, None)
            if value is not None:
                merged[key] = value
        return merged


@dataclass
class StageTimes:
    """Seconds spent per stage for the frames generated so far (talker: single steps only)."""

    prefill: float = 0.0
    talker: float = 0.0
    code_predictor: float = 0.0
    frames: int = 0
    talker_steps: int = 0


@dataclass
class FrameGenerator:
    """Generates the 16 codes of one frame per `next_frame()` call until EOS or the cap."""

    model: Model
    talker: Talker
    code_predictor: CodePredictor
    options: GenerationOptions = field(default_factory=GenerationOptions)
    times: StageTimes = field(default_factory=StageTimes)

    def start(self, prompt: Prompt, text_complete: bool = True) -> None:
        """Begin an utterance from `Model.prompt`'s output. With `text_complete=False` more
        trailing text rows come through `add_text` while frames are generated."""
        cfg = self.model.config
        gen = self.options.resolve(cfg.generation)
        rng = np.random.default_rng(self.options.seed)
        self._max_new_tokens = int(gen["max_new_tokens"])
        self.talker_sampler = TalkerSampler(
            SamplingParams(bool(gen["do_sample"]), gen["temperature"], int(gen["top_k"]), gen["top_p"]),
            rng, eos=cfg.codec_ids.eos, suppress=cfg.suppress_codes,
            repetition_penalty=gen["repetition_penalty"],
            min_new_tokens=self.options.max_frames + 1 if self.options.ignore_eos else 2)
        self.code_sampler = CodeSampler(SamplingParams(
            bool(gen["subtalker_do_sample"]), gen["subtalker_temperature"],
            int(gen["subtalker_top_k"]), gen["subtalker_top_p"]), rng)
        self.trailing = list(prompt.trailing)
        self.text_complete = text_complete
        self.n_text_tokens = prompt.n_text_tokens
        self.pad = self.model.pad_embedding
        self.times = StageTimes()
        self.frame = 0
        self.done = False
        self._pending: np.ndarray | None = None
        t0 = time.perf_counter()
        self.hidden, self.logits = self.talker.prefill(prompt.prefill, prompt.n_fixed)
        self.times.prefill = time.perf_counter() - t0

    @property
    def max_frames(self) -> int:
        return self.options.max_frames or frame_cap(self.n_text_tokens, self._max_new_tokens)

    def add_text(self, rows: np.ndarray, n_tokens: int, complete: bool) -> None:
        """More trailing text rows (the last one EOS once `complete`), for streaming text."""
        self.trailing.extend(rows)
        self.n_text_tokens += n_tokens
        self.text_complete = complete

    @property
    def needs_text(self) -> bool:
        """The next step would read a trailing text row that has not arrived yet. The loop waits
        for it rather than feeding PAD, which the model reads as "the text has ended"."""
        return (self._pending is not None and not self.text_complete
                and self.frame - 1 >= len(self.trailing))

    def next_frame(self) -> np.ndarray | None:
        """The codes [16] of the next frame, or None once the utterance has ended."""
        if self.done or self.frame >= self.max_frames:
            self.done = True
            return None
        if self._pending is not None:
            t = self.frame - 1
            text = self.trailing[t] if t < len(self.trailing) else self.pad
            t0 = time.perf_counter()
            self.hidden, self.logits = self.talker.step(self._pending + text)
            self.times.talker += time.perf_counter() - t0
            self.times.talker_steps += 1
            self._pending = None
        code0 = self.talker_sampler(self.logits)
        if code0 == self.model.config.codec_ids.eos:
            self.done = True
            return None
        t0 = time.perf_counter()
        codes, self._pending = self.code_predictor.predict(self.hidden, code0, self.code_sampler)
        self.times.code_predictor += time.perf_counter() - t0
        self.frame += 1
        self.times.frames += 1
        return codes
