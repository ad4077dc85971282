"""The multi-layer EAGLE worker: draft extend after the target's prefill, then per decode step
the step's round plan (spec.round_plan): verify -> accept -> draft extend, or a plain step
whose drafts fall behind and catch up later (spec.catch_up). One worker for any number of
depths and any draft tree shape (spec/tree.py; one chain is a tree too); the alignment of
tokens, hidden states and positions across depths is spec.draft_extend's, the growth of trees
spec.tree_extender's, the slots of a tree's verify spec.tree_verify's; a round is decided on
the device where its plan says (spec.device_round), on the host otherwise (spec.host_verify).

A prefill node calls `draft_extend_prefill` after the target's prefill, then sends
`export_state` and each depth's KV (`depth_kv`). A decode node calls `reserve` before receiving
and `adopt` after; EngineCore.step then drives `plan`, and `verify` and `finish_round` or
`after_plain_step`, every decode step."""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch
from engine.host_copy import int_tensor
from engine.kv_pool import KVPool
from engine.model_runner import ModelRunner
from engine.prompt_embeds import InputEmbeds
from engine.request import Request
from engine.verify_outputs import VerifyOutputs
from spec.acceptance import chain_verdicts
from spec.batching import Span, extend_batch
from spec.catch_up import DraftCatchUp
from spec.decode_extend import FixedDecodeExtend
from spec.device_round import (
    DeviceRound,
    LaunchedVerify,
    RoundInputs,
    chain_span,
    gather_round,
    grow_for_next_round,
    launch_verify,
    run_device_round,
)
from spec.device_tree import TreeLayout
from spec.draft_extend import DraftExtend
from spec.draft_model import MultiLayerEagleDraft
from spec.draft_runner import DraftRunner, DraftSeq
from spec.draft_vocab import DraftHead
from spec.extend_items import FORK_GROW_AHEAD, FixedExtendItem
from spec.host_verify import VerifyResult, verify_on_host
from spec.prefix_drafts import DraftPrefixCache, starts_at_cached_prefix
from spec.round_costs import StepCosts
from spec.round_plan import PlanPolicy, QueueNext, RoundPlan
from spec.round_stats import count_round
from spec.round_survey import RoundSurvey
from spec.sample_extend import sample_extend, share_prompt, shared_prompt_len
from spec.state import DraftState, SpecRequestState
from spec.step_planner import StepPlanner, plan_policy
from spec.tree import DraftTree, TreeShape, tree_shape
from spec.tree_extender import TreeExtender
from spec.tree_round import TreeRoundInputs, run_tree_round
from spec.tree_verify import TreeSlots


