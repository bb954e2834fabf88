"""What flows between the actors of a stream, in order, on bounded trio channels."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..engine.frames import StageTimes


@dataclass(frozen=True)
class TextTokens:
    """Token ids of the text to speak, in order, final; `segment_end` on the last message of
    each segment (a long text is spoken as several)."""

    ids: list[int]
    segment_end: bool


@dataclass(frozen=True)
class Frame:
    """The 16 codes of one 80 ms frame, numbered from 0 within the utterance; `new_segment` on
    the first frame of each segment, which starts a new decoder state."""

    index: int
    codes: np.ndarray
    new_segment: bool = False


@dataclass(frozen=True)
class AudioChunk:
    """PCM of one or more consecutive frames: float32 mono, `frame_index` is the first frame's."""

    frame_index: int
    pcm: np.ndarray
    sample_rate: int

    @property
    def duration(self) -> float:
        return len(self.pcm) / self.sample_rate


@dataclass
class StageTrace:
    """Start and end times (perf_counter seconds) of one stage's work on each frame."""

    spans: list[tuple[int, float, float]] = field(default_factory=list)

    def add(self, index: int, start: float, end: float) -> None:
        self.spans.append((index, start, end))

    @property
    def busy(self) -> float:
        """Seconds of work."""
        return sum(end - start for _, start, end in self.spans)


@dataclass
class UtteranceMetrics:
    """Per-utterance figures: time to first audio, real-time factor, stage times and a trace."""

    started: float = 0.0
    sample_rate: int = 24000
    samples: int = 0
    first_audio: float | None = None
    finished: float | None = None
    cancelled: bool = False
    prefill_s: float = 0.0  # engine seconds, summed over the utterance
    talker_s: float = 0.0
    talker_steps: int = 0
    code_predictor_s: float = 0.0
    generator: StageTrace = field(default_factory=StageTrace)
    decoder: StageTrace = field(default_factory=StageTrace)

    def add_times(self, times: StageTimes) -> None:
        """A segment's engine times."""
        self.prefill_s += times.prefill
        self.talker_s += times.talker
        self.talker_steps += times.talker_steps
        self.code_predictor_s += times.code_predictor

    @property
    def frames(self) -> int:
        return len(self.decoder.spans)

    @property
    def audio_s(self) -> float:
        return self.samples / self.sample_rate

    def lead_s(self, now: float) -> float:
        """Seconds of the audio made that a listener who has heard it in real time since the
        first audio has still to hear at `now` (perf_counter seconds; negative: it ran dry)."""
        if self.first_audio is None:
            return 0.0
        return self.audio_s - (now - self.first_audio)

    @property
    def ttfa_s(self) -> float | None:
        return None if self.first_audio is None else self.first_audio - self.started

    @property
    def wall_s(self) -> float | None:
        return None if self.finished is None else self.finished - self.started

    @property
    def overlap_s(self) -> float:
        """Seconds during which the decoder and the generator were busy at the same time."""
        return sum(
            max(0.0, min(d1, g1) - max(d0, g0))
            for _, d0, d1 in self.decoder.spans
            for _, g0, g1 in self.generator.spans
        )

    @property
    def rtf(self) -> float | None:
        wall = self.wall_s
        return None if wall is None or not self.audio_s else wall / self.audio_s


class SpokenAudio(Protocol):
    """What a sink plays: the chunks of an utterance as they come, and its metrics
    (`session.Utterance`)."""

    metrics: UtteranceMetrics

    def __aiter__(self) -> AsyncIterator[AudioChunk]: ...
