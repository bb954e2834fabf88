"""trio actors of a stream, one per stage, and the audio sinks."""
