"""What a decode node takes for a request before asking a prefill node to run it: target slots
for its prompt and first decode step, each draft depth's as many, and a metadata row. Parallel
samples of one prompt preallocate together, the others sharing the first one's prompt slots,
in the target and in every draft depth (decode_node.samples). A request that starts at a prefix
this node holds (decode_node.reuse) takes slots only for the positions after it."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from decode_node.reuse import hold_prefix, let_go_prefix
from decode_node.tracked import Tracked
from engine.engine_core import EngineCore
from engine.request import Request
from engine.scheduling.kv_pool import KVPool
from metadata.buffers import MetadataBuffers
from spec.runtime.sample_extend import shared_prompt_len


def first_step_slots(req: Request) -> int:
    """Target slots a request takes before its prefill: its prompt (what the transfer fills)
    and its first decode step (the first token, which comes with the transfer, and the
    look-ahead the step verifies); the draft depths take as many (`reserve`), which their first
    draft extend fills. Later steps grow through the scheduler, and never past prompt +
    max_tokens, which admission checked against the context and the pool."""
    return req.num_tokens + 1 + req.lookahead


def fork_step_slots(req: Request) -> int:
    """Target slots a sample sharing its prompt takes for itself before the prefill: its first
    decode step (the first token and the look-ahead); the prompt's are the first sample's."""
    return 1 + req.lookahead


def group_needs(requests: list[Request], engine: EngineCore) -> list[tuple[KVPool, int]]:
    """The slots a request (`requests`: it, then the parallel samples that share its prompt)
    takes at preallocation in the target's pool, then in each draft depth's when it drafts.
    In depth d the samples share the prompt only up to `shared_prompt_len`, one position less
    at each depth than in the target."""
    first, forks = requests[0], requests[1:]
    # Positions held already, in the target and in every depth (spec/runtime/prefix_drafts.py).
    first_own = first_step_slots(first) - first.cached_len
    target = first_own + sum(fork_step_slots(req) for req in forks)
    needs = [(engine.kv_cache.kv_pool, target)]
    if first.num_draft_tokens:
        n = len(first.prompt_token_ids)
        for d, depth in enumerate(engine.speculator.depths):  # type: ignore[union-attr]
            own = sum(first_step_slots(req) - shared_prompt_len(n, d) for req in forks)
            needs.append((depth.kv_pool, first_own + own))
    return needs


def never_fits(requests: list[Request], engine: EngineCore) -> str | None:
    """Why the request's first step can never be preallocated on this node, even with every
    pool empty (None: it can be)."""
    for pool, need in group_needs(requests, engine):
        if need > pool.capacity:
            prompt = f"a {len(requests[0].prompt_token_ids)}-token prompt"
            if len(requests) == 1:
                return (
                    f"the request for {prompt} needs {need} KV slots for its first step, "
                    f"more than this node's pool of {pool.capacity}"
                )
            return (
                f"{len(requests)} parallel samples of {prompt} need {need} KV slots for "
                f"their first step, more than this node's pool of {pool.capacity}; ask for "
                "fewer samples"
            )
    return None


def fits(requests: list[Request], engine: EngineCore, metadata: MetadataBuffers) -> bool:
    """Whether a request (`requests`: it, then the parallel samples that share its prompt) can
    preallocate now, keeping one decode step of the running requests free."""
    (_, target), *depths = group_needs(requests, engine)
    room = target + engine.scheduler.step_reserve()
    if metadata.num_free < len(requests) or not engine.kv_cache.can_grow(room, len(requests)):
        return False
    return all(pool.allocator.can_allocate(need) for pool, need in depths)


def make_draft_room(requests: list[Request], engine: EngineCore) -> None:
    """Where the target's pool has room for the request but a draft depth's has not, evict from the
    prefix cache until it has (or nothing is left to evict): the cache holds each depth's KV beside
    the target's and frees it only with the target's (spec/runtime/prefix_drafts.py), which a target
    allocation evicts when it needs room, but `fits` checks the depths before anything is taken, so
    their cached KV would keep the request waiting for good."""
    kv_cache = engine.kv_cache
    (_, target), *depths = group_needs(requests, engine)
    if not depths or not kv_cache.can_grow(target + engine.scheduler.step_reserve()):
        return
    for pool, need in depths:
        while not pool.allocator.can_allocate(need) and kv_cache.reclaimable():
            kv_cache.reclaim(need - pool.allocator.num_free)


def preallocate(
    requests: list[Request], engine: EngineCore, metadata: MetadataBuffers
) -> list[int]:
    """Take what `fits` checked; returns each request's metadata row."""
    kv_cache = engine.kv_cache
    first, forks = requests[0], requests[1:]
    kv_cache.grow(first, first_step_slots(first) - first.cached_len)
    if forks:
        kv_cache.fork(first, forks, len(first.prompt_token_ids))
        kv_cache.grow_many([(req, fork_step_slots(req)) for req in forks])
    for req in requests:
        if req.num_draft_tokens:
            prompt_of = None if req is first else first
            engine.speculator.reserve(  # type: ignore[union-attr]
                req, first_step_slots(req), prompt_of
            )
    return [metadata.allocate() for _ in requests]


def preallocate_ready(
    queue: deque[Tracked], engine: EngineCore, metadata: MetadataBuffers
) -> Iterator[tuple[Tracked, list[Tracked]]]:
    """Preallocate the requests at the head of `queue` while they fit, in order, each at the
    longest prefix of its prompt this node holds (decode_node.reuse): yields each one taken
    off the queue with its members (it, then the parallel samples of its prompt), their rows
    and slots taken. Retracted requests run again first: none is taken while one waits."""
    while queue and not engine.scheduler.waiting:
        tracked = queue[0]
        members = tracked.group.members if tracked.group is not None else [tracked]
        requests = [member.req for member in members]
        tracked.reused_tokens = hold_prefix(requests, engine)
        make_draft_room(requests, engine)
        if not fits(requests, engine, metadata):
            let_go_prefix(requests, engine)
            return
        queue.popleft()
        rows = preallocate(requests, engine, metadata)
        for member, row in zip(members, rows):
            member.meta_row = row
        if tracked.group is not None:
            tracked.group.carrier = tracked
        yield tracked, members
