"""Cloning a voice from a recording with a Base model's encoders, as the official
`create_voice_clone_prompt` does: the x-vector from the speaker encoder, and for in-context (ICL)
voices the reference codes from the codec encoder.

    voice = kazeia_stream.voice_from_audio(model, "me.wav", ref_text="What I say in it.")
    voice.save("me.voice.safetensors")            # or VoiceLibrary().save(voice, "me")
    audio, rate = runtime.synthesize("Hello.", voice=voice)
"""

from __future__ import annotations

import logging
import os
import time
from functools import cached_property

import numpy as np

from .engine.codec_encoder import CodecEncoder
from .engine.speaker_encoder import SpeakerEncoder, log_mel
from .errors import UsageError
from .model import Model
from .model.reference import Reference, read_reference
from .model.voice import Voice

log = logging.getLogger(__name__)

Audio = str | os.PathLike[str] | np.ndarray


class VoiceEncoders:
    """The encoders of a Base model, built once: the speaker encoder at once, the codec
    encoder on the first in-context voice (published mmprojs lack it; x-vector voices do not
    need it)."""

    def __init__(self, model: Model) -> None:
        if model.kind != "base":
            raise UsageError(f"voice cloning needs a Base model; this is a {model.kind} model")
        self.model = model
        self.speaker = SpeakerEncoder(model.mmproj_file)

    @cached_property
    def codec(self) -> CodecEncoder:
        return CodecEncoder(self.model.mmproj_file)

    def voice(
        self,
        audio: Audio,
        sample_rate: int | None = None,
        ref_text: str | None = None,
        name: str | None = None,
    ) -> Voice:
        """A voice from a recording (a file, or samples at `sample_rate`); with its transcript
        `ref_text` an in-context voice, without it x-vector only."""
        return self.encode(read_reference(audio, sample_rate, self.model.sample_rate), ref_text, name)[0]

    def encode(
        self, ref: Reference, ref_text: str | None, name: str | None = None
    ) -> tuple[Voice, np.ndarray]:
        """(the voice, the log-mel [frames, 128] its x-vector came from) of a reference."""
        self._check_text(ref_text)
        codec = None if ref_text is None else self.codec  # a missing codec encoder fails first
        start = time.perf_counter()
        mel = log_mel(ref.samples)
        x_vector = self.speaker.x_vector(mel)
        codes = None if codec is None else codec.encode(ref.samples)
        log.info(
            "voice from %.1f s of audio in %.2f s (%s)",
            ref.seconds,
            time.perf_counter() - start,
            "x-vector" if codes is None else "x-vector and reference codes",
        )
        voice = Voice(x_vector, codes, ref_text, name, self.model.identity, self.model.kind, ref.seconds)
        return voice, mel

    def _check_text(self, ref_text: str | None) -> None:
        """A transcript is checked before any work (empty, invalid UTF-8, control tokens)."""
        if ref_text is None:
            return
        if not ref_text.strip():
            raise UsageError("the reference text is empty (leave it out for an x-vector voice)")
        self.model.count_tokens(ref_text)


def voice_from_audio(
    model: Model,
    audio: Audio,
    sample_rate: int | None = None,
    ref_text: str | None = None,
    name: str | None = None,
) -> Voice:
    """A cloned voice of a Base model from a recording (see `VoiceEncoders.voice`)."""
    return VoiceEncoders(model).voice(audio, sample_rate, ref_text, name)
