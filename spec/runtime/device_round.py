"""A decode step's whole speculative round queued on the device, with nothing for the host to
decide between its parts.

The general round reads the verify's targets on the host, walks each request's chain there,
then queues the draft extend and reads its chains: two waits for the device a step, and the
host's acceptance walk between them while the device idles. For greedy requests whose logits
need no processing (no penalty, bias, min_tokens or grammar), that speculate one full chain
and whose draft state the fixed-shape extend runs (spec/runtime/decode_extend.py), acceptance is a
comparison on the device: the accepted count is the length of the prefix where the chain
equals the target's argmax. The extend reads the targets and the counts where they are, so
verify, acceptance and extend are queued back to back. The targets and accepted counts come
home in a copy of their own as soon as the verify is done, so the host commits them while
the device runs the extend. The next chains come home in a second copy, which the host reads
only where it needs them (`SpecRequestState.drafts_from`): where the device queues the next
round's verify itself (below), it needs none, and the device runs the extend and that verify
while the host commits, schedules and gathers the next round; elsewhere the host queues the
next verify itself and reads the chains when it gathers the round after.

The extend then runs before the host commits: a request that the round ends (EOS, a stop
string) has drafted a chain it will not use, and its draft KV is freed with its target KV.
Output and statistics are those of the general round: acceptance is the same rule.

A request near its max_tokens may verify fewer drafts than K (`Request.lookahead`): it still
runs the round's fixed shape, its whole chain, and acceptance stops at its lookahead on the
device. Its positions past what it may commit write the padding slot, in the target and in
every depth; no real position attends to them (they come later). A round decided on the host
instead would cost the whole batch the general path each time one request nears its end.

The round's inputs are gathered in one pass over its requests (`gather_round`) and read from
arrays after that. When the next step will decode the requests this round leaves running,
their next verify is queued before the host reads this round's chains (`launch_verify`): the
chains go from the extend's output into the verify's input on the device. Where the verify
ran in a graph and every request holds its slots for the next round whatever this one
accepts (`holds_next_round`), the device queues that next verify before the host has read
this round's outcome (`queue_next_verify`): each request's span moves past its accepted
drafts and bonus token in the graph's buffer, on the device."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.executor.forward_batch import ForwardBatch, Span
from engine.executor.host_copy import HostCopy, int_tensor, recorded_event
from engine.request import Request
from engine.sampling.step_sampling import samples_from_logits_alone
from engine.sampling.verify_outputs import VerifyOutputs
from engine.scheduling.allocator import PADDING_SLOT
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool, grow_holders
from spec.runtime.acceptance import chain_verdicts
from spec.runtime.decode_extend import FixedDecodeExtend
from spec.runtime.extend_items import FixedExtendItem, GatheredItems, PendingDrafts


@dataclass
class RoundInputs:
    """What a round on the device reads of its requests, gathered in one pass over them (at
    batch 64, each further walk over the requests in Python costs the host tens of
    microseconds a round): per request its row, the position m of its newest token, its
    verify's tokens (the newest, then its chain of K) and KV slots (those it holds up to its
    lookahead, the padding slot after), its lookahead, and its item for the extend."""

    requests: list[Request]
    rows: np.ndarray  # [n]
    tokens: np.ndarray  # [n, K+1]
    slots: np.ndarray  # [n, K+1]
    lookaheads: list[int]
    items: list[FixedExtendItem]
    gathered: GatheredItems  # the items' table

    @property
    def newest(self) -> np.ndarray:
        """[n] each request's position m."""
        return self.gathered.newest

    def spans(self) -> list[Span]:
        """The verify's spans, for a forward that no captured graph runs."""
        return [
            Span(row, m, tokens, slots)
            for row, m, tokens, slots in zip(
                self.rows.tolist(), self.newest.tolist(), self.tokens.tolist(), self.slots.tolist()
            )
        ]


