"""The multi-layer EAGLE worker: draft extend after the target's prefill, then per decode step the
step's round plan (spec.runtime.round_plan): verify -> accept -> draft extend, or a plain step whose
drafts fall behind and catch up later (spec.runtime.catch_up). One worker for any number of depths
and any draft tree shape (spec/runtime/tree.py; one chain is a tree too); the alignment of tokens,
hidden states and positions across depths is spec.runtime.draft_extend's, the growth of trees
spec.runtime.tree_extender's; a round's verify runs on the path its plan names
(spec.runtime.round_verify), its draft extend on the kind its plan names
(spec.runtime.round_extend), and the draft state crosses from a prefill node to a decode node
through spec.runtime.handoff.

A prefill node calls `draft_extend_prefill` after the target's prefill, then sends
`export_state` and each depth's KV (`depth_kv`). A decode node calls `reserve` before receiving
and `adopt` after; EngineCore.step then drives `plan`, and `verify` and `finish_round` or
`after_plain_step`, every decode step."""

from __future__ import annotations

import torch

from engine.executor.model_runner import ModelRunner
from engine.executor.prompt_embeds import InputEmbeds
from engine.request import Request
from engine.scheduling.kv_pool import KVPool
from spec.draft_model import MultiLayerEagleDraft
from spec.draft_vocab import DraftHead
from spec.runtime import handoff
from spec.runtime.acceptance import chain_verdicts
from spec.runtime.catch_up import DraftCatchUp
from spec.runtime.decode_extend import FixedDecodeExtend
from spec.runtime.device_round import LaunchedVerify
from spec.runtime.device_tree import TreeLayout
from spec.runtime.draft_extend import DraftExtend
from spec.runtime.draft_runner import DraftRunner, DraftSeq
from spec.runtime.extend_items import FORK_GROW_AHEAD
from spec.runtime.host_verify import VerifyResult
from spec.runtime.prefix_drafts import DraftPrefixCache, starts_at_cached_prefix
from spec.runtime.round_costs import StepCosts
from spec.runtime.round_extend import RoundExtend
from spec.runtime.round_plan import PlanPolicy, RoundPlan
from spec.runtime.round_stats import count_round
from spec.runtime.round_survey import RoundSurvey
from spec.runtime.round_verify import RoundVerifier
from spec.runtime.sample_extend import sample_extend
from spec.runtime.state import DraftState, SpecRequestState
from spec.runtime.step_planner import StepPlanner, plan_policy
from spec.runtime.tree import TreeShape, tree_shape
from spec.runtime.tree_extender import TreeExtender


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
        # A round's verify on its plan's path, and the verify queued behind it.
        self.verifier = RoundVerifier(runner, k, self.fixed_extend)
        self.round_extend = RoundExtend(
            self.fixed_extend, self.extender, self.verifier, self.shape, self._shape
        )
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
        every depth holds already (spec/runtime/prefix_drafts.py; 0 without one); `hidden[i]`: the
        target's hidden states at those positions (ModelRunner.forward(..., keep_hidden=True)), and
        `input_embeds[i]` the input-embedding rows that forward read there, if any
        (ForwardOutput.input_embeds): a depth reading a token given as a vector reads these
        rows, not the placeholder's embedding. Builds each request's first chain and boundary
        states, taking draft slots for n positions. `prompt_sources[i]`, when not None, is
        the index of an earlier request that request i is another parallel sample of: its draft
        shares that one's prompt KV (spec/runtime/sample_extend.py)."""
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
        return handoff.export_state(req, self.num_draft_steps, self.target.config.hidden_size)

    def depth_kv(
        self, req: Request, num_positions: int, shares_prompt: bool = False
    ) -> list[tuple[KVPool, list[int]]]:
        """Each depth's pool and the slots of positions [0, num_positions)
        (spec.runtime.handoff)."""
        return handoff.depth_kv(self.depths, req, num_positions, shares_prompt)

    # --- on a decode node, before and after receiving ---
    def reserve(self, req: Request, num_positions: int, prompt_of: Request | None = None) -> None:
        """Take slots for positions [0, num_positions) in every depth (spec.runtime.handoff)."""
        handoff.reserve(self.depths, req, num_positions, self._new_state, prompt_of)

    def adopt(self, req: Request, sent: DraftState) -> None:
        """Take over a request whose KV landed in the slots `reserve` took."""
        self.costs.interrupted()
        handoff.adopt(req, sent, self.num_draft_steps)

    # --- each decode step ---
    def set_plan_policy(self, policy: PlanPolicy, costs: StepCosts | None = None) -> None:
        """Choose later steps' plans under `policy` (and, given, with `costs` in place of what
        this engine measured)."""
        self.planner.policy = policy
        if costs is not None:
            self.planner.costs = costs

    @property
    def costs(self) -> StepCosts:
        """What this engine's decode steps cost and commit (spec.runtime.round_costs)."""
        return self.planner.costs

    def plan(self, requests: list[Request], waiting: bool) -> RoundPlan:
        """The plan of the decode step of `requests` that begins now (spec.runtime.step_planner);
        `waiting`: prompts wait for admission. The step then runs it: `verify` and
        `finish_round` for a round, a plain forward and `after_plain_step` otherwise."""
        planned = self.planner.plan(requests, waiting, self.verifier.launched)
        assert planned is not None
        plan, self._survey = planned
        return plan

    def plain_plan(self, requests: list[Request], waiting: bool) -> RoundPlan | None:
        """The plan of a step of `requests` launched while the step before it is in flight,
        where it is a plain step that catches nothing up; None otherwise
        (spec.runtime.step_planner)."""
        planned = self.planner.plan(requests, waiting, self.verifier.launched, plain_only=True)
        return None if planned is None else planned[0]

    @torch.inference_mode()
    def verify(
        self, requests: list[Request], default_generator: torch.Generator, plan: RoundPlan
    ) -> VerifyResult:
        """One target forward over each request's newest token and its drafts (requests not
        speculating bring just their newest token): a chain, or a tree whose nodes see their
        ancestors only; then acceptance; on the path `plan` names (spec.runtime.round_plan), which
        queues the next round's verify behind this one where it says so (`queued_verify`)."""
        survey, self._survey = self._survey, None
        assert plan.speculates and survey is not None and survey.requests is requests
        return self.verifier.verify(requests, default_generator, plan, survey)

    def queued_verify(self) -> LaunchedVerify | None:
        """The verify queued behind the last round, if any: until it has run it may write the
        KV of every request that round verified (`LaunchedVerify.settle`)."""
        return self.verifier.launched

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
        self.round_extend.run(requests, verified, committed, plan)
        self.costs.step_done()

    def after_plain_step(
        self, requests: list[Request], hidden: torch.Tensor, plan: RoundPlan
    ) -> None:
        """After a plain step of `requests` committed one token each: each request that goes
        on keeps the target's hidden state at the position before its new token (row i of
        `hidden` [n, spec_hidden_size]), its draft one more position behind; where `plan`
        catches up, the draft of every request that verifies drafts next extends over all the
        positions it is behind, building its next chain (or tree)."""
        # A verify queued behind the last round ran before this step's tokens were read.
        self.verifier.launched = None
        self.catch_up.keep(requests, hidden)
        if plan.catches_up:
            # Entered here only: a step that keeps its hidden states runs no tensor op, and
            # entering costs a plain step a microsecond or so.
            with torch.inference_mode():
                self.catch_up.run(requests, self._shape)
        self.costs.step_done()

    def release(self, req: Request) -> None:
        self.verifier.release(req)
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
