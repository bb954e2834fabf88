"""The frame loop: talker step, codebook 0, code predictor, next talker input.

`FrameLoop` holds the engines; `FrameState` holds everything one utterance changes (its talker
slot and position, the samplers and their history, the text still to read, the frame count), so
offline synthesis, the benchmark and the streaming actors drive the same loop one frame at a
time. `next_frames` advances several utterances by one frame in one pass: one talker decode for
all of them (each its own sequence), then the code predictor's passes for all of them; a stream
alone is the case of one. The talker step that consumes a frame runs at the start of the *next*
call, so a frame's codes reach the decoder as soon as the code predictor is done with them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
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
# A prefill runs in pieces of at most this many rows; beside other streams' steps, one piece per
# pass, so that a joining stream delays the others by about one frame's work (measured on the
# 0.6B Q8_0, 2 cores: 16 rows 0.14 s, a frame 0.12 s). The pieces are the same alone or beside
# others, so a stream's arithmetic does not depend on them.
PREFILL_PIECE = 16


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


@dataclass(eq=False)
class FrameState:
    """Everything one utterance's frame loop changes."""

    talker: TalkerState
    prompt: Prompt
    text: TextFeed
    talker_sampler: TalkerSampler
    code_sampler: CodeSampler
    max_frames: int | None
    max_new_tokens: int
    hidden: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    logits: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    prefill: list[tuple[int, np.ndarray]] | None = None  # pieces left to feed; None: not begun
    pending: np.ndarray | None = None  # the last frame's embedding, fed at the next call
    frame: int = 0
    done: bool = False
    times: StageTimes = field(default_factory=StageTimes)

    @property
    def frame_limit(self) -> int:
        return self.max_frames or frame_cap(self.text.n_tokens, self.max_new_tokens)

    @property
    def prefilling(self) -> bool:
        """Its prefill has not been fed whole yet (a pass gave it no frame)."""
        return self.prefill is None or bool(self.prefill)

    @property
    def needs_text(self) -> bool:
        """The next step would read a trailing text row that has not arrived yet."""
        return self.pending is not None and self.text.row(self.frame - 1) is None


