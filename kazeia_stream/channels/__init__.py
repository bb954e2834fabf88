"""Messages and metrics passed between the stream's actors."""

from .messages import AudioChunk, Frame, StageTrace, TextTokens, UtteranceMetrics

__all__ = ["AudioChunk", "Frame", "StageTrace", "TextTokens", "UtteranceMetrics"]
