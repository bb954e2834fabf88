"""Offline synthesis: the frame loop feeding the codec decoder, one utterance at a time."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .code_predictor import CodePredictor
from .codec import CodecDecoder
from .generator import FrameGenerator, GenerationOptions
from .llm import LMOptions, SharedCores
from .talker import Talker

if TYPE_CHECKING:
    from ..model import Model
    from ..model.prompt import Prompt


@dataclass(frozen=True)
class Threads:
    """CPU threads per engine. The talker and code predictor alternate, so both can use every
    core; the codec decoder overlaps with them in the streaming pipeline."""

    talker: int
    code_predictor: int

    @classmethod
    def default(cls) -> Threads:
        n = os.cpu_count() or 1
        return cls(talker=n, code_predictor=n)


class Engines:
    """The three engines of one model, created once and reused across utterances."""

    def __init__(self, model: Model, threads: Threads | None = None) -> None:
        threads = threads or Threads.default()
        self.model = model
        # the decoder actor holds some while it runs beside them
        self.cores = SharedCores(max(threads.talker, threads.code_predictor))
        self.talker = Talker(model, LMOptions(threads=threads.talker), self.cores)
        self.code_predictor = CodePredictor(model, threads=threads.code_predictor, cores=self.cores)
        self.codec = CodecDecoder(model.mmproj_file)
        self.warm_up()

    def warm_up(self) -> None:
        """One throw-away step through every engine, so that the first utterance does not pay
        for faulting the memory-mapped weights in and for first-call setup (measured on the
        0.6B: about 0.3 s of its time to first audio)."""
        hidden, _ = self.talker.prefill(self.model.pad_embedding[None])
        self.code_predictor.predict(hidden, 0, lambda logits: 0)
        self.codec.push(np.zeros((1, self.model.config.codec.num_quantizers), dtype=np.int64))
        self.codec.reset()

    def prepare(self, prompt: Prompt) -> None:
        """Compute the rows that every utterance of a session starts with (instruction, role,
        voice, language), so that even its first utterance only computes its text's rows."""
        self.talker.prefill(prompt.prefill, prompt.n_fixed)

    def generator(self, options: GenerationOptions) -> FrameGenerator:
        return FrameGenerator(self.model, self.talker, self.code_predictor, options)


def frames(engines: Engines, prompt: Prompt, options: GenerationOptions) -> Iterator[np.ndarray]:
    """The codes [16] of each frame of one utterance."""
    gen = engines.generator(options)
    gen.start(prompt)
    while (codes := gen.next_frame()) is not None:
        yield codes


def audio(engines: Engines, prompt: Prompt, options: GenerationOptions) -> Iterator[np.ndarray]:
    """The PCM of each frame of one utterance, decoded as soon as the frame is generated."""
    engines.codec.reset()
    for codes in frames(engines, prompt, options):
        yield engines.codec.push(codes[None])


def synthesize(model: Model, prompt: Prompt, **options) -> np.ndarray:
    """All the audio of one utterance."""
    chunks = list(audio(model.engines, prompt, GenerationOptions(**options)))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
