"""What a trio task produces, iterated from synchronous code: the task runs on a trio loop in a
thread of its own, so that a blocking caller (a thread, a script, an asyncio server's executor)
gets the sessions' actors and schedule, not a second copy of them."""

from __future__ import annotations

import queue
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from typing import Generic, TypeVar

import trio

T = TypeVar("T")
Send = Callable[[T], Awaitable[None]]


@dataclass
class _End:
    """The producer's end: returned, or raised `error`."""

    error: BaseException | None


def iterate(produce: Callable[[Send[T]], Awaitable[None]], buffer: int, name: str) -> Iterator[T]:
    """The items that `await produce(send)` sends, as they come; what it raises, raised here.
    At most `buffer` items wait for the caller (a slow caller holds the producer back). A
    caller that leaves early cancels the producer and waits for its end: what it held (a
    stream's place, a talker slot) is free when the iteration is closed."""
    return _Loop(produce, buffer, name).items()


class _Loop(Generic[T]):
    def __init__(self, produce: Callable[[Send[T]], Awaitable[None]], buffer: int, name: str) -> None:
        self._produce = produce
        self._items: queue.Queue[T | _End] = queue.Queue(buffer)
        self._token: queue.SimpleQueue[trio.lowlevel.TrioToken] = queue.SimpleQueue()
        self._cancel = trio.CancelScope()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def items(self) -> Iterator[T]:
        self._thread.start()
        token = self._token.get()
        try:
            while not isinstance(item := self._items.get(), _End):
                yield item
            if item.error is not None:
                raise item.error
        finally:
            if self._thread.is_alive():  # left early: the producer stops, its last send dropped
                with suppress(trio.RunFinishedError):
                    token.run_sync_soon(self._cancel.cancel)
                while not isinstance(self._items.get(), _End):
                    pass
                self._thread.join()

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # handed to the caller
            self._items.put(_End(exc))
        else:
            self._items.put(_End(None))

    async def _main(self) -> None:
        self._token.put(trio.lowlevel.current_trio_token())
        with self._cancel:
            await self._produce(self._send)

    async def _send(self, item: T) -> None:
        await trio.to_thread.run_sync(self._items.put, item, abandon_on_cancel=True)
