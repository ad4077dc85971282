"""One DraftRunner per draft depth. Each owns its depth's ReqToTokenPool, its one-layer KVPool
and their slot allocator, and builds every forward of its depth from those alone: a depth that
read or wrote another depth's pool would silently compute from the wrong keys and values.

Invariant (per request and depth, `DraftSeq`): positions [0, valid_len) hold KV computed from
committed inputs; positions from valid_len on hold KV of draft inputs or nothing, and are
recomputed by the next forward of this depth, which starts at valid_len.

A fork (`DraftRunner.fork`) is a sequence of its own row whose first positions are another
sequence's slots: it reads that KV and computes only its own later positions, for an alternative
draft chain. It lives within one draft extend and never frees the slots it shares.

Parallel samples of one prompt hold one copy of its KV in every depth, as in the target
(`DraftRunner.share_prefix`): each sample's sequence holds the first sample's slots for the
positions whose inputs are the prompt's alone, counted by the allocator, and its own after."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import create_attention_backend
from engine.config import EngineConfig
from engine.executor.cuda_graph import CudaGraphs
from engine.executor.debug_dump import draft_role, dump_pass, tensor_dumper
from engine.executor.forward_batch import ForwardBatch
from engine.executor.graph_inputs import token_buckets
from engine.executor.prompt_embeds import InputEmbeds
from engine.models.llama import LlamaForCausalLM
from engine.models.rope import RotaryEmbedding
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool, grow_holders
from spec.draft_model import DraftDepth
from spec.draft_vocab import DraftHead
from spec.runtime.batching import Span, extend_batch


@dataclass
class DraftSeq:
    """One request's KV in one depth: its row, the slot of each position, and the length of
    the prefix computed from committed inputs."""

    row: int | None = None
    slots: list[int] = field(default_factory=list)
    valid_len: int = 0
    shared: int = 0  # leading slots that belong to another sequence (a fork's parent)


@dataclass
class DraftInput:
    seq: DraftSeq
    start: int  # first position to compute (the seq's valid_len)
    token_ids: list[int]  # the token each position reads
    # The hidden state each position reads, [n, in_width] in all, as pieces in position order:
    # the runner joins every input's pieces in one concatenation rather than one per input.
    hidden: tuple[torch.Tensor, ...]
    # Rows that replace the embedding of some tokens read: the target's input embeddings where
    # the request gave a vector in place of a prompt token.
    input_embeds: InputEmbeds | None = None


@dataclass
class DraftTokenPatch:
    """Token ids that are on the device when a forward is built (drafts proposed by the depths
    before, in the same draft extend): `values[j]` is the id of the batch's token number
    `positions[j]`, whose input gave a placeholder."""

    positions: torch.Tensor
    values: torch.Tensor


@dataclass
class Proposal:
    """A depth's proposal at each input's last position: the likeliest token ids [B, n] (most
    likely first) and their probabilities [B, n]."""

    top: torch.Tensor
    top_p: torch.Tensor


class DraftRunner:
    def __init__(
        self,
        depth: int,
        module: DraftDepth,
        target: LlamaForCausalLM,
        rotary: RotaryEmbedding,
        config: EngineConfig,
        tree_slots: int = 0,
    ) -> None:
        model_config = target.config
        self.depth = depth
        self.module = module
        self.target = target  # for its token embedding only
        self.rotary = rotary
        self.device = torch.device(config.device)
        self.attention = create_attention_backend(
            config.attention_backend,
            model_config.num_heads,
            model_config.num_kv_heads,
            model_config.head_dim,
        )
        # As many slots as the target, and depth + 1 for each request: a depth holds a
        # request's positions where the target does, but a parallel sample's own positions in
        # depth d start depth + 1 before its own in the target (spec.runtime.sample_extend), so only
        # with those can it not run out where the target did not. Forks hold more within a
        # draft extend, and only where `can_fork` found room. `tree_slots` more for each
        # request: the positions past the target's that a decode step's tree extend holds
        # (spec/runtime/device_tree.py).
        self.kv_pool = KVPool(
            config.kv_cache_tokens + (depth + 1 + tree_slots) * config.max_num_seqs,
            1,
            model_config.num_kv_heads,
            model_config.head_dim,
            config.dtype,
            self.device,
        )
        # As many as the target's: each alternative chain forks a row in every depth too.
        self.req_to_token_pool = ReqToTokenPool(
            config.draft_request_rows, config.max_model_len, self.device
        )
        self.dumper = tensor_dumper(config.tensor_dump, draft_role(depth), module)
        self.graphs: CudaGraphs | None = None
        self.prefill_graphs: CudaGraphs | None = None
        self.head: DraftHead | None = None  # in the graphs, when captured
        self.num_proposed = 0

    def capture_graphs(
        self,
        max_span: int,
        max_tokens: int,
        head: DraftHead,
        num_proposed: int,
        max_prefill_tokens: int = 0,
    ) -> None:
        """Capture this depth's forward for batches of spans of at most `max_span` tokens, up
        to `max_tokens` in all (draft extends after a verify step), with `head` proposing the
        `num_proposed` likeliest tokens at each span's last position inside the graph: the
        head's few small kernels would otherwise cost more host time than the whole replay.
        With `max_prefill_tokens`, also for prompts of up to that many tokens in all (the
        draft's prefill, where an eager forward costs more host time than the whole target's
        graphed prefill), reading input embeddings where a prompt gave them.
        The caller decides whether this engine runs graphs."""
        self.head, self.num_proposed = head, num_proposed
        self.graphs = self._graph_set(f"draft-{self.depth}", max_tokens, max_span)
        if max_prefill_tokens:
            self.prefill_graphs = self._graph_set(
                f"draft-{self.depth} prefill",
                max_prefill_tokens,
                max_prefill_tokens,
                embeds_width=self.module.fc.weight.shape[0],
            )

    def _graph_set(
        self, name: str, max_tokens: int, max_span: int, embeds_width: int | None = None
    ) -> CudaGraphs:
        """This depth's forward and proposal captured per token count up to `max_tokens`."""
        graphs = CudaGraphs(
            name,
            self._forward_and_propose,
            self.attention,
            self.kv_pool,
            self.req_to_token_pool,
            token_buckets(max_tokens),
            max_span=max_span,
            hidden_width=self.module.hnorm.weight.shape[0],
            request_outputs=2,
            embeds_width=embeds_width,
        )
        graphs.capture(progress=False)
        return graphs

    def grow_to(self, seq: DraftSeq, num_positions: int) -> None:
        """Give `seq` slots for positions [0, num_positions), taking a row first if needed."""
        self.grow_many([(seq, num_positions)])

    def grow_many(self, targets: list[tuple[DraftSeq, int]]) -> None:
        """`grow_to` for several sequences, with one write to the row table."""
        grants = [(seq, max(0, n - len(seq.slots))) for seq, n in targets]
        grow_holders(self.kv_pool, self.req_to_token_pool, grants)

    def fork(self, parents: list[tuple[DraftSeq, int]]) -> list[DraftSeq]:
        """For each (parent, shared): a sequence whose positions [0, shared) read the parent's
        KV there, valid up to `shared`. The parent must hold slots that far; its KV there may be
        computed by the same forward that runs the fork, since every layer writes the batch's
        KV before it attends."""
        forks = []
        for parent, shared in parents:
            assert parent.row is not None and len(parent.slots) >= shared
            row = self.req_to_token_pool.allocate_row()
            forks.append(DraftSeq(row, parent.slots[:shared], shared, shared))
        longest = max((shared for _, shared in parents), default=0)
        # Entries past a fork's own `shared` are overwritten as it grows, or never read.
        pairs = [(parent.row, fork.row) for (parent, _), fork in zip(parents, forks)]
        try:
            self.req_to_token_pool.copy_prefixes(pairs, longest)
        except BaseException:
            for fork in forks:
                self.release(fork)
            raise
        return forks

    def share_prefix(self, source: DraftSeq, length: int) -> DraftSeq:
        """A sequence in a row of its own whose positions [0, length) are `source`'s slots,
        valid there as far as they are in `source` (a decode node shares them before the KV
        lands). Unlike a fork's, they are held (`SlotAllocator.share`) and freed with the
        sequence: the last holder's free releases them."""
        assert source.row is not None and len(source.slots) >= length
        slots = source.slots[:length]
        row = self.req_to_token_pool.allocate_row()
        try:
            self.req_to_token_pool.write(row, 0, slots)
            self.kv_pool.allocator.share(slots)  # last: nothing to undo after it
        except BaseException:
            self.req_to_token_pool.free_row(row)
            raise
        return DraftSeq(row, list(slots), min(length, source.valid_len))

    def can_fork(self, num_forks: int, num_slots: int) -> bool:
        """Whether `num_forks` forks with `num_slots` positions of their own fit now."""
        pool = self.req_to_token_pool
        return pool.num_free_rows >= num_forks and self.kv_pool.allocator.can_allocate(num_slots)

    def release(self, seq: DraftSeq) -> None:
        if len(seq.slots) > seq.shared:
            self.kv_pool.allocator.free(seq.slots[seq.shared :])
        if seq.row is not None:
            self.req_to_token_pool.free_row(seq.row)
        seq.slots, seq.row, seq.valid_len, seq.shared = [], None, 0, 0

    def cached_prefix(self, slots: list[int]) -> DraftSeq:
        """A sequence in a row of its own whose first positions are `slots`, a cached prefix's
        (spec/runtime/prefix_drafts.py): valid there, and not its own to free."""
        row = self.req_to_token_pool.allocate_row()
        try:
            self.req_to_token_pool.write(row, 0, slots)
        except BaseException:
            self.req_to_token_pool.free_row(row)
            raise
        return DraftSeq(row, list(slots), len(slots), len(slots))

    def is_empty(self, num_cached: int = 0) -> bool:
        """No sequence holds a slot or a row; `num_cached`: slots the prefix cache holds."""
        self.kv_pool.allocator.check_integrity()
        pool = self.req_to_token_pool
        return (
            self.kv_pool.allocator.num_used == num_cached and pool.num_free_rows == pool.max_reqs
        )

    def forward(
        self, inputs: list[DraftInput], patch: DraftTokenPatch | None = None
    ) -> list[torch.Tensor]:
        """This depth's output [n, hidden_size] at each input's positions, writing their KV."""
        out, lens, _ = self.forward_flat(inputs, patch)
        return list(out.split(lens))

    @torch.inference_mode()
    def forward_flat(
        self, inputs: list[DraftInput], patch: DraftTokenPatch | None = None
    ) -> tuple[torch.Tensor, list[int], Proposal | None]:
        """`forward`'s outputs side by side, [sum(lens), hidden_size], each input's length, and
        when a graph ran them, its head's proposal at each input's last position."""
        for item in inputs:
            assert item.start == item.seq.valid_len
            assert sum(piece.shape[0] for piece in item.hidden) == len(item.token_ids)
        self.grow_many([(item.seq, item.start + len(item.token_ids)) for item in inputs])
        spans = []
        for item in inputs:
            end = item.start + len(item.token_ids)
            slots = item.seq.slots[item.start : end]
            spans.append(Span(item.seq.row, item.start, item.token_ids, slots, item.input_embeds))
        hidden = torch.cat([piece for item in inputs for piece in item.hidden])
        lens = [len(item.token_ids) for item in inputs]
        graphs = next((g for g in (self.graphs, self.prefill_graphs) if g and g.fits(spans)), None)
        if graphs is not None:
            batch = graphs.load(spans, hidden.to(self.kv_pool.dtype))
            _apply(patch, batch)
            out, top, top_p = graphs.replay(batch)
            # Out of the graph's buffer: boundary rows are kept (as views) until the next
            # extend, and the next replay overwrites the buffer. The proposal is read before
            # this depth replays again.
            return out.clone(), lens, Proposal(top, top_p)
        batch = extend_batch(
            spans, self.kv_pool, self.req_to_token_pool, self.attention, self.device
        )
        _apply(patch, batch)
        with dump_pass(self.dumper, batch, input_hidden=hidden):
            return self.forward_tokens(batch, hidden)[0], lens, None

    def _forward_and_propose(
        self, batch: ForwardBatch, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a graph computes: the output at every token, then the head's proposal at each
        request's last token (for every request column of the graph, padding included)."""
        assert self.head is not None
        (out,) = self.forward_tokens(batch, hidden)
        top, top_p = self.head.propose_top(out[batch.last_token_indices()], self.num_proposed)
        return out, top, top_p

    def forward_tokens(self, batch: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        """This depth's output [T, hidden_size] at the tokens of `batch` (its metadata set,
        its slots in this depth's pools), reading `hidden`: the forward a caller that builds
        its own batches runs or captures (spec.runtime.decode_extend)."""
        embeds = self.target.embed(batch)
        cos_sin = self.rotary.lookup(batch.positions, embeds.dtype)
        return (self.module(embeds, hidden, batch, cos_sin, self.attention),)


def _apply(patch: DraftTokenPatch | None, batch: ForwardBatch) -> None:
    if patch is not None:
        batch.set_tokens(patch.positions, patch.values)
