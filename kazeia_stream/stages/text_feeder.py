"""Text feeder actor: text (whole, or pieces from an LLM) in, final token ids out, segment by
segment."""

from __future__ import annotations

from collections.abc import AsyncIterable

import trio

from ..channels import TextTokens
from ..errors import EmptyTextError
from ..model import Model
from ..model.segments import Part, Segmenter


async def feed_text(
    model: Model,
    source: str | AsyncIterable[str],
    max_segment_bytes: int,
    out: trio.MemorySendChannel[TextTokens],
) -> None:
    """Send the tokens of `source` as soon as they are final, a segment's last message marked
    `segment_end` (see `model.segments` for where a long text is split).

    A piece arriving while earlier tokens wait in the channel simply queues behind them: the
    generator takes text at its own pace (one token per frame in streaming mode).
    """
    async with out:
        segmenter = Segmenter(max_segment_bytes)
        tokenizer = model.incremental_tokenizer()
        spoken = False

        async def send(parts: list[Part]) -> None:
            nonlocal tokenizer, spoken
            for text, end in parts:
                ids = tokenizer.feed(text)
                if end:
                    ids += tokenizer.finish()
                    tokenizer = model.incremental_tokenizer()
                if ids or end:
                    spoken = True
                    await out.send(TextTokens(ids, segment_end=end))

        if isinstance(source, str):
            await send(segmenter.feed(source) + segmenter.finish())
        else:
            async for piece in source:
                await send(segmenter.feed(piece))
            await send(segmenter.finish())
        if not spoken:
            raise EmptyTextError("the text is empty")
