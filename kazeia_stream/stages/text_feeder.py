"""Text feeder actor: text (whole, or pieces from an LLM) in, final token ids out."""

from __future__ import annotations

from collections.abc import AsyncIterable

import trio

from ..channels import TextTokens
from ..errors import UsageError
from ..model import Model


async def feed_text(model: Model, source: str | AsyncIterable[str],
                    out: trio.MemorySendChannel[TextTokens]) -> None:
    """Send the tokens of `source` as soon as they are final; the last message is `complete`.

    A piece arriving while earlier tokens wait in the channel simply queues behind them: the
    generator takes text at its own pace (one token per frame in streaming mode).
    """
    async with out:
        stream = model.text_tokens()
        if isinstance(source, str):
            _check(source)
            await out.send(TextTokens(stream.feed(source) + stream.finish(), complete=True))
            return
        async for piece in source:
            ids = stream.feed(piece)
            if ids:
                await out.send(TextTokens(ids, complete=False))
        _check(stream.text)
        await out.send(TextTokens(stream.finish(), complete=True))


def _check(text: str) -> None:
    if not text.strip():
        raise UsageError("the text is empty")