class MultiLayerEagleWorker:
    def __init__(self, runner: ModelRunner, draft: MultiLayerEagleDraft) -> None:
        self.runner = runner
        # The target's embedding and LM head, whole (tensor parallel ranks split theirs).
        self.target = runner.vocabulary_model()
        self.num_draft_steps = draft.num_draft_steps
        # The draft tree of each request that may draft one (`_shape`); one chain is a tree too.
        self.shape = tree_shape(runner.config, draft.num_draft_steps)
        k = draft.num_draft_steps
        # A tree's forks in a decode step's extend hold positions up to m + K + their rows,
        # where the target holds from m + 1 on.
        fork_rows = [0] * k
        if not self.shape.is_chain:
            layout = TreeLayout(self.shape, k)
            fork_rows = layout.fork_rows if layout.fits_masks else fork_rows
        self.depths = [
            DraftRunner(
                d,
                module,
                self.target,
                runner.rotary,
                runner.config,
                tree_slots=k + fork_rows[d] + FORK_GROW_AHEAD if fork_rows[d] else 0,
            )
            for d, module in enumerate(draft.depths)
        ]
        self.head = DraftHead(self.target, draft.vocab)
        if runner.config.cuda_graph_max_bs:
            self._capture_graphs()
        # The decode step's extend of requests that all draft the engine's shape (a chain or
        # a tree): one fixed-shape forward of all depths (one graph per batch size where the
        # engine runs graphs).
        self.fixed_extend = FixedDecodeExtend(
            self.depths, self.head, runner.config.cuda_graph_max_bs, self.shape
        )
        # The general draft extend: prefill, and decode steps the fixed shape does not fit.
        self.extender = TreeExtender(self.depths, self.head, runner.device)
        # The next round's verify, queued before its step (`_launch_verify`).
        self._launched: LaunchedVerify | None = None
        # Drafts that plain steps leave behind, and their catching up.
        self.catch_up = DraftCatchUp(
            self.extender, runner.model_config.spec_hidden_size, runner.config.dtype.itemsize
        )
        # How each decode step's plan is chosen, and what the plan of the step running found
        # of its requests.
        self.planner = StepPlanner(
            plan_policy(runner.config), k, self.shape, self.fixed_extend,
            runner.req_to_token_pool.max_context_len, self.catch_up, self._shape,
        )  # fmt: skip
        self._survey: RoundSurvey | None = None
        # Every depth's KV of the positions the engine's prefix cache holds.
        self.prefix_drafts = DraftPrefixCache(self.depths, self._new_state)

    def prefix_companion(self) -> DraftPrefixCache:
        return self.prefix_drafts

    def _capture_graphs(self) -> None:
        """CUDA graphs for the forwards of every decode step. Verify: the newest token and a
        chain of K drafts or a tree's nodes. Draft extend: depth d reads the tokens committed
        since its last extend (at most K + 1) and the d positions before them it left to
        recompute, so at most 2K; a tree's fork reads at most K."""
        k, shape = self.num_draft_steps, self.shape
        if shape.is_chain:
            self.runner.capture_verify_graphs(k + 1, verdicts=chain_verdicts)
        else:
            self.runner.capture_verify_graphs(1 + max(k, shape.budget), trees=True)
        max_tokens = self.runner.config.cuda_graph_max_bs * shape.beam_width * 2 * k
        prefill = self.runner.config.cuda_graph_max_prefill_tokens
        for depth, runner in enumerate(self.depths):
            runner.capture_graphs(2 * k, max_tokens, self.head, shape.width_at(depth), prefill)

    # --- after the target's prefill (prefill nodes, and the offline engine) ---
    @torch.inference_mode()
    def draft_extend_prefill(
        self,
        requests: list[Request],
        hidden: list[torch.Tensor],
        input_embeds: list[InputEmbeds | None] | None = None,
        prompt_sources: list[int | None] | None = None,
    ) -> None:
        """Run every depth over positions [S, n-1] of freshly prefilled requests, whose first
        sampled token x_n is already appended (kv_len == n), S being the cached prefix that
        every depth holds already (spec/prefix_drafts.py; 0 without one); `hidden[i]`: the
        target's hidden states at those positions (ModelRunner.forward(..., keep_hidden=True)), and
        `input_embeds[i]` the input-embedding rows that forward read there, if any
        (ForwardOutput.input_embeds): a depth reading a token given as a vector reads these
        rows, not the placeholder's embedding. Builds each request's first chain and boundary
        states, taking draft slots for n positions. `prompt_sources[i]`, when not None, is
        the index of an earlier request that request i is another parallel sample of: its draft
        shares that one's prompt KV (spec/sample_extend.py)."""
        self.costs.interrupted()
        embeds = input_embeds or [None] * len(requests)
        sources = prompt_sources or [None] * len(requests)
        followed = {source for source in sources if source is not None}
        items: dict[int, DraftExtend] = {}
        for i, (req, h, e) in enumerate(zip(requests, hidden, embeds, strict=True)):
            assert e is None or len(e) == h.shape[0], "one input row per prefilled position"
            if sources[i] is None:
                start = starts_at_cached_prefix(req.spec_state)
                if start < 0:
                    self.release(req)
                    start = 0
                assert req.kv_len == req.num_tokens - 1 == start + h.shape[0], "whole prompts"
                if req.spec_state is None:
                    req.spec_state = self._new_state()
                items[i] = DraftExtend(
                    req.spec_state, req.all_token_ids, h, e, self._shape(req), i in followed
                )
        self.extender.run(list(items.values()))
        samples = [
            sample_extend(self.depths, items[source], req, h, self._shape(req))
            for req, h, source in zip(requests, hidden, sources)
            if source is not None
        ]
        self.extender.run(samples)

    def export_state(self, req: Request) -> DraftState:
        """What a prefill node sends for `req` right after `draft_extend_prefill`."""
        state: SpecRequestState = req.spec_state
        hidden_size = self.target.config.hidden_size
        boundary = torch.zeros(
            self.num_draft_steps - 1,
            hidden_size,
            dtype=state.target_hidden.dtype,
            device=state.target_hidden.device,
        )
        for d, value in enumerate(state.boundary):
            if value is not None:
                boundary[d] = value
        return DraftState(
            req.num_tokens - 1,
            list(state.chain),
            list(state.chain_probs),
            state.target_hidden.clone(),
            boundary,
        )

    def depth_kv(
        self, req: Request, num_positions: int, shares_prompt: bool = False
    ) -> list[tuple[KVPool, list[int]]]:
        """Each depth's pool and the slots of positions [0, num_positions), depth 0 first:
        what a transfer sends after the target's KV, or receives into. `shares_prompt`: the
        transfer of a parallel sample whose prompt another's transfer carries: positions
        from `shared_prompt_len` on only."""
        state: SpecRequestState = req.spec_state
        return [
            (runner.kv_pool, seq.slots[_first(shares_prompt, num_positions, d) : num_positions])
            for d, (runner, seq) in enumerate(zip(self.depths, state.seqs))
        ]

    # --- on a decode node, before and after receiving ---
    def reserve(self, req: Request, num_positions: int, prompt_of: Request | None = None) -> None:
        """Take slots for positions [0, num_positions) in every depth: a decode node reserves
        the prompt (what the transfer fills) and the first step's draft extend, as many as it
        takes in the target; later extends grow each depth themselves. `prompt_of`: the
        parallel sample whose transfer carries the prompt `req` shares, reserved already: `req`
        holds its slots for the positions the samples share (`shared_prompt_len`)."""
        if req.spec_state is None:
            req.spec_state = self._new_state()
            if prompt_of is not None:
                assert req.prompt_token_ids == prompt_of.prompt_token_ids, "one prompt"
                shared = prompt_of.spec_state.seqs
                share_prompt(self.depths, shared, req.spec_state, len(req.prompt_token_ids))
        for runner, seq in zip(self.depths, req.spec_state.seqs):
            runner.grow_to(seq, num_positions)

    def adopt(self, req: Request, sent: DraftState) -> None:
        """Take over a request whose KV landed in the slots `reserve` took."""
        self.costs.interrupted()
        state: SpecRequestState = req.spec_state
        n = sent.num_prefilled
        assert req.kv_len == n == req.num_tokens - 1, "adopt right after the first token"
        assert len(sent.draft_token_ids) >= self.num_draft_steps
        for d, seq in enumerate(state.seqs):
            assert len(seq.slots) >= n
            seq.valid_len = max(0, n - d)
        state.chain = list(sent.draft_token_ids[: self.num_draft_steps])
        state.chain_probs = list(sent.draft_probs[: self.num_draft_steps])
        state.boundary = [
            sent.boundary_hidden[d] if n - d - 1 >= 0 else None
            for d in range(self.num_draft_steps - 1)
        ]
        state.target_hidden = sent.target_hidden

    # --- each decode step ---
    def set_plan_policy(self, policy: PlanPolicy, costs: StepCosts | None = None) -> None:
        """Choose later steps' plans under `policy` (and, given, with `costs` in place of what
        this engine measured)."""
        self.planner.policy = policy
        if costs is not None:
            self.planner.costs = costs

    @property
    def costs(self) -> StepCosts:
        """What this engine's decode steps cost and commit (spec.round_costs)."""
        return self.planner.costs

    def plan(self, requests: list[Request], waiting: bool) -> RoundPlan:
        """The plan of the decode step of `requests` that begins now (spec.step_planner);
        `waiting`: prompts wait for admission. The step then runs it: `verify` and
        `finish_round` for a round, a plain forward and `after_plain_step` otherwise."""
        planned = self.planner.plan(requests, waiting, self._launched)
        assert planned is not None
        plan, self._survey = planned
        return plan

    def plain_plan(self, requests: list[Request], waiting: bool) -> RoundPlan | None:
        """The plan of a step of `requests` launched while the step before it is in flight,
        where it is a plain step that catches nothing up; None otherwise (spec.step_planner)."""
        planned = self.planner.plan(requests, waiting, self._launched, plain_only=True)
        return None if planned is None else planned[0]

    @torch.inference_mode()
    def verify(
        self, requests: list[Request], default_generator: torch.Generator, plan: RoundPlan
    ) -> VerifyResult:
        """One target forward over each request's newest token and its drafts (requests not
        speculating bring just their newest token): a chain, or a tree whose nodes see their
        ancestors only; then acceptance; on the path `plan` names (spec.round_plan), which
        queues the next round's verify behind this one where it says so (`queued_verify`)."""
        launched, self._launched = self._launched, None
        survey, self._survey = self._survey, None
        assert plan.speculates and survey is not None and survey.requests is requests
        if plan.verify in ("queued_by_device", "queued_by_host"):
            assert launched is not None
            inputs = survey.take(plan.verify)
            if isinstance(inputs, RoundInputs):
                outputs = launched.outputs
                return self._device_round(inputs, launched.batch, outputs, plan.queue_next)
            return self._tree_round(inputs, plan.queue_next, launched)
        if plan.verify == "device":
            inputs = survey.take("device")
            if isinstance(inputs, RoundInputs):
                batch = self._verify_batch(inputs)
                outputs = self.runner.forward_every_token(batch)
                return self._device_round(inputs, batch, outputs, plan.queue_next)
            return self._tree_round(inputs, plan.queue_next)
        return self._host_round(requests, default_generator)

    def _host_round(
        self, requests: list[Request], default_generator: torch.Generator
    ) -> VerifyResult:
        """The verify of every request's drafts, accepted on the host (spec.host_verify)."""
        runner = self.runner
        if self.fixed_extend.layout is not None:
            # Own slots for every node, this round's and the next's, where the pool has room:
            # the tree's next rounds can then run on the device (spec.tree_round).
            budget = self.fixed_extend.layout.budget
            pools = (runner.kv_pool, runner.req_to_token_pool)
            grow_for_next_round(requests, self.num_draft_steps, *pools, span=budget)
        taken = TreeSlots(runner.kv_pool, runner.req_to_token_pool)
        try:
            spans, trees = [], []
            for req in requests:
                span, tree = self._span(req, self._tree(req), taken)
                spans.append(span)
                trees.append(tree)
            taken.write()
            k = self.num_draft_steps
            return verify_on_host(
                self.runner, requests, trees, spans, taken, default_generator, kept_width=k + 1
            )
        finally:
            taken.free()

    def _tree(self, req: Request) -> DraftTree:
        """The drafts `req` verifies next, at most `lookahead` deep (a chain of none when it
        does not speculate)."""
        k = req.lookahead
        state: SpecRequestState | None = req.spec_state
        if not k or state is None:
            return DraftTree([], [])
        if state.tree is not None:
            return state.tree.pruned(k, len(state.tree))
        return DraftTree.chain(state.chain[:k])

    def _span(self, req: Request, tree: DraftTree, taken: TreeSlots) -> tuple[Span, DraftTree]:
        """`req`'s verify span, its newest token then the tree's nodes in the cache positions
        after it, and the tree as verified: cut to the slots it found room for."""
        m = req.num_tokens - 1
        if tree.is_chain:
            return chain_span(req, tree.tokens, len(tree)), tree
        slots = taken.span_slots(req, len(tree))
        tree = tree.pruned(tree.depth, len(slots) - 1)
        tokens = [req.newest_token_id, *tree.tokens]
        span = Span(req.row, m, tokens, slots, positions=tree.positions(m), visible=tree.visible())
        return span, tree

    def _verify_batch(self, inputs: RoundInputs) -> ForwardBatch:
        """The verify of a round on the device: in the verify graphs' buffers where they hold
        it, else eager."""
        runner = self.runner
        pools = (runner.kv_pool, runner.req_to_token_pool)
        return runner.uniform_graph_batch(
            inputs.rows, inputs.newest, inputs.tokens, inputs.slots
        ) or extend_batch(inputs.spans(), *pools, runner.attention, runner.device)

    def _device_round(
        self,
        inputs: RoundInputs,
        batch: ForwardBatch,
        outputs: VerifyOutputs,
        queue_next: QueueNext = "none",
    ) -> VerifyResult:
        """Acceptance and the draft extend queued behind the verify of `batch`, whose
        `outputs` are queued, and with `queue_next` "device" the next verify where the device
        can queue it (spec.device_round)."""
        runner, k = self.runner, self.num_draft_steps
        outputs_before = [len(req.output_token_ids) for req in inputs.requests]
        done = run_device_round(
            batch,
            outputs,
            inputs,
            self.fixed_extend,
            k,
            (runner.kv_pool, runner.req_to_token_pool),
            runner.forward_every_token if queue_next == "device" else None,
        )
        self._launched = done.next_verify
        return _decided_on_device(done, outputs_before, inputs.lookaheads, inputs.lookaheads)

    def queued_verify(self) -> LaunchedVerify | None:
        """The verify queued behind the last round, if any: until it has run it may write the
        KV of every request that round verified (`LaunchedVerify.settle`)."""
        return self._launched

    def _tree_round(
        self,
        inputs: TreeRoundInputs,
        queue_next: QueueNext = "none",
        launched: LaunchedVerify | None = None,
    ) -> VerifyResult:
        """The verify of every request's tree, acceptance and the draft extend queued back to
        back (spec.tree_round): the verify `launched` before this step where it is theirs, and
        with `queue_next` "device" the next verify where the device can queue it."""
        runner, k = self.runner, self.num_draft_steps
        outputs_before = [len(req.output_token_ids) for req in inputs.requests]
        pools = (runner.kv_pool, runner.req_to_token_pool)
        if launched is not None:
            batch, outputs = launched.batch, launched.outputs
        else:
            spans = inputs.spans()
            batch = runner.graph_batch(spans) or extend_batch(
                spans, *pools, runner.attention, runner.device
            )
            outputs = runner.forward_every_token(batch)
        forward = runner.forward_every_token if queue_next == "device" else None
        done = run_tree_round(batch, outputs, inputs, self.fixed_extend, k, pools, forward)
        self._launched = done.next_verify
        trees = inputs.trees
        if trees is None:  # trees the host did not read: as deep as the extend grows them
            depths, sizes = [k] * len(inputs.requests), [inputs.num_nodes] * len(inputs.requests)
        else:
            depths, sizes = [tree.depth for tree in trees], [len(tree) for tree in trees]
        return _decided_on_device(done, outputs_before, depths, sizes)

    @torch.inference_mode()
    def finish_round(
        self, requests: list[Request], verified: VerifyResult, plan: RoundPlan
    ) -> None:
        """After the scheduler committed the verified tokens: statistics, then the draft
        extend that `plan` names over the newly committed tokens, for the requests that go
        on speculating. Where the plan queues the next round's verify (the engine's next step
        is expected to decode those of these requests that are still running, unless
        something changes in between) and the device did not queue it, the host queues it
        behind this round's extend (`LaunchedVerify`)."""
        done = verified.extended
        committed = [
            len(req.output_token_ids) - before
            for req, before in zip(requests, verified.num_outputs_before)
        ]
        count_round(
            requests, verified.num_drafts, verified.num_proposed, verified.num_accepted, committed
        )
        # The accept length is what a request that verifies drafts commits a round.
        drafted = [n for n, drafts in zip(committed, verified.num_drafts) if drafts]
        self.costs.round_committed(sum(drafted), len(drafted))
        going_on = []  # (index in the batch, request, tokens committed this step)
        for i, req in enumerate(requests):
            if req.finished or req.spec_state is None:
                continue
            # After a round on the device every request has its next chain (one with no
            # lookahead left verifies it with acceptance stopped at 0); elsewhere only those
            # that go on drafting are extended.
            if done is not None or req.lookahead:
                going_on.append((i, req, committed[i]))
        if plan.extend == "device":
            assert done is not None
            self._apply_device_extend(requests, done, going_on, plan.queue_next != "none")
        elif plan.extend == "fixed":
            self._fixed_extend(verified, going_on)
        else:
            self._general_extend(verified, going_on)
        self.costs.step_done()

    def _apply_device_extend(
        self, requests: list[Request], done: DeviceRound, going_on: list, queue_next: bool
    ) -> None:
        """The extend ran with the verify: its chains go to those going on. With `queue_next`,
        the host queues their next verify where the device did not."""
        indices = [i for i, _, _ in going_on]
        boundary, hidden, next_chains = done.boundary, done.verify_hidden, done.next_chains
        if len(indices) < len(requests):
            kept = int_tensor(indices, boundary.device)
            boundary, hidden = boundary[:, kept], hidden[kept]
            next_chains = next_chains[kept] if queue_next else next_chains
        # Those going on are all that the round leaves running, in order: the next step's
        # batch when nothing joins.
        # A verify the device queued is of every request of the round: when some end,
        # the host queues one of those going on.
        queued = self._launched is not None and len(going_on) == len(requests)
        if queue_next and going_on and self.shape.is_chain and not queued:
            self._launched = None
            self._launch_verify([req for _, req, _ in going_on], next_chains)
        # Read when first asked for: a round the device queues the next verify of reads
        # none, and the host goes on while the device runs the extend.
        self.fixed_extend.apply(
            [done.items[i] for i in indices],
            [committed for _, _, committed in going_on],
            done.next_drafts,
            indices,
            boundary,
            hidden,
        )

    def _fixed_extend(self, verified: VerifyResult, going_on: list) -> None:
        """The fixed-shape extend after the host's verify (the plan found that it fits every
        request that could go on, so it fits those that do)."""
        hidden = verified.hidden  # per request: the target's at the newest token and kept path
        fixed = [
            FixedExtendItem(
                req.spec_state,
                req.num_tokens - 1 - committed,
                req.all_token_ids[-committed:],
                hidden[i],
                num_positions=len(req.slots),
            )
            for i, req, committed in going_on
        ]
        if fixed:
            assert self.fixed_extend.fits(fixed)
            self.fixed_extend.run(fixed)

    def _general_extend(self, verified: VerifyResult, going_on: list) -> None:
        hidden = verified.hidden
        self.extender.run(
            [
                DraftExtend(
                    req.spec_state, req.all_token_ids, hidden[i][:committed], None, self._shape(req)
                )
                for i, req, committed in going_on
            ]
        )

    @torch.inference_mode()
    def after_plain_step(
        self, requests: list[Request], hidden: torch.Tensor, plan: RoundPlan
    ) -> None:
        """After a plain step of `requests` committed one token each: each request that goes
        on keeps the target's hidden state at the position before its new token (row i of
        `hidden` [n, spec_hidden_size]), its draft one more position behind; where `plan`
        catches up, the draft of every request that verifies drafts next extends over all the
        positions it is behind, building its next chain (or tree)."""
        # A verify queued behind the last round ran before this step's tokens were read.
        self._launched = None
        self.catch_up.keep(requests, hidden)
        if plan.catches_up:
            self.catch_up.run(requests, self._shape)
        self.costs.step_done()

    def _launch_verify(self, requests: list[Request], next_chains: torch.Tensor) -> None:
        """Queue the next round's verify of `requests`, whose chains are `next_chains` on the
        device, now (spec.device_round.launch_verify); the next `verify` takes it if it is of
        the same requests with the same tokens."""
        inputs = gather_round(
            requests, self.num_draft_steps, self.runner.req_to_token_pool.max_context_len
        )
        if inputs is not None:
            batch = self._verify_batch(inputs)
            forward = self.runner.forward_every_token
            self._launched = launch_verify(inputs, batch, next_chains, forward)

    def release(self, req: Request) -> None:
        launched = self._launched
        if launched is not None and any(r is req for r in launched.requests):
            launched.settle()
            self._launched = None
        state: SpecRequestState | None = req.spec_state
        if state is None:
            return
        self.catch_up.forget(state)
        # Its slots may change hands to a transfer's stream: the extend writing them first.
        state.wait_for_drafts()
        for runner, seq in zip(self.depths, state.seqs):
            runner.release(seq)
        req.spec_state = None

    def is_empty(self) -> bool:
        """No request holds draft KV (the prefix cache may hold some of its own)."""
        return all(runner.is_empty(len(self.prefix_drafts)) for runner in self.depths)

    def _shape(self, req: Request) -> TreeShape:
        # A grammar masks each verified position in the state after the drafts before it, which
        # is one walk of the matcher along a chain: such requests draft chains.
        if req.grammar is not None:
            return TreeShape.chains(1, self.num_draft_steps)
        return self.shape

    # --- the draft extend shared by prefill and decode ---
    def _new_state(self) -> SpecRequestState:
        return SpecRequestState(
            seqs=[DraftSeq() for _ in self.depths],
            boundary=[None] * (self.num_draft_steps - 1),
        )


def _decided_on_device(
    done: DeviceRound, outputs_before: list[int], num_drafts: list[int], num_proposed: list[int]
) -> VerifyResult:
    """A round read back from the device as the engine's step takes it: per request its
    committed tokens, draft positions checked and draft tokens proposed."""
    return VerifyResult(
        tokens=done.tokens,
        logprobs=None,  # greedy requests that asked for none
        num_accepted=done.accepted,
        num_drafts=num_drafts,
        num_proposed=num_proposed,
        hidden=[],
        num_outputs_before=outputs_before,
        extended=done,
    )


def _first(shares_prompt: bool, num_prompt: int, depth: int) -> int:
    return shared_prompt_len(num_prompt, depth) if shares_prompt else 0
