"""A loaded Qwen3-TTS model: its two GGUF files, its config, its tokenizer, its prompts."""

from __future__ import annotations

import logging
import weakref
from concurrent.futures import Future
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import EmptyTextError, ModelFileError, UsageError
from . import gguf_layout as L
from .config import ModelConfig, read_config
from .gguf_file import GGUFFile
from .llama import LlamaVocab, start_vocab
from .prompt import (
    ASSISTANT,
    ASSISTANT_TAIL,
    IM_START,
    ROLE_TOKENS,
    TAIL_TOKENS,
    TURN_END,
    TURN_END_TOKENS,
    USER,
    InContext,
    Prompt,
    TextFeed,
    build_prompt,
)
from .text_stream import IncrementalTokenizer
from .tokenizer import Tokenizer, special_tokens
from .voice import Voice, VoiceLibrary

VoiceArg = str | Voice | None

log = logging.getLogger(__name__)


class _TalkerRows:
    """Row lookup in the talker's `token_embd` (text rows first, then the codec rows) and in the
    code predictor's input tables (codebooks 1..15)."""

    def __init__(self, talker: GGUFFile, mmproj: GGUFFile, text_vocab_size: int) -> None:
        self._file, self._mmproj = talker, mmproj
        self._offset = text_vocab_size

    def text(self, ids: list[int]) -> np.ndarray:
        return self._file.rows(L.TALKER_TOKEN_EMBD, ids)

    def codec(self, ids: list[int]) -> np.ndarray:
        return self._file.rows(L.TALKER_TOKEN_EMBD, [self._offset + i for i in ids])

    def frames(self, codes: np.ndarray) -> np.ndarray:
        """The talker input of each frame [R, H]: C(codebook 0) + the sum of codebooks 1..15 in
        the code predictor's tables, as the decode loop (and the official ICL prompt) builds it."""
        rows = self.codec([int(c) for c in codes[:, 0]])
        for group in range(1, codes.shape[1]):
            rows += self._mmproj.rows(L.CP_EMBD, codes[:, group], table=group - 1)
        return rows


