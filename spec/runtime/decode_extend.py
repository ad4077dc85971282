"""The draft extend of a decode step as one forward of fixed shape through every depth, captured
as a single CUDA graph per batch size where the engine runs graphs.

After a verify step that accepted a drafts of a request whose newest position was m, depth d
extends over positions [m-d, m+a] (spec/runtime/draft_extend.py): a+1+d positions, which vary with
a. Here every request runs K+1+d positions from m-d whatever a is. Rows past m+a read padding and
write KV past the depth's valid prefix, which the next extend recomputes, and no real row
attends to them (they come later), so every request of a batch has one shape, and the whole
extend (K depths, each proposing its draft) is one graph: one replay and one copy to the host
per step, where the general path replays a graph, builds inputs and patches tokens per depth.

Depth d's row j (position m-d+j) reads:
- token x_{m+1+j}: the tokens the verify step committed for j <= a, draft t (from depth t-1 of
  this extend) for j = a+t, padding after;
- depth 0: the target's hidden state at position m+j (row j of the request's verify span);
  depth d > 0: row 0 the boundary state depth d-1 kept at m-d last time, row j depth d-1's
  output row j-1.
Depth d keeps its output at row a as the new boundary (position m+a-d) and proposes draft d+1
from row a+d (position m+a)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.executor.forward_batch import ForwardBatch, device_batch
from engine.executor.graph_capture import capture_graphs
from engine.executor.graph_inputs import batch_size_buckets, bucket_for
from engine.executor.host_copy import HostCopy
from spec.draft_vocab import DraftHead
from spec.runtime.device_tree import DeviceTree, ForkColumns, TreeLayout
from spec.runtime.draft_runner import DraftRunner
from spec.runtime.extend_buffers import ExtendBuffers
from spec.runtime.extend_items import FixedExtendItem, GatheredItems, PendingDrafts, grow_depths
from spec.runtime.state import BatchRows, SpecRequestState, whole_batch
from spec.runtime.tree import TreeShape


class FixedDecodeExtend:
    """Runs the decode step's draft extend for batches of `FixedExtendItem`s (see the module's
    docstring), eagerly or, with `graph_max_bs`, replaying a graph per batch-size bucket.
    With a tree `shape` (not a chain), each depth also expands the tree's other nodes and the
    extend proposes each request's next tree (spec/runtime/device_tree.py)."""

    def __init__(
        self,
        depths: list[DraftRunner],
        head: DraftHead,
        graph_max_bs: int,
        shape: TreeShape | None = None,
    ) -> None:
        self.depths = depths
        self.head = head
        self.k = len(depths)
        self.widths = [self.k + 1 + d for d in range(self.k)]  # each depth's main rows
        first = depths[0]
        self.device = torch.device(first.device)
        self.layout: TreeLayout | None = None
        self.fork_columns: ForkColumns | None = None
        self.fork_rows = [0] * self.k
        # A tree whose spans overflow the visibility masks is never run here (`fits`).
        self.declines_all = False
        if shape is not None and not shape.is_chain:
            layout = TreeLayout(shape, self.k)
            self.declines_all = not layout.fits_masks
            if not self.declines_all:
                self.layout = layout
                self.fork_columns = ForkColumns(layout, self.device)
                self.fork_rows = layout.fork_rows
        self.spans = [w + f for w, f in zip(self.widths, self.fork_rows)]
        self.dtype = first.kv_pool.dtype
        self.in_width = first.module.hnorm.weight.shape[0]
        self.hidden_size = first.module.fc.weight.shape[0]
        self.buckets = batch_size_buckets(graph_max_bs) if graph_max_bs else []
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, ExtendBuffers, tuple]] = {}
        self.num_replays = 0
        if self.buckets:
            self._capture()

    def fits(self, items: list[FixedExtendItem], gathered: GatheredItems | None = None) -> bool:
        """Whether this path runs `items`: every request verified a full chain and holds
        every depth's KV up to where this extend starts (m-d >= 1, valid there); its forks'
        rows, if any, fit in each depth's row table and visibility masks; and no depth dumps
        tensors (the general path records each depth's forward). `gathered`: the items'
        table, whose builder vouches for their committed tokens and hidden states (a round on
        the device fills those there)."""
        k = self.k
        if not items:
            return False
        if gathered is not None:
            return self._reaches(max(item.m for item in items)) and gathered.aligned(k)
        return self.fits_states([(item.state, item.m) for item in items]) and all(
            len(item.verify_hidden) == k + 1 and 1 <= len(item.committed) <= k + 1 for item in items
        )

    def fits_states(self, states: list[tuple[SpecRequestState, int]]) -> bool:
        """`fits` for requests in these draft states whose newest token is at position m
        (state, m), before their verify: what they hold then decides it, whatever the verify
        commits (a request that goes on commits 1 to K+1 tokens)."""
        if not states or not self._reaches(max(m for _, m in states)):
            return False
        k = self.k
        return all(
            m >= k and all(seq.valid_len == m - d for d, seq in enumerate(state.seqs))
            for state, m in states
        )

    def _reaches(self, newest: int) -> bool:
        """Whether this path may run at all, for requests whose newest position is at most
        `newest`: its rows reach position m + K (and the forks' past it) in every row table."""
        if self.declines_all or any(runner.dumper is not None for runner in self.depths):
            return False
        reach = newest + self.k + 1 + max(self.fork_rows)
        return reach <= self.depths[0].req_to_token_pool.max_context_len

    @torch.inference_mode()
    def run(self, items: list[FixedExtendItem]) -> None:
        """Extend every depth over `items` and give each its next chain (and tree) and
        boundary states."""
        _, block, boundary, verify_hidden = self.launch(items)
        drafts = self.pending_drafts(block)
        counts = [len(item.committed) for item in items]
        self.apply(items, counts, drafts, list(range(len(items))), boundary, verify_hidden)

    def pending_drafts(self, block: torch.Tensor) -> PendingDrafts:
        """The next drafts of a `launch`'s block, copied to the host behind the work queued so
        far and read when first asked for."""
        budget = None if self.layout is None else self.layout.budget
        return PendingDrafts(HostCopy(block), self.k, budget)

    @torch.inference_mode()
    def launch(
        self,
        items: list[FixedExtendItem],
        verdicts: torch.Tensor | None = None,
        verify_hidden: torch.Tensor | None = None,
        gathered: GatheredItems | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queue the extend of every depth over `items`; returns, on the device, the next
        chains [n, K], the same chains and their probabilities in one float64 block [n, 2K]
        (what the host reads: ids are exact in float64; `split_chains`) followed by the
        trees' nodes when the shape is a tree (`split_trees`) and the verdicts it read
        (K+2 columns, `spec.runtime.device_round.read_verdicts`), the boundary states
        [K-1, n, hidden] and the verify's hidden states it read [n, K+1, width].
        With `verdicts` [n, K+2] (row i: the verify's K+1 targets, the first a + 1 of them
        committed, then the accepted count a) and `verify_hidden` [n, K+1, width] on the
        device, the items' own `committed` and `verify_hidden` are not read: the host need not
        have seen the verify's outcome. `gathered`: the items' table, if their caller has it."""
        k = self.k
        if gathered is None:
            gathered = GatheredItems.of(items)
        grow_depths(self.depths, gathered, k, self.fork_rows)
        if verify_hidden is None:
            verify_hidden = torch.stack([item.verify_hidden for item in items])
        size = bucket_for(self.buckets, len(items)) if self.buckets else None
        if size is not None:
            graph, buffers, outputs = self.graphs[size]
            self._fill(buffers, items, gathered, verdicts, verify_hidden)
            graph.replay()
            self.num_replays += 1
            chains, block, boundary = outputs
        else:
            buffers = self._buffers(len(items))
            self._fill(buffers, items, gathered, verdicts, verify_hidden)
            chains, block, boundary = self._forward(buffers, eager_items=items)
        n = len(items)
        # Out of the graph's buffers: kept as views until the next extend.
        return chains[:n], block[:n], boundary[:, :n].clone(), verify_hidden

    def apply(
        self,
        items: list[FixedExtendItem],
        counts: list[int],
        drafts: PendingDrafts,
        rows: list[int],
        boundary: torch.Tensor,
        verify_hidden: torch.Tensor,
    ) -> None:
        """Give each item its next chain (and tree) and boundary states after `launch`:
        `counts[i]` tokens committed by its verify, request `rows[i]`'s drafts of `drafts`
        (read when first asked for: the host need not wait for the extend here), row i of
        `boundary` [K-1, n, hidden] and of `verify_hidden` [n, K+1, width]."""
        for i, (item, count, row) in enumerate(zip(items, counts, rows)):
            state = item.state
            m_next = item.m + count  # the newest position after the step
            state.drafts_from(drafts, row)
            state.boundary = BatchRows(boundary, i)
            state.hidden_at = (verify_hidden, (i, count - 1))
            for d, seq in enumerate(state.seqs):
                seq.valid_len = max(0, m_next - d)

    def _buffers(self, size: int) -> ExtendBuffers:
        padding_rows = [runner.req_to_token_pool.padding_row for runner in self.depths]
        return ExtendBuffers(size, self.k, self.spans, padding_rows, self.fork_rows, self.in_width,
                        self.hidden_size, self.dtype, self.device)  # fmt: skip

    def _fill(
        self,
        buffers: ExtendBuffers,
        items: list[FixedExtendItem],
        gathered: GatheredItems,
        verdicts: torch.Tensor | None,
        verify_hidden: torch.Tensor,
    ) -> None:
        """Every input of the batch, padded to the buffers' size: one copy of the integers, one
        of the verify's hidden states, one of the boundary states (none per request when the
        requests are those of the last extend, in its order); then, when given (on the
        device), the verify's verdicts over the integers' placeholders for them."""
        n = len(items)
        self._int_values(buffers, None if verdicts is not None else items, gathered)
        buffers.staged.upload()
        if verdicts is not None:
            buffers.verdicts[:n] = verdicts
        buffers.verify_hidden[:n].copy_(verify_hidden)
        if self.k > 1:
            boundaries = [item.state.boundary for item in items]
            old = whole_batch(boundaries)
            if old is None:
                old = torch.stack(
                    [torch.stack([b[d] for b in boundaries]) for d in range(self.k - 1)]
                )
            buffers.boundary[:, :n].copy_(old)

    def _int_values(
        self,
        buffers: ExtendBuffers,
        items: list[FixedExtendItem] | None,
        gathered: GatheredItems | None,
    ) -> None:
        """The integer block, in the host mirror: the gathered items' rows first, padding
        requests after (token 0 from position 0, over the padding row). Their verdicts
        (committed tokens, accepted count) are read from `items`, unless None (filled on the
        device)."""
        k = self.k
        values = buffers.staged.writable()
        values[:] = buffers.padding
        if gathered is None:
            return
        newest = gathered.newest
        n = len(newest)
        if items is not None:
            verdicts = buffers.host_verdicts
            for i, item in enumerate(items):
                verdicts[i, : len(item.committed)] = item.committed
            verdicts[:n, k + 1] = [item.accepted for item in items]
        for d, (width, columns) in enumerate(zip(self.spans, buffers.columns)):
            _, positions, rows, seq_lens = buffers.host[d]
            start = newest - d
            positions[:n] = start[:, None] + columns
            rows[:n] = gathered.rows[d]
            seq_lens[:n] = start + width

    def _forward(
        self,
        buffers: ExtendBuffers,
        metadata: list | None = None,
        eager_items: list[FixedExtendItem] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every depth over the buffers: the chains [size, K], the chains and their
        probabilities as one float64 block [size, 2K] (then the trees, for a tree shape, then
        the verdicts it read, K+2 columns), and the new boundary states [K-1, size, hidden].
        What a graph captures."""
        size, k = buffers.size, self.k
        accepted = buffers.accepted
        every = buffers.every
        # Each depth reads the committed tokens from the verdicts, one copy a depth here
        # rather than one call into torch a depth each round.
        for ids in buffers.ids:
            ids[:, : k + 1] = buffers.verdicts[:, : k + 1]
        # Column a + t of each request, t = 0..K-1, in one kernel: where draft t goes in each
        # later depth's tokens, and depth t's proposing row.
        after = accepted[:, None] + buffers.steps
        tree = None
        if self.layout is not None:
            assert self.fork_columns is not None
            tree = DeviceTree(self.layout, self.fork_columns, size, self.device)
        drafts: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        boundaries: list[torch.Tensor] = []
        previous: torch.Tensor | None = None
        for d, (runner, width, span) in enumerate(zip(self.depths, self.widths, self.spans)):
            ids = buffers.ids[d]
            for t, draft in enumerate(drafts, start=1):
                ids.scatter_(1, after[:, t : t + 1], draft[:, None])
            if d == 0:
                hidden = buffers.verify_hidden
            else:
                assert previous is not None
                boundary = buffers.boundary[d - 1][:, None]
                hidden = torch.cat([boundary, previous[:, : width - 1]], dim=1)
            if tree is not None and span > width:
                assert previous is not None
                hidden = torch.cat([hidden, self._fork_inputs(buffers, d, tree, previous)], 1)
            batch = self._batch(buffers, d, runner, eager_items)
            # A graph's metadata points at the buffers; an eager forward prepares its own.
            batch.attn_metadata = (
                metadata[d] if metadata is not None else runner.attention.prepare(batch)
            )
            (out,) = runner.forward_tokens(batch, hidden.reshape(size * span, -1))
            out = out.view(size, span, -1)
            proposing = out[every, after[:, d]]
            if tree is None:
                top, top_p = self.head.propose_top(proposing, 1)
                drafts.append(top[:, 0])
                probs.append(top_p[:, 0])
            else:
                # The greedy node's row, then each fork's last.
                nodes = proposing[:, None]
                if span > width:
                    nodes = torch.cat([nodes, tree.fork_last_rows(out, d)], dim=1)
                node_width = self.layout.shape.width_at(d)
                top, top_p = self.head.propose_top(nodes.flatten(0, 1), node_width)
                top = top.view(size, nodes.shape[1], -1)
                top_p = top_p.view(size, nodes.shape[1], -1)
                drafts.append(top[:, 0, 0])
                probs.append(top_p[:, 0, 0])
                tree.add_level(d, top, top_p)
            if d < k - 1:
                boundaries.append(out[every, accepted])
            previous = out
        boundary = torch.stack(boundaries) if boundaries else buffers.boundary[:0]
        chains = torch.stack(drafts, dim=1)
        parts = [chains.double(), torch.stack(probs, dim=1).double()]
        if tree is not None:
            parts.append(tree.select())
        # The verdicts the extend read last: a round's one copy home brings its committed
        # tokens and counts with its next chains (spec.runtime.device_round.read_verdicts).
        parts.append(buffers.verdicts.double())
        return chains, torch.cat(parts, dim=1), boundary

    def _fork_inputs(
        self, buffers: ExtendBuffers, d: int, tree: DeviceTree, previous: torch.Tensor
    ) -> torch.Tensor:
        """Depth d's fork rows, after its main rows: their tokens, positions and visibility
        bits into the buffers, and their hidden states [size, fork rows, width] (read from
        depth d-1's output `previous`)."""
        accepted = buffers.accepted
        width = self.widths[d]
        columns = self.fork_columns
        assert columns is not None and columns.row[d] is not None
        buffers.ids[d][:, width:] = tree.fork_tokens(d)
        positions = buffers.positions[d]
        # Fork row r sits at m'-d+r = (m-d) + a + 1 + r; m-d is the span's first position.
        positions[:, width:] = positions[:, :1] + accepted[:, None] + 1 + columns.row[d]
        bits = buffers.bits[d]
        assert bits is not None
        bits[:, width:] = tree.fork_bits(d, accepted)
        rows = tree.fork_hidden_rows(d, accepted)
        return previous.gather(1, rows[:, :, None].expand(-1, -1, previous.shape[2]))

    def _batch(self, buffers: ExtendBuffers, d: int, runner: DraftRunner,
               eager_items: list[FixedExtendItem] | None) -> ForwardBatch:  # fmt: skip
        ids, positions, rows, *_ = buffers.depth_views(d)
        size, span = buffers.size, self.spans[d]
        # Each token's slot, from its row and cache position in the depth's row table (a
        # padding request's row holds only the padding slot). A span's cache positions
        # follow from its first; a fork row's rotary position is its node's, not its cache's.
        table = runner.req_to_token_pool.req_to_token
        bits = buffers.bits[d]
        if bits is None:  # no forks: every row's rotary position is its cache position
            columns = buffers.positions[d]
        else:
            columns = buffers.positions[d][:, :1] + buffers.cache_columns[d]
        slots = table[rows[:, None], columns].view(-1)
        seq_lens = self._seq_lens(d, size, eager_items)
        pools = (runner.kv_pool, runner.req_to_token_pool)
        tree_bits = None if bits is None else bits.view(-1)
        return device_batch(
            ids, positions, slots, rows, seq_lens, [span] * size, pools, tree_bits=tree_bits
        )

    def _seq_lens(self, d: int, size: int, items: list[FixedExtendItem] | None) -> list[int]:
        span = self.spans[d]
        if items is None:  # a graph's batch: its metadata reads the device buffers
            return [span] * size
        return [item.m - d + span for item in items] + [span] * (size - len(items))

    @torch.inference_mode()  # as every forward: the kernels' fast paths need no autograd
    def _capture(self) -> None:
        """A graph per bucket; each keeps its outputs in the pool, read right after its replay."""
        buffers = {size: self._buffers(size) for size in self.buckets}
        captured = capture_graphs(self.buckets, self.device, lambda s: self._to_capture(buffers[s]))
        self.graphs = {s: (graph, buffers[s], out) for s, (graph, out) in captured.items()}

    def _to_capture(self, buffers: ExtendBuffers) -> Callable[[], tuple]:
        """The inputs of the graph of the buffers' size, every request a padding one, and its
        forward, each depth's metadata over the buffers."""
        self._int_values(buffers, None, None)
        buffers.staged.upload()
        metadata = [  # rows, seq_lens, q_starts, q_lens of each depth's views, then its span
            runner.attention.prepare_for_capture(
                *buffers.depth_views(d)[2:], self.spans[d], None if bits is None else bits.view(-1)
            )
            for d, (runner, bits) in enumerate(zip(self.depths, buffers.bits))
        ]
        return lambda: self._forward(buffers, metadata)
