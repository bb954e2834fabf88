"""Messages and metrics passed between the stream's actors."""

from .messages import AudioChunk, Frame, SpokenAudio, StageTrace, TextTokens, UtteranceMetrics

__all__ = ["AudioChunk", "Frame", "SpokenAudio", "StageTrace", "TextTokens", "UtteranceMetrics"]
