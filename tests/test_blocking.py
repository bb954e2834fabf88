"""`blocking.iterate`: what a trio task sends, iterated from synchronous code."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from kazeia_stream import UsageError, blocking


def test_items_come_in_order_and_the_producer_s_error_as_itself():
    async def produce(send):
        for i in range(5):
            await trio.sleep(0)
            await send(i)
        raise UsageError("no more")

    items = blocking.iterate(produce, 2, "test")
    got = []
    with pytest.raises(UsageError, match="no more"):  # not wrapped in a group
        for item in items:
            got.append(item)
    assert got == [0, 1, 2, 3, 4]


def test_a_slow_caller_holds_the_producer_back():
    sent = []

    async def produce(send):
        for i in range(20):
            sent.append(i)
            await send(i)

    items = blocking.iterate(produce, 3, "test")
    ahead = []
    for item in items:
        time.sleep(0.01)
        ahead.append(len(sent) - 1 - item)
    # the items queued for the caller, and one in the producer's hands
    assert max(ahead) <= 3 + 1 and len(ahead) == 20


def test_leaving_early_cancels_the_producer_and_waits_for_its_end():
    ended = threading.Event()

    async def produce(send):
        try:
            for i in range(1000):
                await send(i)
                await trio.sleep(0.01)
        finally:
            ended.set()

    items = blocking.iterate(produce, 2, "test")
    assert next(items) == 0
    items.close()
    assert ended.is_set()  # done when `close` returns, not some time later
    assert not [t for t in threading.enumerate() if t.name == "test"]
