"""The frame loop of one utterance: talker step, codebook 0, code predictor, next talker input.

`FrameLoop` holds the engines; `FrameState` holds everything one utterance changes (the talker's
position, the samplers and their history, the text still to read, the frame count), so offline
synthesis, the benchmark and the streaming actors drive the same loop one frame at a time. The
talker step that consumes a frame runs at the start of the *next* call, so a frame's codes reach
the decoder as soon as the code predictor is done with them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import UsageError
from ..model.config import GenerationConfig, ModelConfig, Sampling
from ..model.prompt import Prompt, TextFeed
from .code_predictor import CodePredictor
from .sampler import CodeSampler, TalkerSampler
from .talker import Talker, TalkerState

FRAMES_PER_TEXT_TOKEN = 8  # 0.64 s of speech per text token: about twice a slow speaker's pace
MIN_FRAME_CAP = 25


def frame_cap(n_text_tokens: int, max_new_tokens: int) -> int:
    """Most frames an utterance may take: EOS sometimes never comes, so cap by the text length."""
    return min(max(MIN_FRAME_CAP, FRAMES_PER_TEXT_TOKEN * n_text_tokens), max_new_tokens - 1)


def max_text_tokens(room: int) -> int:
    """The most text tokens an utterance may hold so that its text rows (with BOS and EOS) and
    its frame cap fit in `room` talker positions."""
    return (room - 2) // (FRAMES_PER_TEXT_TOKEN + 1)


@dataclass(frozen=True)
class GenerationOptions:
    """Sampling settings of a session or an utterance; None takes the model's generation config."""

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
        if self.seed is not None and self.seed < 0:
            raise UsageError(f"the seed must be a whole number of at least 0, not {self.seed}")
        if self.max_frames is not None and self.max_frames < 1:
            raise UsageError(f"max_frames must be at least 1, not {self.max_frames}")
        if self.ignore_eos and not self.max_frames:
            raise ValueError("ignore_eos needs max_frames")

    def resolve(self, config: GenerationConfig) -> GenerationConfig:
        """The model's generation config overridden by the options that are set."""

        def pick(sampling: Sampling, prefix: str) -> Sampling:
            fields = ("do_sample", "temperature", "top_k", "top_p")
            values = {f: getattr(self, prefix + f) for f in fields}
            return replace(sampling, **{k: v for k, v in values.items() if v is not None})

        penalty = self.repetition_penalty
        return replace(
            config,
            talker=pick(config.talker, ""),
            code_predictor=pick(config.code_predictor, "subtalker_"),
            repetition_penalty=config.repetition_penalty if penalty is None else penalty,
        )


@dataclass
class StageTimes:
    """Seconds spent per stage for the frames generated so far (talker: single steps only)."""

    prefill: float = 0.0
    talker: float = 0.0
    code_predictor: float = 0.0
    frames: int = 0
    talker_steps: int = 0


@dataclass
class FrameState:
    """Everything one utterance's frame loop changes."""

    talker: TalkerState
    text: TextFeed
    talker_sampler: TalkerSampler
    code_sampler: CodeSampler
    max_frames: int | None
    max_new_tokens: int
    hidden: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    logits: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    pending: np.ndarray | None = None  # the last frame's embedding, fed at the next call
    frame: int = 0
    done: bool = False
    times: StageTimes = field(default_factory=StageTimes)

    @property
    def frame_limit(self) -> int:
        return self.max_frames or frame_cap(self.text.n_tokens, self.max_new_tokens)

    @property
    def needs_text(self) -> bool:
        """The next step would read a trailing text row that has not arrived yet."""
        return self.pending is not None and self.text.row(self.frame - 1) is None


class FrameLoop:
    """Generates the 16 codes of one frame per `next_frame(state)` call until EOS or the cap."""

    def __init__(self, talker: Talker, code_predictor: CodePredictor, config: ModelConfig) -> None:
        self.talker, self.code_predictor, self.config = talker, code_predictor, config

    def start(
        self, prompt: Prompt, text: TextFeed, options: GenerationOptions, rng: np.random.Generator
    ) -> FrameState:
        """Begin an utterance from a prompt and its trailing text (`Model.text_feed`), whose
        later tokens streaming text adds; the samplers draw from `rng`."""
        cfg = self.config
        gen = options.resolve(cfg.generation)
        state = FrameState(
            talker=TalkerState(),
            text=text,
            talker_sampler=TalkerSampler(
                gen.talker,
                rng,
                eos=cfg.codec_ids.eos,
                suppress=cfg.suppress_codes,
                repetition_penalty=gen.repetition_penalty,
                min_new_tokens=options.max_frames + 1 if options.ignore_eos and options.max_frames else 2,
            ),
            code_sampler=CodeSampler(gen.code_predictor, rng),
            max_frames=options.max_frames,
            max_new_tokens=gen.max_new_tokens,
        )
        t0 = time.perf_counter()
        state.hidden, state.logits = self.talker.prefill(state.talker, prompt.prefill, prompt.n_fixed)
        state.times.prefill = time.perf_counter() - t0
        return state

    def next_frame(self, state: FrameState) -> np.ndarray | None:
        """The codes [16] of the next frame, or None once the utterance has ended (EOS, its
        frame cap, or the end of the talker's context)."""
        if (
            state.done
            or state.frame >= state.frame_limit
            or (state.pending is not None and self.talker.room(state.talker) < 1)
        ):
            state.done = True
            return None
        times = state.times
        if state.pending is not None:
            text = state.text.row(state.frame - 1)
            if text is None:
                raise RuntimeError("the next text row has not arrived (check needs_text first)")
            t0 = time.perf_counter()
            state.hidden, state.logits = self.talker.step(state.talker, state.pending + text)
            times.talker += time.perf_counter() - t0
            times.talker_steps += 1
            state.pending = None
        code0 = state.talker_sampler(state.logits)
        if code0 == self.config.codec_ids.eos:
            state.done = True
            return None
        t0 = time.perf_counter()
        codes, state.pending = self.code_predictor.predict(state.hidden, code0, state.code_sampler)
        times.code_predictor += time.perf_counter() - t0
        state.frame += 1
        times.frames += 1
        return codes
