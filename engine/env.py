"""Every environment variable pdcluster reads, in one typed place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models live: $PDCLUSTER_CACHE_DIR, else $XDG_CACHE_HOME/pdcluster."""
    explicit = os.environ.get("PDCLUSTER_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "pdcluster"


def speculative_plan_default(environ: Mapping[str, str] | None = None) -> str:
    """How a speculating engine chooses each step's round plan (spec/runtime/round_plan.py) when its
    arguments do not say: $PDCLUSTER_SPECULATIVE_PLAN ("adaptive" or "always"), else
    "adaptive". The test suite sets "always", so that tests of the rounds' mechanics see a
    round at every step; the adaptive plan's tests ask for it."""
    env = os.environ if environ is None else environ
    return env.get("PDCLUSTER_SPECULATIVE_PLAN", "").strip() or "adaptive"


FAULT_PHASES = ("before", "during", "after", "stall")
FAULT_ENV_VARS = (
    "PDCLUSTER_FAULT_TRANSFER_FAIL_RATE",
    "PDCLUSTER_FAULT_TRANSFER_FAIL_PHASE",
    "PDCLUSTER_FAULT_KILL_AFTER_REQUESTS",
    "PDCLUSTER_FAULT_SEED",
)


@dataclass(frozen=True)
class FaultSettings:
    """Faults a node injects into itself, for tests and soaks; all off by default. A node reads
    them once, when it starts (`fault_settings`); the launcher forwards PDCLUSTER_* to the nodes.

    - PDCLUSTER_FAULT_TRANSFER_FAIL_RATE: the share of KV transfers (0..1) that fail;
    - PDCLUSTER_FAULT_TRANSFER_FAIL_PHASE: where, one or a comma-separated list to draw from:
      `before` the KV send (the prefill node sends a void transfer and says why), `during` it
      (the row arrives with the wrong room tag), `after` it (the decode node drops the landed
      transfer), `stall` (the prefill node never sends it: the transfer hangs to its timeout);
      default `during`;
    - PDCLUSTER_FAULT_KILL_AFTER_REQUESTS: the node's process exits when request N+1 reaches
      it (a GenerateRequest on a decode node or replica, a PrefillRequest on a prefill node);
    - PDCLUSTER_FAULT_SEED: seeds the draw (with the node's name), default 0."""

    transfer_fail_rate: float = 0.0
    transfer_fail_phases: tuple[str, ...] = ("during",)
    kill_after_requests: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.transfer_fail_rate <= 1.0:
            raise ValueError(
                f"PDCLUSTER_FAULT_TRANSFER_FAIL_RATE must be in [0, 1], got "
                f"{self.transfer_fail_rate}"
            )
        unknown = [p for p in self.transfer_fail_phases if p not in FAULT_PHASES]
        if unknown or not self.transfer_fail_phases:
            raise ValueError(
                f"PDCLUSTER_FAULT_TRANSFER_FAIL_PHASE: {unknown or 'empty'}; choose from "
                f"{', '.join(FAULT_PHASES)}"
            )
        if self.kill_after_requests is not None and self.kill_after_requests < 0:
            raise ValueError(
                f"PDCLUSTER_FAULT_KILL_AFTER_REQUESTS must be >= 0, got {self.kill_after_requests}"
            )

    @property
    def any(self) -> bool:
        return self.transfer_fail_rate > 0 or self.kill_after_requests is not None


def fault_settings(environ: Mapping[str, str] | None = None) -> FaultSettings:
    env = os.environ if environ is None else environ
    rate = env.get("PDCLUSTER_FAULT_TRANSFER_FAIL_RATE", "").strip()
    phases = env.get("PDCLUSTER_FAULT_TRANSFER_FAIL_PHASE", "").strip()
    kill = env.get("PDCLUSTER_FAULT_KILL_AFTER_REQUESTS", "").strip()
    seed = env.get("PDCLUSTER_FAULT_SEED", "").strip()
    try:
        return FaultSettings(
            transfer_fail_rate=float(rate) if rate else 0.0,
            transfer_fail_phases=(
                tuple(p.strip() for p in phases.split(",") if p.strip()) if phases else ("during",)
            ),
            kill_after_requests=int(kill) if kill else None,
            seed=int(seed) if seed else 0,
        )
    except ValueError as err:
        raise ValueError(f"fault injection settings: {err}") from None
