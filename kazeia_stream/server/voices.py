"""The voices a server offers: a CustomVoice model's built-in speakers, or a Base model's saved
voices (loaded once, when the server starts)."""

from __future__ import annotations

from ..errors import UsageError
from ..model import Model
from ..model.model import VoiceArg
from ..model.voice import Voice, VoiceLibrary


class ServerVoices:
    """Voice names to what `Runtime.open` and `Runtime.synthesize` take."""

    def __init__(self, model: Model, library: VoiceLibrary | None = None) -> None:
        self.model = model
        self._saved: dict[str, Voice] = {}
        if model.kind == "base":
            library = library or VoiceLibrary()
            for name in library.names():
                try:
                    voice = library.load(name)
                    model.check_voice(voice)
                except UsageError:
                    continue  # made with a model of other widths, or not a voice file
                self._saved[name] = voice

    @property
    def names(self) -> list[str]:
        return sorted(self._saved) if self.model.kind == "base" else self.model.voices

    @property
    def default(self) -> str | None:
        names = self.names
        return names[0] if names else None

    def resolve(self, name: str | None) -> VoiceArg:
        """The voice of `name` (None: the default); a UsageError naming the voices there are."""
        name = name or self.default
        if self.model.kind == "base":
            if name is None or name not in self._saved:
                offered = ", ".join(self.names) or "none: kazeia-stream voice create NAME --ref-audio FILE"
                raise UsageError(f"unknown voice {name!r}; saved voices: {offered}")
            return self._saved[name]
        if self.model.kind != "custom_voice":
            return None  # VoiceDesign: the instruction is the voice
        if name is None or name.lower() not in self.model.config.speakers:
            raise UsageError(f"unknown voice {name!r}; this model has: {', '.join(self.names)}")
        return name.lower()
