"""Errors a user can act on: each carries a one-line message naming what is wrong."""


def leaf(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups, which trio's nurseries wrap
    around everything that crosses them."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


class KazeiaError(Exception):
    """Base class: the CLI prints these as one line and exits non-zero."""


class ModelFileError(KazeiaError):
    """A model file is missing, truncated, or not the expected GGUF."""


class UsageError(KazeiaError):
    """Bad input from the caller: empty text, unknown voice or language, and the like."""


class EmptyTextError(UsageError):
    """The text to speak is empty or only whitespace (a blank line in `--pipe` is skipped)."""


class OutputError(KazeiaError):
    """The audio cannot be written where it was asked to go (a full disk, a closed pipe)."""
