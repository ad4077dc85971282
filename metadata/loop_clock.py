"""Where a node's serving thread spends its time, part by part of its loop: what to compare
with the offline engine when served tokens/s fall short of it (a node whose thread is busy
all the time with its engine is limited by the engine; one that waits is starved by the
front end or the network). Kept by the serving thread, one clock read per part, and reported
in the node's stats() for /metrics."""

from __future__ import annotations

import time
from collections.abc import Callable

# waiting: for a message, with nothing to run (the inbox's poll);
# engine: the engine's steps, with the reports of each step's news to its streams;
# streams: handing each step's news on (detokenizing it, or sending it to the stream worker);
# other: everything else (messages handled, transfers, load reports, housekeeping).
LOOP_PARTS = ("waiting", "engine", "streams", "other")


class LoopClock:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._last = clock()
        self.seconds = dict.fromkeys(LOOP_PARTS, 0.0)

    def lap(self, part: str) -> None:
        """Charge the time since the last lap to `part`."""
        now = self._clock()
        self.seconds[part] += now - self._last
        self._last = now

    def stats(self) -> dict[str, float]:
        """Seconds by part since the node started; the part under way is not counted yet."""
        return dict(self.seconds)
