"""A decode step's round over draft trees decided on the device: the tree counterpart of
spec/runtime/device_round.py's chains.

For greedy requests whose logits need no processing, whose next tree the fixed-shape extend
grew (spec/runtime/device_tree.py) and who hold their own KV slots for all of its nodes, the verify
of every request's tree, acceptance and the next extend are queued back to back, with nothing
for the host to decide between them:
- the nodes sit in the request's own slots after its newest token (node i at cache position
  m+1+i, its rotary position m + its level), so the verify takes and frees no slot (near its
  max_tokens a request holds too few, and its batch's round is the host's);
- acceptance is a walk down the levels on the device: a node is accepted where its token is
  the target's argmax at its parent's row and its parent is accepted (siblings carry distinct
  tokens, so at most one node a level is);
- the accepted nodes' KV moves on the device to the positions the request keeps (m+1 ..
  m+a), every layer's at once (on a GPU, acceptance, the committed tokens and the move are
  one Triton kernel, engine/kernels/tree_accept.py);
- the extend reads the committed tokens and the target's hidden states at the accepted path's
  rows where they are.
Two copies bring the round home: the committed tokens and accepted counts as soon as they are
decided, then the next chains and trees (the extend's block), read only where the host asks
for a request's drafts. Where the engine's next step is expected to verify the same
requests, the verify ran in a graph, and every request holds its slots for its next tree
whatever this round accepts and has k drafts left to verify after it, the device also queues
the next round's verify behind the extend, before the host has read anything
(`queue_next_tree_verify`): each span's root moves past the accepted path to the target's
token after it, and its nodes, positions, slots and ancestor masks are written from the
extend's trees into the graph's buffer. The device then runs the extend and verifies the
next trees while the host commits this round's tokens, as a round of chains does
(spec/runtime/device_round.py), and the round that takes that verify reads the trees' nodes where
the extend left them, not on the host (`gather_tree_round` with `device_nodes`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.executor.forward_batch import ForwardBatch, Span
from engine.executor.host_copy import HostCopy, int_tensor
from engine.kernels import triton_usable
from engine.request import Request
from engine.sampling.step_sampling import samples_from_logits_alone
from engine.sampling.verify_outputs import VerifyOutputs
from engine.scheduling.allocator import PADDING_SLOT
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool
from spec.runtime.acceptance import accept
from spec.runtime.decode_extend import FixedDecodeExtend
from spec.runtime.device_round import (
    DeviceRound,
    LaunchedVerify,
    grow_for_next_round,
    holds_next_round,
    read_verdicts,
    recorded_behind,
)
from spec.runtime.extend_items import FixedExtendItem, GatheredItems, tree_columns
from spec.runtime.tree import DraftTree


@dataclass
class TreeRoundInputs:
    """What a tree round on the device reads of its requests, gathered in one pass: each tree
    and its nodes as arrays (tokens, parents, levels), each request's row and newest position,
    and the extend's items and table. Its verify spans are built only where the verify is
    not queued already (`spans`). Where the device queued it, the trees are not read on the
    host: their nodes are where the extend before left them (`device_nodes`)."""

    requests: list[Request]
    trees: list[DraftTree] | None
    nodes: np.ndarray | None  # [n, 3, N]: tokens, parents (-1: the root), levels
    rows: np.ndarray  # [n]
    items: list[FixedExtendItem]
    gathered: GatheredItems
    num_nodes: int  # N
    # [n, 3 * N] on the device, float64 (the extend's block, spec/runtime/device_tree.py)
    device_nodes: torch.Tensor | None = None

    @property
    def newest(self) -> np.ndarray:
        return self.gathered.newest

    def spans(self) -> list[Span]:
        """Each request's verify span: its newest token then its tree's nodes, in its own
        slots after it (node i at cache position m+1+i, rotary position m + its level)."""
        assert self.trees is not None, "a verify the device queued has its spans there"
        spans = []
        for req, tree, m in zip(self.requests, self.trees, self.newest.tolist()):
            tokens = [req.newest_token_id, *tree.tokens]
            slots = req.slots[m : m + 1 + len(tree)]
            positions, visible = tree.positions(m), tree.visible()
            spans.append(Span(req.row, m, tokens, slots, positions=positions, visible=visible))
        return spans


def gather_tree_round(
    requests: list[Request],
    k: int,
    num_nodes: int,
    max_context_len: int,
    device_nodes: torch.Tensor | None = None,
) -> TreeRoundInputs | None:
    """The inputs of a tree round on the device, or None where some request's round cannot be
    decided there (see the module's doc): each request greedy with unprocessed logits, its
    tree of `num_nodes` nodes no deeper than its lookahead, its own slots held for them.
    `device_nodes`: the trees' nodes where the extend that grew them left them, for a verify
    the device queued (`LaunchedVerify.tree_nodes`): the host then reads no tree, and each
    request's lookahead covers every depth."""
    trees: list[DraftTree] | None = None if device_nodes is not None else []
    nodes, rows, items = [], [], []
    newest, num_positions, seqs = [], [], []
    empty = torch.empty(k + 1, 0)
    for req in requests:
        state = req.spec_state
        m = req.num_tokens - 1
        if not (
            state is not None
            and m + 1 + max(num_nodes, k) <= max_context_len
            and req.params.greedy
            and samples_from_logits_alone(req)
            and len(req.slots) > m + num_nodes
        ):
            return None
        if trees is None:
            if req.lookahead < k:
                return None
        else:
            tree: DraftTree | None = state.tree
            if tree is None or len(tree) != num_nodes or tree.depth > req.lookahead:
                return None
            trees.append(tree)
            nodes.append((tree.tokens, tree.parents, tree.levels))
        assert req.kv_len == m
        rows.append(req.row)
        held = len(req.slots)
        items.append(FixedExtendItem(state, m, [0] * (k + 1), empty, held))
        newest.append(m)
        num_positions.append(held)
        seqs.append(state.seqs)
    return TreeRoundInputs(
        requests,
        trees,
        None if trees is None else np.array(nodes, dtype=np.int64),
        np.array(rows, dtype=np.int64),
        items,
        GatheredItems.from_lists(newest, num_positions, seqs),
        num_nodes,
        device_nodes,
    )


def keep_accepted_kv(
    kv_pool: KVPool,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    newest: torch.Tensor,
    path: torch.Tensor,
    accepted: torch.Tensor,
) -> None:
    """Move the KV of each request's accepted nodes, written at cache positions m + row, to
    positions m+1 .. m+a, which it keeps: all gathered first, then scattered (a node's
    position is never below the one it moves to, so none is overwritten before it is read)."""
    k = path.shape[1] - 1
    kept = torch.arange(1, k + 1, device=path.device)
    moved = kept[None, :] <= accepted[:, None]
    base = newest[:, None]
    table_rows = rows[:, None]
    padding = torch.full_like(path[:, 1:], PADDING_SLOT)
    source = torch.where(moved, req_to_token[table_rows, base + path[:, 1:]], padding)
    target = torch.where(moved, req_to_token[table_rows, base + kept], padding)
    kv_pool.move_slots(source.reshape(-1), target.reshape(-1))


def run_tree_round(
    forward: ForwardBatch,
    outputs: VerifyOutputs,
    inputs: TreeRoundInputs,
    fixed_extend: FixedDecodeExtend,
    k: int,
    target_pools: tuple[KVPool, ReqToTokenPool],
    forward_every_token=None,
) -> DeviceRound:
    """After the verify of `forward` (`inputs.spans()`) was queued, its `outputs` (logits and
    hidden states at every token): accept on the device, keep the accepted nodes' KV, extend
    over `inputs.items` (which `FixedDecodeExtend.fits`). With `forward_every_token` (the next
    step is expected to verify the same requests), where `forward` ran in a graph and every
    request holds its slots for the next tree whatever this round accepts and has k drafts
    left to verify after it (`holds_next_round`), the next verify is queued behind the extend,
    its spans written from the extend's trees on the device (`queue_next_tree_verify`). The
    host reads the committed tokens as soon as they are decided, while the device runs the
    extend."""
    logits, hidden = outputs.logits, outputs.hidden
    requests = inputs.requests
    n, count = len(requests), inputs.num_nodes
    device = logits.device
    targets = logits.argmax(dim=-1).view(n, count + 1)
    if inputs.device_nodes is not None:
        nodes_on_device = inputs.device_nodes
        rows, newest = int_tensor(np.concatenate([inputs.rows, inputs.newest]), device).view(2, n)
    else:
        # Per request its nodes' tokens, parents and levels side by side, then the rows and
        # newest positions: one copy to the device.
        host = np.concatenate([inputs.nodes.ravel(), inputs.rows, inputs.newest])
        ints = int_tensor(host, device)
        nodes_on_device = ints[: 3 * n * count].view(n, 3 * count)
        rows, newest = ints[3 * n * count :].view(2, n)
    kv_pool, req_to_token_pool = target_pools
    if triton_usable(targets):
        from engine.kernels.tree_accept import accept_trees

        decided = accept_trees(
            targets, nodes_on_device, rows, newest, req_to_token_pool.req_to_token,
            kv_pool.kv_buffer, k,
        )  # fmt: skip
        path, verdict_block = decided[:, : k + 1], decided[:, k + 1 :]
        committed, accepted = verdict_block[:, : k + 1], verdict_block[:, k + 1]
    else:
        tokens, parents, _ = nodes_on_device.long().view(n, 3, count).unbind(1)
        accepted, path = accept(targets, tokens, parents, k)
        committed = targets.gather(1, path)
        verdict_block = torch.cat([committed, accepted[:, None]], dim=1)
        keep_accepted_kv(kv_pool, req_to_token_pool.req_to_token, rows, newest, path, accepted)
    # The host's share of the next round, while the device verifies this one.
    grow_for_next_round(
        requests, k, kv_pool, req_to_token_pool, span=max(k, count), gathered=inputs.gathered
    )
    queue_ahead = (
        forward_every_token is not None
        and forward.graph is not None
        and holds_next_round(requests, k, span=count)
    )
    # The host reads the verdicts as soon as they are decided, and commits them while the
    # device runs the extend (and the next verify where it queues that): copied before
    # anything else is queued.
    verdicts = HostCopy(verdict_block)
    hidden = hidden.view(n, count + 1, -1)
    hidden = hidden.gather(1, path[:, :, None].expand(-1, -1, hidden.shape[2]))
    next_chains, block, boundary, hidden = fixed_extend.launch(
        inputs.items, verdict_block, hidden, inputs.gathered
    )
    next_drafts = fixed_extend.pending_drafts(block)
    layout = fixed_extend.layout
    assert layout is not None and layout.budget == count
    queued = None
    if queue_ahead:
        nodes = block[:, tree_columns(k, count)]
        queued = queue_next_tree_verify(forward, committed, accepted, nodes, k, forward_every_token)
    tokens_out, counts = read_verdicts(verdicts, k)
    done = DeviceRound(
        tokens_out,
        counts,
        inputs.items,
        next_drafts,
        next_chains,
        boundary,
        hidden,
    )
    if queued is not None:
        num_tokens = [req.num_tokens + len(t) for req, t in zip(requests, tokens_out)]
        done.next_verify = LaunchedVerify(list(requests), num_tokens, *queued, tree_nodes=nodes)
    return done


def queue_next_tree_verify(
    forward: ForwardBatch,
    committed: torch.Tensor,
    accepted: torch.Tensor,
    nodes: torch.Tensor,
    k: int,
    forward_every_token,
) -> tuple[ForwardBatch, VerifyOutputs, torch.cuda.Event | None]:
    """The verify after this round's (`forward`, spans of one width in a graph of trees whose
    graph ran it), queued before the host has read this round's outcome: each request's
    root moves past its accepted nodes to the target's token after them (`committed` [n, K+1]
    at `accepted` [n]), and its nodes are its next tree's (`nodes` [n, 3 * budget], the
    extend's block: spec/runtime/device_tree.py), all on the device. Its requests must hold their
    slots for it (`holds_next_round`)."""
    forward.graph.advance_trees(forward, accepted, committed, nodes, k)
    outputs = forward_every_token(forward)
    return forward, outputs, recorded_behind(forward)
