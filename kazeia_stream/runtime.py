"""The runtime: one set of engines for a model, and every way of speaking with them.

A `Runtime` owns the talker, the code predictor and the codec decoder of one model (one copy of
the weights), their thread settings, and the schedule (`scheduler`) on which up to
`max_streams` utterances share them, whichever session, thread or request asks: every stream's
next frame is generated, and decoded, in shared passes. Offline synthesis (`synthesize`,
`audio`) and live sessions (`open`) are its methods; the model below it only reads files.

    model = kazeia_stream.load_model("models/0.6b-cv")
    runtime = kazeia_stream.Runtime(model, max_streams=4)   # or: await Runtime.create(model)
    audio, rate = runtime.synthesize("Hello there.", voice="ryan")
    async with runtime.open(voice="ryan") as tts: ...
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from functools import cached_property
from typing import Any

import numpy as np
import trio

from . import blocking
from .cloning import Audio, VoiceEncoders
from .engine.code_predictor import CodePredictor
from .engine.codec import CodecDecoder, DecoderState
from .engine.frames import FrameLoop, GenerationOptions, max_text_tokens
from .engine.talker import Talker
from .engine.threads import SharedCores, Threads
from .errors import UsageError
from .model import Model
from .model.gguf_file import GGUFFile
from .model.model import VoiceArg
from .model.prompt import Prompt
from .model.voice import Voice
from .scheduler import Admission, Decoder, Generator
from .session import AUDIO_BUFFER, Session, single_errors

# A segment shorter than this many bytes could not hold a sentence: the instruction is too long.
MIN_SEGMENT_BYTES = 16
# Streams at once at most: each holds a talker KV slot (235 MB of address space at 0.6B and 1.7B,
# resident where written).
MAX_STREAMS = 64


class Runtime:
    """The engines of one model, created once (weights loaded) and shared by every session and
    call on it."""

    def __init__(self, model: Model, threads: Threads | None = None, max_streams: int = 1) -> None:
        if not 1 <= max_streams <= MAX_STREAMS:
            raise UsageError(f"max_streams must be between 1 and {MAX_STREAMS}, not {max_streams}")
        self.model = model
        self.threads = threads or Threads.default()
        # the decoder holds some while it runs beside the talker and code predictor
        self.cores = SharedCores(self.threads.cores)
        cfg = model.config
        # The code predictor and the talker take their weights first (in place in the files'
        # mappings where they can, their pages mapped now rather than in the first frame); then
        # the decoder's are read in its engine thread, holding a core (there the heap its frames'
        # buffers take is made ready, `heap.reserve`: in the thread that will use it), while the
        # vocabulary's load ends and, once the runtime is made, while a first utterance computes
        # its prompt and first frame: only its decode waits for the decoder (`codec`). Begun
        # first, the decoder's load took the core that the two engines' mapping needed, beside
        # the vocabulary's load (0.27 against 0.06 s for them; `--pipe`'s first byte 1.432
        # against 1.383 s, medians of 16 alternated runs, Zen 1; its weights cached since, a load
        # of 0.1-0.3 s, the two orders measured 1.879 and 1.882 s in one round of 12, the load
        # first 0.21 s ahead in another: left so). No engine gets a throw-away
        # step: the talker's and the code predictor's delayed the first audio from process start
        # by 0.1-0.5 s (a quiet to a busy host), the decoder's by 0.1 s (its frame took the core
        # the session's first rows needed), and each saved its engine's first call 20 ms at most.
        # But the generator's thread builds a first frame's graphs while the main thread waits
        # for the vocabulary (`_ahead`): a session's first chunk came 0.22-0.25 s after its
        # opening, against 0.26-0.41 (six alternated runs, Zen 1).
        self.admission = Admission(max_streams)  # streams beyond max_streams wait here, in order
        self.decoder = Decoder(
            lambda: self.codec, self.threads.decoder, self.cores, lambda: self.admission.active
        )
        self.code_predictor = CodePredictor(
            model.mmproj_file,
            cfg.code_predictor,
            self.threads.code_predictor,
            cores=self.cores,
            max_streams=max_streams,
        )
        self.talker = Talker(
            model.talker_file, cfg.talker, self.threads.talker, slots=max_streams, cores=self.cores
        )
        self._codec = self.decoder.start_call(lambda: self._load_codec(model.mmproj_file))
        self.frames = FrameLoop(self.talker, self.code_predictor, cfg)
        self.generator = Generator(self.frames, self.cores)
        self.generator.start_call(self._ahead)
        model.ready()  # the vocabulary, loading since the model was made: a refused file fails here
        # the decoder state after each in-context voice's reference frames
        self._primed: weakref.WeakKeyDictionary[Voice, DecoderState] = weakref.WeakKeyDictionary()

    def _ahead(self) -> None:
        """In the generator's thread while the vocabulary loads (the main thread waits for it):
        what a first utterance's first frame would wait for, but its arithmetic: its graphs
        (`FrameLoop.build_graphs`), and numpy's random module, which its sampler takes."""
        import numpy.random  # noqa: F401

        self.frames.build_graphs()

    def _load_codec(self, mmproj: GGUFFile) -> CodecDecoder:
        """The codec decoder; the graphs' calls meanwhile leave it a core."""
        with self.cores.lend(1):
            return CodecDecoder(mmproj, self.threads.decoder)

    @property
    def codec(self) -> CodecDecoder:
        """The codec decoder, once loaded (it loads in the decoder's thread from the runtime's
        making)."""
        return self._codec.wait()

    @property
    def max_streams(self) -> int:
        """The most utterances spoken at once; the others wait in order."""
        return self.admission.n

    @classmethod
    async def create(cls, model: Model, threads: Threads | None = None, max_streams: int = 1) -> Runtime:
        """Build the runtime in a worker thread: loading and warming the engines takes seconds,
        which must not block an event loop."""
        return await trio.to_thread.run_sync(lambda: cls(model, threads, max_streams))

    # -- streams on the engines --------------------------------------------------------------

    @asynccontextmanager
    async def stream(self) -> AsyncIterator[None]:
        """A place among the `max_streams` streams, for a task: beyond them, callers wait in
        the order they asked."""
        await self.admission.acquire()
        try:
            yield
        finally:
            self.admission.release()

    # -- prompts and segments ----------------------------------------------------------------

    def probe(self, voice: VoiceArg, language: str, instruct: str | None) -> Prompt:
        """A prompt of the session's settings: checks the voice and language, and holds the rows
        that every utterance of the session starts with."""
        return self.model.prompt("check", voice=voice, language=language, instruct=instruct)

    def max_segment_bytes(self, probe: Prompt) -> int:
        """The longest segment of text (in UTF-8 bytes, at least as many as its tokens) whose
        utterance fits in the talker's context after the session's fixed rows."""
        fixed = len(probe.prefill) - 1  # all but its one text token: the reference of an ICL voice
        n = max_text_tokens(self.talker.n_ctx - fixed)
        if n < MIN_SEGMENT_BYTES:
            raise UsageError(
                f"the instruction or the voice's reference takes {fixed} of the talker's "
                f"{self.talker.n_ctx} positions, leaving no room for the text"
            )
        return n

    def prepare(self, probe: Prompt, voice: VoiceArg = None) -> None:
        """Compute the rows that every utterance of a session starts with (instruction, role,
        voice, language), so that even its first utterance only computes its text's rows, and
        prime the decoder with an in-context voice's reference. Runs between the passes of
        other streams, in a free talker slot (none free: the utterance computes them)."""
        self.generator.prepare(probe)
        self._primed_state(voice)

    def decoder_state(self, voice: VoiceArg) -> DecoderState:
        """A decoder state to start an utterance from: a fresh one, or for an in-context voice
        the state after its reference frames (`_primed_state`), so that the first sample out is
        the first generated one. The official code decodes [reference codes + generated codes]
        and cuts the reference's samples: the same samples."""
        primed = self._primed_state(voice)
        return self.codec.new_state() if primed is None else copy.deepcopy(primed)

    def _primed_state(self, voice: VoiceArg) -> DecoderState | None:
        """For an in-context voice, the decoder state after its reference frames, decoded once
        per voice: on every core when no stream is speaking (the generator's calls wait), else
        on the decoder's, lent by the generator as for its passes; None for any other voice."""
        if not isinstance(voice, Voice) or voice.ref_codes is None:
            return None
        primed = self._primed.get(voice)
        if primed is None:
            primed = self.codec.new_state()
            codes = voice.ref_codes

            def prime() -> None:
                alone = not self.admission.active
                with self.cores.alone() if alone else self.cores.lend(self.threads.decoder) as threads:
                    self.codec.prime(primed, codes, threads)

            self.decoder.call(prime)
            self._primed[voice] = primed
        return primed

    # -- voices --------------------------------------------------------------------------------

    def make_streams_resident(self) -> None:
        """Make resident now the memory each of the `max_streams` streams' first utterance would
        fault in: its talker slot's first KV cells (112 MB at 0.6B, held from now on rather than
        from the first time that many streams run). The servers do, before they listen: on a
        virtual machine whose host backs fresh memory slowly, four requests at once got their
        first audio after 1.36-1.52 s without, 0.37-0.69 s with (0.93 s to make three slots
        resident; the Xeon of docs/measurements.md, "2026-12-07, early morning")."""
        for slot in range(self.max_streams):
            self.talker.populate(slot)

    @cached_property
    def encoders(self) -> VoiceEncoders:
        """The model's speaker and codec encoders (Base models), built on first use."""
        return VoiceEncoders(self.model)

    def voice_from_audio(
        self,
        audio: Audio,
        sample_rate: int | None = None,
        ref_text: str | None = None,
        name: str | None = None,
    ) -> Voice:
        """A cloned voice from a recording (a file, or samples at `sample_rate`): in-context
        with its transcript `ref_text`, x-vector only without."""
        return self.encoders.voice(audio, sample_rate, ref_text, name)

    # -- offline synthesis ---------------------------------------------------------------------

    def audio(
        self,
        text: str,
        *,
        voice: VoiceArg = None,
        language: str = "auto",
        instruct: str | None = None,
        text_streaming: bool = False,
        options: GenerationOptions = GenerationOptions(),
        live: bool = True,
    ) -> Iterator[np.ndarray]:
        """The PCM of each frame as a session speaks it (`Session.speak`: the same actors, the
        same pushes and overlap), for a synchronous caller: the session runs on a trio loop in
        a thread of its own. Not `live`: nobody hears it as it comes (a file, a whole
        response). A long text is spoken as segments (`model.segments`), back to back. Leaving
        the iteration early stops the utterance and frees its stream."""
        if _in_trio() and not self.admission.free():
            raise UsageError(
                "the engines are busy with sessions on this event loop: speak "
                "through a session, or call synthesize from a worker thread"
            )

        async def speak(send: blocking.Send[np.ndarray]) -> None:
            generation = dataclasses.asdict(options)
            async with self.open(
                voice=voice, language=language, instruct=instruct, text_streaming=text_streaming, **generation
            ) as tts:
                async for chunk in tts.speak(text, live=live):
                    await send(chunk.pcm)

        return blocking.iterate(speak, AUDIO_BUFFER, "kazeia-audio")

    def synthesize(
        self,
        text: str,
        *,
        voice: VoiceArg = None,
        language: str = "auto",
        instruct: str | None = None,
        seed: int | None = None,
        text_streaming: bool = False,
        **options: Any,
    ) -> tuple[np.ndarray, int]:
        """Speak `text` offline: (float32 samples, sample rate). Stops at EOS or at a cap derived
        from the text length. `options` are `GenerationOptions` fields (temperature, top_k...);
        like the official API, the whole text is in the prefill unless `text_streaming`."""
        chunks = list(
            self.audio(
                text,
                voice=voice,
                language=language,
                instruct=instruct,
                text_streaming=text_streaming,
                options=GenerationOptions(seed=seed, **options),
                live=False,
            )
        )
        audio = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
        return audio, self.model.sample_rate

    # -- live sessions -------------------------------------------------------------------------

    @asynccontextmanager
    async def open(
        self,
        *,
        voice: VoiceArg = None,
        language: str = "auto",
        instruct: str | None = None,
        text_streaming: bool = True,
        **generation: Any,
    ) -> AsyncIterator[Session]:
        """A speaking session. `generation` takes `GenerationOptions` fields (seed, temperature,
        top_k, ...). A bad voice or language fails here, not in the first utterance; the rows
        that all its utterances share are computed before the first text arrives."""
        options = GenerationOptions(**generation)
        probe = self.probe(voice, language, instruct)
        max_bytes = self.max_segment_bytes(probe)
        await trio.to_thread.run_sync(self.prepare, probe, voice)
        with single_errors():
            async with trio.open_nursery() as nursery:
                session = Session(
                    self, nursery, voice, language, instruct, text_streaming, options, max_bytes
                )
                try:
                    yield session
                finally:
                    nursery.cancel_scope.cancel()


def _in_trio() -> bool:
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return False
    return True