def gather_round(
    requests: list[Request], k: int, max_context_len: int, chains_read: bool = True
) -> RoundInputs | None:
    """The inputs of a round on the device for an engine that drafts chains of `k` into row
    tables of `max_context_len` positions, or None where some request's round cannot be
    decided on the device (see the module's doc; the fixed extend's own conditions are
    `FixedDecodeExtend.fits`'s). Each item may hold draft slots where its request holds target
    slots (at least up to the positions its round may commit); its committed tokens and hidden
    states are filled on the device (`FixedDecodeExtend.launch`). Without `chains_read` (a
    verify the device queued, whose chains are its extend's full ones, on the device), the
    host reads no chain: the tokens after each newest are left 0."""
    rows, newest, lookaheads, items, num_positions, seqs = [], [], [], [], [], []
    tokens: list[int] = []  # [n * (K+1)], flat: a nested list costs numpy twice as much
    slots: list[int] = []
    padding, padding_tokens = [PADDING_SLOT] * k, [0] * k
    # The items' verdicts and hidden states are filled on the device: placeholders, never read.
    empty, no_tokens = torch.empty(k + 1, 0), [0] * (k + 1)
    for req in requests:
        state = req.spec_state
        if state is None:
            return None
        m = req.num_tokens - 1
        lookahead = req.lookahead
        slots_held = req.slots
        held = len(slots_held)
        if not (
            req.num_draft_tokens == k
            and (not chains_read or len(state.chain) == k)
            # The round's fixed shape reaches position m + k in every row table.
            and m + 1 + k <= max_context_len
            and req.params.greedy
            and samples_from_logits_alone(req)
            # A verify launched before the scheduler's step finds its slots held.
            and held > m + lookahead
        ):
            return None
        assert req.kv_len == m
        rows.append(req.row)
        newest.append(m)
        tokens.append(req.newest_token_id)
        tokens += state.chain if chains_read else padding_tokens
        slots += slots_held[m : m + 1 + lookahead]
        slots += padding[: k - lookahead]
        lookaheads.append(lookahead)
        items.append(FixedExtendItem(state, m, no_tokens, empty, held))
        num_positions.append(held)
        seqs.append(state.seqs)
    n = len(requests)
    return RoundInputs(
        requests,
        np.array(rows, dtype=np.int64),
        np.array(tokens, dtype=np.int64).reshape(n, k + 1),
        np.array(slots, dtype=np.int64).reshape(n, k + 1),
        lookaheads,
        items,
        GatheredItems.from_lists(newest, num_positions, seqs),
    )


def chain_span(req: Request, drafts: list[int], num_held: int) -> Span:
    """`req`'s newest token then `drafts`, in its own slots after it: the newest and the first
    `num_held` drafts in slots it holds, the rest (which it holds no slots for) writing the
    padding slot."""
    m = req.num_tokens - 1
    assert req.kv_len == m
    slots = req.slots[m : m + 1 + num_held]
    padding = [PADDING_SLOT] * (len(drafts) - num_held)
    return Span(req.row, m, [req.newest_token_id, *drafts], slots + padding)


@dataclass
class DeviceRound:
    """A round read back from the device: per request its committed tokens (accepted drafts
    and the target's token) and accepted count; the extend's items, next chains and states,
    applied once the tokens are committed (`FixedDecodeExtend.apply`)."""

    tokens: list[list[int]]
    accepted: list[int]
    items: list[FixedExtendItem]
    # Per request its next chain, the chain's probabilities and its tree (a tree shape), on
    # their way from the extend's block (FixedDecodeExtend.launch) to the host.
    next_drafts: PendingDrafts
    next_chains: torch.Tensor  # [n, K] the same chains, on the device
    boundary: torch.Tensor  # [K-1, n, hidden]
    verify_hidden: torch.Tensor  # [n, K+1, width]: the target's over each verify span
    # The next round's verify of the same requests, queued from the device (queue_next_verify).
    next_verify: LaunchedVerify | None = None


