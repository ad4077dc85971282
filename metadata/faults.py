"""Faults a node injects into itself (engine.env.FaultSettings, read once at node start): a
share of transfers fail at a chosen phase, and the process exits after a number of requests.
Off unless the environment asks; tests and soaks use it to exercise the recovery paths."""

from __future__ import annotations

import logging
import os
import random
import zlib

from engine.env import FaultSettings, fault_settings

log = logging.getLogger(__name__)
# Where each side injects: the prefill node before, during or instead of (stall) the send; the
# decode node after the transfer landed.
PREFILL_FAULT_PHASES = ("before", "during", "stall")
DECODE_FAULT_PHASES = ("after",)


class FaultInjector:
    def __init__(self, node_name: str, settings: FaultSettings | None = None) -> None:
        self.node_name = node_name
        self.settings = fault_settings() if settings is None else settings
        # Seeded per node, so that two nodes draw different transfers and a rerun the same.
        self._rng = random.Random(self.settings.seed * 1_000_003 + zlib.crc32(node_name.encode()))
        self.requests_seen = 0
        self.transfers_failed = 0
        if self.settings.any:
            log.warning("%s injects faults: %s", node_name, self.settings)

    def transfer_fault(self, phases: tuple[str, ...], earlier: tuple[str, ...] = ()) -> str | None:
        """The phase at which this transfer fails, among the configured ones this side injects
        (`phases`), or None. `earlier`: the phases injected before this side draws (on the
        other node), which the transfers reaching this draw have survived: the draw is
        conditioned on them so that, over both sides, the configured rate of transfers fail,
        spread evenly over the configured phases."""
        settings = self.settings
        configured = settings.transfer_fail_phases
        mine = [p for p in configured if p in phases]
        if settings.transfer_fail_rate <= 0 or not mine:
            return None
        share = settings.transfer_fail_rate / len(configured)
        survived = 1.0 - share * sum(1 for p in configured if p in earlier)
        if self._rng.random() >= share * len(mine) / survived:
            return None
        self.transfers_failed += 1
        return self._rng.choice(mine)

    def request_arrived(self) -> None:
        """Count a request; the process exits when one arrives past the configured number (a
        crash as the cluster sees one: no clean shutdown, no goodbye to any peer)."""
        limit = self.settings.kill_after_requests
        if limit is None:
            return
        self.requests_seen += 1
        if self.requests_seen > limit:
            log.error(
                "%s: exiting on request %d (PDCLUSTER_FAULT_KILL_AFTER_REQUESTS=%d)",
                self.node_name,
                self.requests_seen,
                limit,
            )
            logging.shutdown()
            os._exit(17)
