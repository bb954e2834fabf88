"""A choice between two ways of running one computation that give the same numbers, made by
timing both in use.

Which is faster can depend on the CPU (`Qwen3LM._product`: on a Zen 5 one way, on a Xeon of
family 6 model 207 the other, by 20-30% each), so the first calls of each kind alternate the two ways,
and once each way has run `TRIALS` calls of that kind, the one with the lower median is kept
for that kind. Only calls of one kind (a row count and a thread count, say) are compared, so
the choice is fair whatever mix of calls comes; the results are the same either way.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable

TRIALS = 5


class Faster:
    """Ways False and True, per kind of call: `pick` the way for a call, `record` its time."""

    def __init__(self, trials: int = TRIALS) -> None:
        self.trials = trials
        self.chosen: dict[Hashable, bool] = {}
        self._times: dict[Hashable, tuple[list[float], list[float]]] = {}

    @property
    def trying(self) -> int:
        """Kinds still timed both ways."""
        return len(self._times)

    def pick(self, kind: Hashable) -> bool:
        """The chosen way for this kind; until there is one, the way that has run fewer times."""
        if kind in self.chosen:
            return self.chosen[kind]
        first, second = self._times.setdefault(kind, ([], []))
        return len(second) < len(first)

    def record(self, kind: Hashable, way: bool, seconds: float) -> None:
        """A call of this kind ran `way` in `seconds`."""
        if kind in self.chosen:
            return
        times = self._times[kind]
        times[way].append(seconds)
        if min(map(len, times)) >= self.trials:
            self.chosen[kind] = statistics.median(times[True]) < statistics.median(times[False])
            del self._times[kind]
