"""`Faster`: the choice between two ways of one computation, by their times in use."""

from __future__ import annotations

from kazeia_stream.engine.faster import Faster


def test_the_ways_alternate_until_each_has_its_trials_then_the_faster_is_kept():
    faster = Faster(trials=3)
    ways = []
    for times in [(1.0, 2.0), (1.2, 0.5), (1.1, 0.6)]:  # (way False, way True) seconds
        for _ in range(2):
            way = faster.pick("k")
            ways.append(way)
            faster.record("k", way, times[way])
    assert ways == [False, True] * 3
    assert faster.chosen == {"k": True} and not faster.trying  # median 0.6 against 1.1
    faster.record("k", True, 100.0)  # a chosen way stays chosen
    assert faster.pick("k") is True


def test_each_kind_of_call_is_compared_with_its_own_kind_only():
    faster = Faster(trials=2)
    for _ in range(2):
        for kind, times in (("small", {False: 1.0, True: 2.0}), ("large", {False: 9.0, True: 3.0})):
            for _ in range(2):
                way = faster.pick(kind)
                faster.record(kind, way, times[way])
    assert faster.chosen == {"small": False, "large": True}