class FrameLoop:
    """Generates the 16 codes of one frame per utterance per `next_frames(states)` call until
    EOS or the cap. Utterances take talker slots (`start`) and give them back (`finish`); the
    caller serialises the calls (the engines are scratch space of one pass at a time)."""

    def __init__(self, talker: Talker, code_predictor: CodePredictor, config: ModelConfig) -> None:
        self.talker, self.code_predictor, self.config = talker, code_predictor, config
        self.free = list(range(talker.n_seq))  # talker slots no utterance holds

    def start(
        self, prompt: Prompt, text: TextFeed, options: GenerationOptions, rng: np.random.Generator
    ) -> FrameState:
        """Begin an utterance from a prompt and its trailing text (`Model.text_feed`), whose
        later tokens streaming text adds; the samplers draw from `rng`. It takes a free talker
        slot, preferably one that keeps its prompt's fixed rows; its prefill runs in the
        passes."""
        seq = self.slot_for(prompt)
        if seq is None:
            raise RuntimeError(f"all {self.talker.n_seq} talker slots are taken")
        cfg = self.config
        gen = options.resolve(cfg.generation)
        return FrameState(
            talker=TalkerState(seq=seq),
            prompt=prompt,
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

    def build_graphs(self) -> None:
        """Build the graphs of the first frames of an utterance in the first free slot (the
        one a first utterance takes) ahead of them."""
        seq = self.free[0]
        self.talker.build_graphs(seq)
        self.code_predictor.build_graphs(seq)

    def finish(self, state: FrameState) -> None:
        """Give the utterance's talker slot back (once; its fixed rows stay cached there, the
        memory of its other cells goes back to the kernel)."""
        state.done = True
        if state.talker.seq not in self.free:
            self.talker.release(state.talker)
            self.free.append(state.talker.seq)

    def slot_for(self, prompt: Prompt, take: bool = True) -> int | None:
        """A free talker slot, preferably one that keeps the prompt's fixed rows (None: all are
        taken); `take` it."""
        if not self.free:
            return None
        seq = self.talker.slot_for(prompt.prefill[: prompt.n_fixed], self.free)
        if take:
            self.free.remove(seq)
        return seq

    def prepared(self, prompt: Prompt) -> bool:
        """Whether a free talker slot keeps the prompt's fixed rows already."""
        seq = self.slot_for(prompt, take=False)
        return seq is not None and self.talker.holds(seq, prompt.prefill[: prompt.n_fixed])

    def prepare(self, prompt: Prompt, seq: int) -> None:
        """Compute a prompt's fixed rows into the free slot `seq` ahead of its utterances,
        between passes."""
        self.talker.keep(seq, prompt.prefill[: prompt.n_fixed])

    def next_frame(self, state: FrameState) -> np.ndarray | None:
        """The codes [16] of the utterance's next frame, or None once it has ended (EOS, its
        frame cap, or the end of the talker's context)."""
        while True:
            (codes,) = self.next_frames([state])
            if not state.prefilling:
                return codes

    def next_frames(
        self,
        states: list[FrameState],
        others: bool = False,
        between: Callable[[int], None] | None = None,
        first_seq: int = 0,
    ) -> list[np.ndarray | None]:
        """One pass over several utterances, none of which `needs_text`: each one's next frame's
        codes, or None when it has ended or, `prefilling` still, got no frame in this pass.
        Prefills advance by one piece when the pass has steps or `others` (streams outside the
        pass) wait for the engines; else they run whole. The pass's code predictor sequences
        start at `first_seq`; `between(seq)` runs between two of its engine calls (after the
        talker's, between the code predictor's), where a pass over other utterances may run
        in the code predictor's sequences from `seq` on."""
        out: dict[FrameState, np.ndarray] = {}
        live = [s for s in states if not self._ended(s)]
        t0 = time.perf_counter()
        for s in live:
            if s.prefill is None:
                s.prefill = [
                    (pos + i, rows[i : i + PREFILL_PIECE])
                    for pos, rows in self.talker.begin(s.talker, s.prompt.prefill, s.prompt.n_fixed)
                    for i in range(0, len(rows), PREFILL_PIECE)
                ]
        stepping = [s for s in live if not s.prefilling]
        joining = [s for s in live if s.prefilling]
        prefilled = list(joining)
        parts = []
        for s in stepping:
            assert s.pending is not None
            text = s.text.row(s.frame - 1)
            if text is None:
                raise RuntimeError("the next text row has not arrived (check needs_text first)")
            parts.append((s.talker.seq, (s.pending + text)[None], s.talker.pos))
        ready = list(stepping)
        fed = stepping
        while parts or joining:  # beside others' steps, one prefill piece each; alone, every piece
            for s in joining:
                assert s.prefill
                pos, rows = s.prefill.pop(0)
                parts.append((s.talker.seq, rows, pos))
            hidden, logits = self.talker.lm.forward_many(parts)
            for k, s in enumerate(fed + joining):
                s.hidden, s.logits = hidden[k], logits[k]
            ready += [s for s in joining if not s.prefill]
            joining = [s for s in joining if s.prefill]
            if stepping or others:
                break
            parts, fed = [], []
        t1 = time.perf_counter()
        for s in stepping:
            s.talker.pos += 1
            s.pending = None
            s.times.talker += t1 - t0
            s.times.talker_steps += 1
        for s in prefilled:
            s.times.prefill += t1 - t0
        code0 = [int(s.talker_sampler(s.logits)) for s in ready]
        ended = [c == self.config.codec_ids.eos for c in code0]
        going = [(s, c) for s, c, e in zip(ready, code0, ended) if not e]
        for s, e in zip(ready, ended):
            s.done = s.done or e
        if between is not None:
            between(first_seq + len(going))
            t1 = time.perf_counter()
        if going:
            codes, embeds = self.code_predictor.predict_many(
                np.stack([s.hidden for s, _ in going]),
                [c for _, c in going],
                [s.code_sampler for s, _ in going],
                between,
                first_seq,
            )
            t2 = time.perf_counter()
            for (s, _), c, e in zip(going, codes, embeds):
                s.pending = e
                s.frame += 1
                s.times.code_predictor += t2 - t1
                s.times.frames += 1
                out[s] = c
        return [out.get(s) for s in states]

    def _ended(self, state: FrameState) -> bool:
        """Whether the utterance is over (EOS, its cap, the end of its talker context)."""
        if (
            state.done
            or state.frame >= state.frame_limit
            or (state.pending is not None and self.talker.room(state.talker) < 1)
        ):
            state.done = True
        return state.done
