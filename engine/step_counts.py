"""How many forward steps an engine ran, by kind, since it started: what tells a served run
from the offline engine's (a server admits prompts one by one as streams end, each a prefill or
mixed step and a drain of the step in flight; the offline engine admits them in waves) in a
node's stats and /metrics, and in the benchmarks."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.scheduling.scheduled_batch import ScheduledBatch


@dataclass
class StepCounts:
    """`decode`: steps that ran only the running requests (one token each, or a speculative
    round), those launched ahead by overlap scheduling included; `prefill`: steps of prompts
    (or their chunks) alone; `mixed`: prompts beside the running requests' decode;
    `drains`: times overlap scheduling waited for the step in flight before the batch could
    change (a prompt to admit, a retraction, a plan that is not a plain step), the device
    idle meanwhile."""

    decode: int = 0
    prefill: int = 0
    mixed: int = 0
    drains: int = 0

    def count(self, batch: ScheduledBatch) -> None:
        if not batch.is_prefill:
            self.decode += 1
        elif batch.decoding:
            self.mixed += 1
        else:
            self.prefill += 1

    @property
    def total(self) -> int:
        return self.decode + self.prefill + self.mixed

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
