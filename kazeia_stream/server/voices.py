"""The voices a server offers: a CustomVoice model's built-in speakers, or a Base model's saved
voices (loaded once, when the server starts)."""

from __future__ import annotations

from ..errors import UsageError
from ..model import Model
from ..model.model import VoiceArg
from ..model.voice import VoiceLibrary


class ServerVoices:
    """Voice names to what `Runtime.open` and `Runtime.synthesize` take."""

    def __init__(self, model: Model, library: VoiceLibrary | None = None) -> None:
        self.model = model
        self._saved = model.saved_voices(library or VoiceLibrary()) if model.kind == "base" else {}

    @property
    def names(self) -> list[str]:
        return sorted(self._saved) if self.model.kind == "base" else self.model.voices

    def resolve(self, name: str | None) -> VoiceArg:
        """The voice of `name` (None: the default); a UsageError naming the voices there are. A
        built-in speaker's name is the model's to check."""
        if self.model.kind == "base":
            name = name or (self.names[0] if self.names else None)
            if name is None or name not in self._saved:
                offered = ", ".join(self.names) or "none: kazeia-stream voice create NAME --ref-audio FILE"
                raise UsageError(f"unknown voice {name!r}; saved voices: {offered}")
            return self._saved[name]
        if self.model.kind != "custom_voice":
            return None  # VoiceDesign: the instruction is the voice
        return name