class Model:
    """A Qwen3-TTS model loaded from its GGUF pair: files, config, tokenizer and prompts, no
    compute (a `Runtime` holds the engines). Create it with `load_model`."""

    def __init__(self, talker_path: Path, mmproj_path: Path, vocab: Future[LlamaVocab] | None = None) -> None:
        self.talker_path, self.mmproj_path = talker_path, mmproj_path
        # libllama loads the talker's vocabulary (0.25-0.6 s; `vocab`, where the caller began
        # it) while what follows runs, the checks and a Runtime's engines included; its failure
        # raises where it is first used (a file the checks refuse fails with their error)
        self._llama = vocab or start_vocab(talker_path)
        self.talker_file = GGUFFile(talker_path)
        self.mmproj_file = GGUFFile(mmproj_path)
        _check_architecture(self.talker_file, self.mmproj_file)
        _check_pair(self.talker_file, self.mmproj_file)
        _check_checkpoint(self.talker_file, self.mmproj_file)
        codec_vocab = self.talker_file.tensor_shape(L.TALKER_OUTPUT)[0]
        n_tokens = len(self.talker_file.require(L.KEY_TOKEN_TYPES))
        names = self.talker_file.strings(L.KEY_TOKENS, range(n_tokens - codec_vocab, n_tokens))
        special = special_tokens(self.talker_file)

        def text_token_id(text: str) -> int:
            if text not in special:
                raise ModelFileError(f"{talker_path}: special token {text} is not in the vocabulary")
            return special[text]

        self.config: ModelConfig = read_config(self.talker_file, self.mmproj_file, names, text_token_id)
        self._rows = _TalkerRows(self.talker_file, self.mmproj_file, self.config.talker.text_vocab_size)
        self._voices: weakref.WeakKeyDictionary[Voice, tuple[np.ndarray, InContext | None]] = (
            weakref.WeakKeyDictionary()
        )

    def ready(self) -> None:
        """Wait for libllama's load of the talker's vocabulary, begun when the model was made:
        raises its `ModelFileError` if libllama refused the file."""
        self._llama.result()

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self._llama.result().vocab)

    @cached_property
    def pad_embedding(self) -> np.ndarray:
        """The text-side row added to each frame's input once the text is used up."""
        return self._rows.text([self.config.text_ids.tts_pad])[0]

    @property
    def kind(self) -> str:
        """custom_voice, base or voice_design."""
        return self.config.kind

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    @property
    def voices(self) -> list[str]:
        """Built-in speakers (CustomVoice models), lower case as in the official config."""
        return sorted(self.config.speakers)

    @property
    def languages(self) -> list[str]:
        """Languages the model knows, plus "auto"."""
        return ["auto", *sorted(self.config.languages)]

    @property
    def default_voice(self) -> str | None:
        """The voice used when none is given: the first built-in speaker by name, if any."""
        return self.voices[0] if self.voices else None

    def prefill(
        self,
        text: str,
        *,
        voice: VoiceArg = None,
        language: str = "auto",
        instruct: str | None = None,
        text_streaming: bool = True,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The talker's prefill embeddings [T, H] and the trailing text embeddings [N, H].

        With `text_streaming` only the first text token is in the prefill and one more text
        embedding joins each generated frame; without it the whole text is in the prefill.
        """
        prompt = self.prompt(
            text, voice=voice, language=language, instruct=instruct, text_streaming=text_streaming
        )
        return prompt.prefill, prompt.trailing

    def prompt(
        self,
        text: str,
        *,
        voice: VoiceArg = None,
        language: str = "auto",
        instruct: str | None = None,
        text_streaming: bool = True,
    ) -> Prompt:
        """`prefill`'s arrays with the number of text tokens they hold."""
        role_ids, body_ids = self._tokens(text)
        return self.prompt_from_tokens(
            body_ids,
            voice=voice,
            language=language,
            instruct=instruct,
            text_streaming=text_streaming,
            role_ids=role_ids,
        )

    def prompt_from_tokens(
        self,
        body_ids: list[int],
        *,
        voice: VoiceArg = None,
        language: str = "auto",
        instruct: str | None = None,
        text_streaming: bool = True,
        text_complete: bool = True,
        role_ids: list[int] | None = None,
    ) -> Prompt:
        """The prompt for text already tokenized (streaming text: only its first tokens; an
        in-context voice's streaming prompt takes `text_needed(voice)` of them, or all)."""
        speaker, spk_row, reference = self._resolve_voice(voice)
        language_id = self._resolve_language(language, speaker)
        instruct_ids = self._instruct_ids(instruct)
        role_ids = role_ids or self._encode(IM_START + ASSISTANT)
        return build_prompt(
            self._rows,
            self.config.text_ids,
            self.config.codec_ids,
            role_ids,
            body_ids,
            instruct_ids=instruct_ids,
            language_id=language_id,
            speaker=spk_row,
            text_streaming=text_streaming,
            text_complete=text_complete,
            reference=reference,
        )

    def text_needed(self, voice: VoiceArg) -> int:
        """Text tokens a streaming prompt needs before the first frame (unless the text ends
        sooner): 1, or for an in-context voice as many as its reference frames outnumber its
        transcript's tokens."""
        reference = self._resolve_voice(voice)[2]
        return 1 if reference is None else reference.text_needed()

    def check_voice(self, voice: Voice) -> None:
        """A cloned voice fits this model: a Base model of the same widths (a voice made with
        another checkpoint of the same size works, with a warning)."""
        cfg = self.config
        if self.kind != "base":
            raise UsageError(f"cloned voices need a Base model; this is a {self.kind} model")
        if len(voice.x_vector) != cfg.talker.hidden_size:
            raise UsageError(
                f"voice {voice.name or ''!r} was made with a model of width {len(voice.x_vector)}; "
                f"this one has {cfg.talker.hidden_size} (make the voice again with this model)"
            )
        if voice.ref_codes is not None and (
            voice.ref_codes.shape[1] != cfg.codec.num_quantizers
            or voice.ref_codes.min() < 0
            or voice.ref_codes.max() >= cfg.codec.codebook_size
        ):
            raise UsageError(f"voice {voice.name or ''!r}: its reference codes do not fit this model's codec")
        if voice.model and voice.model != self.identity:
            log.warning(
                "voice %r was made with another model (%s); it may sound different", voice.name, voice.model
            )

    def saved_voices(self, library: VoiceLibrary) -> dict[str, Voice]:
        """The voices of `library` that fit this model, by name (others are passed over: made
        with a model of other widths, or not voice files)."""
        fitting = {}
        for name in library.names():
            try:
                voice = library.load(name)
                self.check_voice(voice)
            except UsageError:
                continue
            fitting[name] = voice
        return fitting

    @cached_property
    def identity(self) -> str:
        """Which checkpoint the files come from: our converter's id, else the file's name."""
        return str(
            self.talker_file.get(L.KEY_CHECKPOINT_ID)
            or self.talker_file.get(L.KEY_NAME)
            or self.talker_path.stem
        )

    def count_tokens(self, text: str) -> int:
        """Text tokens of `text` as its prompt holds them."""
        return len(self._tokens(text)[1])

    def text_feed(self, prompt: Prompt) -> TextFeed:
        """The trailing text of `prompt`, to which streaming text adds its next tokens."""
        return TextFeed(
            self._rows, self.config.text_ids, prompt.trailing, prompt.n_text_tokens, prompt.text_complete
        )

    def incremental_tokenizer(self) -> IncrementalTokenizer:
        """A tokenizer for text arriving in pieces."""
        return IncrementalTokenizer(self._encode_text)

    def _tokens(self, text: str) -> tuple[list[int], list[int]]:
        """(role ids, body ids): the tokens of the assistant template around `text`, sliced as
        the official code slices them."""
        if not text or not text.strip():
            raise EmptyTextError("the text is empty")
        template = self._turn(ASSISTANT, text, ASSISTANT_TAIL)
        return template[:ROLE_TOKENS], template[ROLE_TOKENS:-TAIL_TOKENS]

    def _turn(self, role: str, text: str, tail: str) -> list[int]:
        """The tokens of IM_START + role + text + tail: the template's control tokens are parsed,
        the text's never (a "<|im_start|>" in the text is spoken as the characters it is). The
        role and the text are tokenized together, as the pre-tokenizer sees them."""
        return [*self._encode(IM_START), *self._encode_text(role + text), *self._encode(tail)]

    def _encode_text(self, text: str) -> list[int]:
        return self._encode(text, special=False)

    def _encode(self, text: str, special: bool = True) -> list[int]:
        """Tokens of a string; text ids beyond the text vocabulary would be codec rows."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError("the text is not valid UTF-8") from None
        ids = self.tokenizer.encode(text, special)
        if max(ids) >= self.config.talker.text_vocab_size:
            raise UsageError("the text contains a codec control token such as <|codec_0|>")
        return ids

    def _resolve_voice(self, voice: VoiceArg) -> tuple[str | None, np.ndarray | None, InContext | None]:
        """(built-in speaker name, the speaker row of the prompt, the in-context reference)."""
        if isinstance(voice, Voice):
            return None, *self._cloned(voice)
        if self.kind == "base":
            if voice is not None:
                raise UsageError(
                    f"a base model has no built-in voices (got {voice!r}); clone one from a recording"
                )
            raise UsageError(
                "a base model speaks in a cloned voice: give a reference recording (--ref-audio FILE), "
                "or make a voice once with `kazeia-stream voice create NAME --ref-audio FILE`"
            )
        if self.kind != "custom_voice":
            if voice is not None:
                raise UsageError(f"a {self.kind} model has no built-in voices (got {voice!r})")
            return None, None, None
        name = (voice or self.default_voice or "").lower()
        if name not in self.config.speakers:
            raise UsageError(f"unknown voice {voice!r}; this model has: {', '.join(self.voices)}")
        return name, self._rows.codec([self.config.speakers[name]])[0], None

    def _cloned(self, voice: Voice) -> tuple[np.ndarray, InContext | None]:
        """A cloned voice's speaker row and in-context reference, checked and built once per
        voice (every utterance of a session asks again)."""
        if voice not in self._voices:
            self.check_voice(voice)
            reference = None
            if voice.ref_codes is not None:
                text_ids = self._turn(ASSISTANT, voice.ref_text or "", TURN_END)[ROLE_TOKENS:-TURN_END_TOKENS]
                reference = InContext(text_ids, self._rows.frames(voice.ref_codes))
            self._voices[voice] = voice.x_vector.astype(np.float32), reference
        return self._voices[voice]

    def _resolve_language(self, language: str, speaker: str | None) -> int | None:
        name = (language or "auto").lower()
        if name != "auto" and name not in self.config.languages:
            raise UsageError(f"unknown language {language!r}; this model knows: {', '.join(self.languages)}")
        dialect = self.config.dialects.get(speaker or "")
        if dialect and name in ("chinese", "auto"):
            return self.config.languages[dialect]
        return None if name == "auto" else self.config.languages[name]

    def _instruct_ids(self, instruct: str | None) -> list[int] | None:
        if not instruct:
            return None
        if self.kind == "base":
            raise UsageError("a base model takes no instruction")
        if self.kind == "custom_voice" and self.config.size == "0b6":
            log.warning("the 0.6B CustomVoice model ignores instructions (as the official code does)")
            return None
        return self._turn(USER, instruct, TURN_END)


def _check_architecture(talker: GGUFFile, mmproj: GGUFFile) -> None:
    arch = talker.get(L.KEY_ARCHITECTURE)
    if arch != L.TALKER_ARCH:
        raise ModelFileError(
            f"{talker.path}: architecture is {arch!r}, not a Qwen3-TTS talker ({L.TALKER_ARCH!r})"
        )
    proj = mmproj.get(L.KEY_GEN_PROJECTOR_TYPE)
    if mmproj.get(L.KEY_ARCHITECTURE) != "clip" or proj != L.GEN_PROJECTOR_TYPE:
        raise ModelFileError(f"{mmproj.path}: not a Qwen3-TTS mmproj (generation projector {proj!r})")


def _check_checkpoint(talker: GGUFFile, mmproj: GGUFFile) -> None:
    """Files of our converter say which checkpoint they come from (published ones do not)."""
    ids = talker.get(L.KEY_CHECKPOINT_ID), mmproj.get(L.KEY_CHECKPOINT_ID)
    if None not in ids and ids[0] != ids[1]:
        raise ModelFileError(f"{talker.path} and {mmproj.path} were converted from different checkpoints")


def _check_pair(talker: GGUFFile, mmproj: GGUFFile) -> None:
    """Widths the two files share, for pairs without a checkpoint id (published files)."""
    hidden = talker.require(L.KEY_EMBEDDING_LENGTH)
    codec_vocab = talker.tensor_shape(L.TALKER_OUTPUT)[0]
    cp_width = mmproj.tensor_shape(L.CP_EMBD)[-1]
    cp_rows = mmproj.tensor_shape(L.CP_OUT_EMBD)[0]
    if (cp_width, cp_rows) != (hidden, codec_vocab):
        raise ModelFileError(
            f"{talker.path} and {mmproj.path} are not a pair: the talker has width {hidden} and "
            f"{codec_vocab} codec rows, the mmproj expects {cp_width} and {cp_rows}"
        )
