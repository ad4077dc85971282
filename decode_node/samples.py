"""Parallel samples of one prompt on a decode node (`GenerateRequest.samples`): one prefill,
one transfer of the prompt's target KV, forked slots for the other samples.

The samples preallocate together: the first (the *carrier*) takes slots for its prompt and its
first step, each other sample shares the carrier's prompt slots (`KVCacheManager.fork`: a slot
is freed when its last holder lets go) and takes slots of its own for its first step, and its
metadata row. In each draft depth d, a sample shares the carrier's slots for the prompt's
first n-1-d positions, those that read the prompt alone (spec.runtime.sample_extend), and takes its
own after them. One PrefillRequest names them all; each sample gets a transfer of its own (its first
token, chain, hidden state and each depth's positions from n-1-d on), and the carrier's carries
the prompt's target KV and all of each depth's. A sample joins the running batch once its
own transfer and the carrier's have landed; decode only appends, so no shared slot is written
twice.

Each sample stays a request of its own: its room, its abort, its failure. Aborting the carrier
keeps its transfer coming while another sample still waits for the prompt (the prefill node is
told only once every sample is aborted); a failed prompt (the carrier's transfer, or its
prefill) fails every sample still waiting for it, with the carrier's reason."""

from __future__ import annotations

import dataclasses
from collections import deque

from decode_node.tracked import Tracked
from metadata.messages import GenerateRequest, ParallelSample


class SampleGroup:
    def __init__(self, members: list[Tracked]) -> None:
        # Samples not yet preallocated (the first is in the prealloc queue), then every
        # preallocated sample, the carrier first.
        self.members = members
        self.carrier: Tracked | None = None  # set at preallocation
        self.prompt_landed = False
        self.prompt_error: str | None = None
        self.carrier_abort_deferred = False
        for tracked in members:
            tracked.group = self

    @property
    def preallocated(self) -> bool:
        return self.carrier is not None

    def prompt_room(self, tracked: Tracked) -> int:
        """What `tracked`'s TransferAnnounce must say carries its prompt's KV (0: its own)."""
        assert self.carrier is not None
        return 0 if tracked is self.carrier else self.carrier.message.room

    def waits_for_prompt(self, tracked: Tracked) -> bool:
        """`tracked`'s own transfer may have ended, but the prompt's KV has not landed yet."""
        return tracked is not self.carrier and not self.prompt_landed and not self.prompt_error

    def landed(self, tracked: Tracked, error: str | None) -> str | None:
        """`tracked`'s transfer ended, with `error` (None: it landed). Returns why the sample
        fails (its own error, or the prompt's), None if it may run. An aborted carrier still
        brings the prompt for the others: `error` then says whether its KV landed and was
        written to every rank (IncomingTransfers._land_aborted)."""
        if tracked is self.carrier:
            if error is None:
                self.prompt_landed = True
            else:
                self.failed(tracked, error)
            return error
        if error is None and self.prompt_error is not None:
            return f"the prompt's KV did not land: {self.prompt_error}"
        return error

    def failed(self, tracked: Tracked, reason: str) -> None:
        """`tracked` failed: if it carries the prompt, which has not landed, so does the
        prompt for every other sample."""
        if tracked is self.carrier and not self.prompt_landed and self.prompt_error is None:
            self.prompt_error = reason

    def leave_prealloc(self, tracked: Tracked, prealloc: deque[Tracked]) -> None:
        """`tracked` (not preallocated) is aborted: it leaves the group, and the next sample,
        if any, takes its place at the head of the group in the `prealloc` queue."""
        self.members.remove(tracked)
        if tracked in prealloc:
            at = prealloc.index(tracked)
            del prealloc[at]
            if self.members:
                prealloc.insert(at, self.members[0])

    def prefill_aborts(self, tracked: Tracked) -> list[int]:
        """The rooms to abort on the prefill node now that `tracked`, preallocated, is
        aborted: its own, except the carrier's while another sample waits for the prompt KV
        its transfer brings (deferred until the last such sample is aborted)."""
        if tracked is self.carrier and not self._carrier_may_abort():
            self.carrier_abort_deferred = True
            return []
        rooms = [tracked.message.room]
        if self.carrier_abort_deferred and self._carrier_may_abort():
            self.carrier_abort_deferred = False
            rooms.append(self.carrier.message.room)  # type: ignore[union-attr]
        return rooms

    def _carrier_may_abort(self) -> bool:
        # A sample holds its metadata row until it joins the running batch or ends.
        return not any(
            t is not self.carrier and not t.aborted and t.meta_row is not None for t in self.members
        )


def check_shareable(msg: GenerateRequest, max_rows: int) -> None:
    """Raises ValueError for parallel samples that a decode node does not share a prefill for
    (the router sends them as requests of their own): under a grammar, or more than it can
    hold at once (`max_rows`)."""
    if not msg.samples:
        return
    if msg.sampling.grammar is not None:
        raise ValueError("parallel samples under a grammar are not shared")
    if 1 + len(msg.samples) > max_rows:
        raise ValueError(f"{1 + len(msg.samples)} samples share a prefill, at most {max_rows}")


def sample_messages(msg: GenerateRequest) -> list[GenerateRequest]:
    """Each sample's request as if it came alone: its room, id and seed, the prompt's rest."""
    return [dataclasses.replace(msg, samples=[])] + [
        dataclasses.replace(
            msg,
            room=sample.room,
            request_id=sample.request_id,
            sampling=dataclasses.replace(msg.sampling, seed=sample.seed),
            samples=[],
        )
        for sample in msg.samples
    ]


def parallel_samples(forks: list[Tracked]) -> list[ParallelSample]:
    return [
        ParallelSample(t.message.room, t.message.request_id, t.message.sampling.seed) for t in forks
    ]