def run_device_round(
    forward: ForwardBatch,
    outputs: VerifyOutputs,
    inputs: RoundInputs,
    fixed_extend: FixedDecodeExtend,
    k: int,
    target_pools: tuple[KVPool, ReqToTokenPool],
    forward_every_token=None,
) -> DeviceRound:
    """After the verify of `forward` (the spans of `inputs`, in request order) was queued,
    its `outputs` (logits and hidden states at every token): accept on the device (at most its
    lookahead's drafts a request), extend over `inputs.items` (which
    `FixedDecodeExtend.fits`). With `forward_every_token` (the next step is expected to
    decode the same requests), the next round's verify is queued behind the extend where
    `forward` ran in a graph and every request holds its slots for it: the device then runs
    it while the host commits this round. The host reads the committed tokens as soon as the
    verify is done; the next chains come home in a copy of their own, read only where the
    host needs them."""
    requests, items, lookaheads = inputs.requests, inputs.items, inputs.lookaheads
    n = len(requests)
    # Each request's span is its newest token then its chain: the chains are on the device,
    # and a verify graph of chains has compared them with the targets already.
    verdict_block = outputs.verdicts
    if verdict_block is None:
        verdict_block = chain_verdicts(outputs.logits, forward.input_ids, k + 1)
    if min(lookaheads) < k:
        limits = int_tensor(lookaheads, verdict_block.device)
        accepted = torch.minimum(verdict_block[:, k + 1], limits)
        verdict_block = torch.cat([verdict_block[:, : k + 1], accepted[:, None]], dim=1)
    targets, accepted = verdict_block[:, : k + 1], verdict_block[:, k + 1]
    hidden = outputs.hidden.view(n, k + 1, -1)
    # Whether the device will queue the next verify: its slots are taken below, after the
    # extend's launch (a pool too full to grow them leaves the host to queue it).
    queue_ahead = (
        forward_every_token is not None
        and forward.graph is not None
        and all(has_next_chain(req, k) for req in requests)
    )
    # The host reads the verdicts as soon as the verify is done (copied before anything else
    # is queued), and commits them while the device runs the extend, and the next verify where
    # it queues that; it reads the next chains only if it needs them (the worker's
    # finish_round).
    verdicts = HostCopy(verdict_block)
    next_chains, block, boundary, hidden = fixed_extend.launch(
        items, verdict_block, hidden, inputs.gathered
    )
    next_drafts = fixed_extend.pending_drafts(block)
    # The host's share of the next round, while the device runs this one.
    grow_for_next_round(requests, k, *target_pools, gathered=inputs.gathered)
    queued = None
    if queue_ahead and holds_next_round(requests, k):
        queued = queue_next_verify(forward, targets, accepted, next_chains, forward_every_token)
    tokens, counts = read_verdicts(verdicts, k)
    done = DeviceRound(tokens, counts, items, next_drafts, next_chains, boundary, hidden)
    if queued is not None:
        num_tokens = [req.num_tokens + len(t) for req, t in zip(requests, tokens)]
        done.next_verify = LaunchedVerify(list(requests), num_tokens, *queued)
    return done


def read_verdicts(verdicts: HostCopy, k: int) -> tuple[list[list[int]], list[int]]:
    """Each request's committed tokens and accepted count from a copy whose last K+2 columns
    are a round's verdicts (the K+1 committed candidates, then the accepted count), once it
    has landed."""
    verdicts.wait()
    block = verdicts.host.numpy()[:, -(k + 2) :].astype(np.int64)
    counts = block[:, k + 1].tolist()
    rows = block[:, : k + 1].tolist()
    return [row[: count + 1] for row, count in zip(rows, counts)], counts


@dataclass
class LaunchedVerify:
    """A round's verify queued before the engine's step asked for it: its requests and the
    token count each will have when it is taken, its batch and its (queued) outputs, and its
    inputs, gathered when it was queued (None when it was queued from the device, before the
    host knew how far the round before moved each request: gathered when taken)."""

    requests: list[Request]
    num_tokens: list[int]
    batch: ForwardBatch
    outputs: VerifyOutputs
    queued: torch.cuda.Event | None  # recorded behind it on a GPU
    inputs: RoundInputs | None = None
    # A tree round's: the trees it verifies, where the extend that grew them left them
    # ([n, 3 * nodes], spec.runtime.tree_round.gather_tree_round).
    tree_nodes: torch.Tensor | None = None

    def settle(self) -> None:
        """Wait until it has run: its KV writes land before its slots change hands (a
        transfer may write freed slots from another stream)."""
        if self.queued is not None:
            self.queued.synchronize()

    def done(self) -> bool:
        """Whether it has run, without waiting for it."""
        return self.queued is None or self.queued.query()

    def runs(self, requests: list[Request]) -> bool:
        """Whether it is the verify of `requests`: the same ones, in order, each with the
        tokens it was queued for (nothing else verifies a request's tokens)."""
        launched = self.requests
        return len(launched) == len(requests) and all(
            a is b and a.num_tokens == n for a, b, n in zip(launched, requests, self.num_tokens)
        )


def launch_verify(
    inputs: RoundInputs, batch: ForwardBatch, next_chains: torch.Tensor, forward_every_token
) -> LaunchedVerify:
    """Queue the next round's verify (`batch`, loaded from `inputs`) behind the extend that
    proposed `next_chains` [n, K], reading them on the device before the host has read them:
    the device goes from one round to the next without waiting for the host's bookkeeping in
    between (applying the chains, scheduling, gathering the next round)."""
    # The chains that gathering read are the round before's: the next ones are on the device.
    batch.set_span_tails(next_chains)
    outputs = forward_every_token(batch)
    num_tokens = [req.num_tokens for req in inputs.requests]
    return LaunchedVerify(
        inputs.requests, num_tokens, batch, outputs, recorded_behind(batch), inputs
    )


def holds_next_round(requests: list[Request], k: int, span: int | None = None) -> bool:
    """Whether every request's next round verifies a full chain (or a tree of `span` nodes)
    in slots it holds now, whatever this round accepts (at most k + 1 tokens committed): its
    slots reach position m + k + 1 + span (m + 2k + 1 for a chain), and its max_tokens leave k
    drafts to verify after the round."""
    ahead = k + 1 + (k if span is None else span)
    return all(
        len(req.slots) >= req.num_tokens + ahead and has_next_chain(req, k) for req in requests
    )


def has_next_chain(req: Request, k: int) -> bool:
    """Whether `req`'s max_tokens leave k drafts to verify after this round, whatever it
    commits (at most k + 1 tokens)."""
    return req.params.max_tokens - len(req.output_token_ids) >= 2 * k + 2


def queue_next_verify(
    forward: ForwardBatch,
    targets: torch.Tensor,
    accepted: torch.Tensor,
    next_chains: torch.Tensor,
    forward_every_token,
) -> tuple[ForwardBatch, VerifyOutputs, torch.cuda.Event | None]:
    """The verify after this round's (`forward`, a uniform graph batch whose graph ran it),
    queued before the host has read this round's outcome: each request's span moves on by its
    accepted count and the bonus token, and brings that bonus token (`targets` [n, K+1] at
    `accepted` [n]) then its next chain (`next_chains` [n, K]), all on the device. Its
    requests must hold their slots for it (`holds_next_round`)."""
    forward.graph.advance_uniform(forward, accepted, targets, next_chains)
    outputs = forward_every_token(forward)
    return forward, outputs, recorded_behind(forward)


def recorded_behind(batch: ForwardBatch) -> torch.cuda.Event | None:
    """An event behind the work queued so far, on a GPU."""
    if not batch.input_ids.is_cuda:
        return None
    return recorded_event(batch.input_ids.device)


# Positions a request's slots grow by beyond what the next round needs, when they must grow:
# each growth is a row-table write (a copy to the device and an indexed write, tens of
# microseconds of host time), which a round would otherwise pay in the target and every depth.
GROW_AHEAD = 16
# When some request must grow, every request within this many positions of having to grow
# grows with it: requests advance at their own pace, so growths one at a time would fall in
# almost every round of a large batch; grown together, a batch's growths come every few rounds.
GROW_TOGETHER = GROW_AHEAD // 2


def grow_for_next_round(
    requests: list[Request],
    k: int,
    kv_pool: KVPool,
    req_to_token_pool: ReqToTokenPool,
    span: int | None = None,
    gathered: GatheredItems | None = None,
) -> None:
    """Slots for the next round's verify whatever this one accepts (at most k + 1 tokens
    committed, then the newest and `span` drafts: k for a chain, a tree's nodes), and
    GROW_AHEAD more when they must grow, within each request's own bound (prompt + max_tokens,
    the row's length), where the pool keeps room for another step of every request after
    them: the scheduler then finds them held, and its step does not wait for the row-table
    write. When some request must grow, those within GROW_TOGETHER positions of it grow too,
    where the pool has room for that as well. `gathered`: the requests' positions and slots
    as gathered for this round, which tell in one comparison that none must grow (most
    rounds): slots held then are held now, a growth since only adds some."""
    ahead = k + 1 + (k if span is None else span)
    if gathered is not None and (gathered.num_positions >= gathered.newest + 1 + ahead).all():
        return
    grants, needed = [], []  # in request order, and whether each must grow
    max_context_len = req_to_token_pool.max_context_len
    for req in requests:
        bound = min(len(req.prompt_token_ids) + req.params.max_tokens, max_context_len)
        need = req.num_tokens + ahead
        held = len(req.slots)
        if held < bound and held < need + GROW_TOGETHER:
            grants.append((req, min(need + GROW_AHEAD, bound) - held))
            needed.append(held < need)
    if not any(needed):
        return
    allocator = kv_pool.allocator
    free, reserve = allocator.num_free + allocator.reclaimable(), (k + 1) * len(requests)
    alone = [grant for grant, must in zip(grants, needed) if must]
    for choice in (grants, alone):
        if free - sum(n for _, n in choice) >= reserve:
            grow_holders(kv_pool, req_to_token_pool, choice)
            return
