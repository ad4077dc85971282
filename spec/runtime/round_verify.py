"""The verify of a speculative round on the path its plan names (spec.runtime.round_plan), and the
verify queued behind a round for the next one. The paths: a verify queued before the step (by
the device or the host) or a fresh one, of chains (spec.runtime.device_round) or trees
(spec.runtime.tree_round), accepted on the device; or any drafts, accepted on the host
(spec.runtime.host_verify). This module owns the queued verify: who queued it, who takes it, and who
must settle it before a request's slots change hands (`release`)."""

from __future__ import annotations

import torch

from engine.executor.forward_batch import ForwardBatch
from engine.executor.model_runner import ModelRunner
from engine.request import Request
from engine.sampling.verify_outputs import VerifyOutputs
from spec.runtime.batching import Span, extend_batch
from spec.runtime.decode_extend import FixedDecodeExtend
from spec.runtime.device_round import (
    DeviceRound,
    LaunchedVerify,
    RoundInputs,
    chain_span,
    gather_round,
    grow_for_next_round,
    launch_verify,
    run_device_round,
)
from spec.runtime.host_verify import VerifyResult, verify_on_host
from spec.runtime.round_plan import QueueNext, RoundPlan
from spec.runtime.round_survey import RoundSurvey
from spec.runtime.state import SpecRequestState
from spec.runtime.tree import DraftTree
from spec.runtime.tree_round import TreeRoundInputs, run_tree_round
from spec.runtime.tree_verify import TreeSlots


class RoundVerifier:
    def __init__(self, runner: ModelRunner, k: int, fixed_extend: FixedDecodeExtend) -> None:
        self.runner = runner
        self.k = k
        self.fixed_extend = fixed_extend
        # The next round's verify, queued before its step (`launch`).
        self.launched: LaunchedVerify | None = None

    def verify(
        self,
        requests: list[Request],
        default_generator: torch.Generator,
        plan: RoundPlan,
        survey: RoundSurvey,
    ) -> VerifyResult:
        """The verify of `requests` on the path `plan` names, from what `survey` gathered of
        them for that path (MultiLayerEagleWorker.verify)."""
        launched, self.launched = self.launched, None
        if plan.verify in ("queued_by_device", "queued_by_host"):
            assert launched is not None
            inputs = survey.take(plan.verify)
            if isinstance(inputs, RoundInputs):
                outputs = launched.outputs
                return self.device_round(inputs, launched.batch, outputs, plan.queue_next)
            return self.tree_round(inputs, plan.queue_next, launched)
        if plan.verify == "device":
            inputs = survey.take("device")
            if isinstance(inputs, RoundInputs):
                batch = self._verify_batch(inputs)
                outputs = self.runner.forward_every_token(batch)
                return self.device_round(inputs, batch, outputs, plan.queue_next)
            return self.tree_round(inputs, plan.queue_next)
        return self.host_round(requests, default_generator)

    def host_round(
        self, requests: list[Request], default_generator: torch.Generator
    ) -> VerifyResult:
        """The verify of every request's drafts, accepted on the host (spec.runtime.host_verify)."""
        runner = self.runner
        if self.fixed_extend.layout is not None:
            # Own slots for every node, this round's and the next's, where the pool has room:
            # the tree's next rounds can then run on the device (spec.runtime.tree_round).
            budget = self.fixed_extend.layout.budget
            pools = (runner.kv_pool, runner.req_to_token_pool)
            grow_for_next_round(requests, self.k, *pools, span=budget)
        taken = TreeSlots(runner.kv_pool, runner.req_to_token_pool)
        try:
            spans, trees = [], []
            for req in requests:
                span, tree = _span(req, _tree(req), taken)
                spans.append(span)
                trees.append(tree)
            taken.write()
            return verify_on_host(
                runner, requests, trees, spans, taken, default_generator, kept_width=self.k + 1
            )
        finally:
            taken.free()

    def _verify_batch(self, inputs: RoundInputs) -> ForwardBatch:
        """The verify of a round on the device: in the verify graphs' buffers where they hold
        it, else eager."""
        runner = self.runner
        pools = (runner.kv_pool, runner.req_to_token_pool)
        return runner.uniform_graph_batch(
            inputs.rows, inputs.newest, inputs.tokens, inputs.slots
        ) or extend_batch(inputs.spans(), *pools, runner.attention, runner.device)

    def device_round(
        self,
        inputs: RoundInputs,
        batch: ForwardBatch,
        outputs: VerifyOutputs,
        queue_next: QueueNext = "none",
    ) -> VerifyResult:
        """Acceptance and the draft extend queued behind the verify of `batch`, whose
        `outputs` are queued, and with `queue_next` "device" the next verify where the device
        can queue it (spec.runtime.device_round)."""
        runner = self.runner
        outputs_before = [len(req.output_token_ids) for req in inputs.requests]
        done = run_device_round(
            batch,
            outputs,
            inputs,
            self.fixed_extend,
            self.k,
            (runner.kv_pool, runner.req_to_token_pool),
            runner.forward_every_token if queue_next == "device" else None,
        )
        self.launched = done.next_verify
        return _decided_on_device(done, outputs_before, inputs.lookaheads, inputs.lookaheads)

    def tree_round(
        self,
        inputs: TreeRoundInputs,
        queue_next: QueueNext = "none",
        launched: LaunchedVerify | None = None,
    ) -> VerifyResult:
        """The verify of every request's tree, acceptance and the draft extend queued back to
        back (spec.runtime.tree_round): the verify `launched` before this step where it is theirs,
        and with `queue_next` "device" the next verify where the device can queue it."""
        runner, k = self.runner, self.k
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
        self.launched = done.next_verify
        trees = inputs.trees
        if trees is None:  # trees the host did not read: as deep as the extend grows them
            depths, sizes = [k] * len(inputs.requests), [inputs.num_nodes] * len(inputs.requests)
        else:
            depths, sizes = [tree.depth for tree in trees], [len(tree) for tree in trees]
        return _decided_on_device(done, outputs_before, depths, sizes)

    def launch(self, requests: list[Request], next_chains: torch.Tensor) -> None:
        """Queue the next round's verify of `requests`, whose chains are `next_chains` on the
        device, now (spec.runtime.device_round.launch_verify); the next `verify` takes it if it is
        of the same requests with the same tokens."""
        self.launched = None
        inputs = gather_round(requests, self.k, self.runner.req_to_token_pool.max_context_len)
        if inputs is not None:
            batch = self._verify_batch(inputs)
            forward = self.runner.forward_every_token
            self.launched = launch_verify(inputs, batch, next_chains, forward)

    def release(self, req: Request) -> None:
        """`req` leaves: a queued verify that reads or writes its slots runs first, and is
        dropped."""
        launched = self.launched
        if launched is not None and any(r is req for r in launched.requests):
            launched.settle()
            self.launched = None


def _tree(req: Request) -> DraftTree:
    """The drafts `req` verifies next, at most `lookahead` deep (a chain of none when it does
    not speculate)."""
    k = req.lookahead
    state: SpecRequestState | None = req.spec_state
    if not k or state is None:
        return DraftTree([], [])
    if state.tree is not None:
        return state.tree.pruned(k, len(state.tree))
    return DraftTree.chain(state.chain[:k])


def _span(req: Request, tree: DraftTree, taken: TreeSlots) -> tuple[Span, DraftTree]:
    """`req`'s verify span, its newest token then the tree's nodes in the cache positions after
    it, and the tree as verified: cut to the slots it found room for."""
    m = req.num_tokens - 1
    if tree.is_chain:
        return chain_span(req, tree.tokens, len(tree)), tree
    slots = taken.span_slots(req, len(tree))
    tree = tree.pruned(tree.depth, len(slots) - 1)
    tokens = [req.newest_token_id, *tree.tokens]
    span = Span(req.row, m, tokens, slots, positions=tree.positions(m), visible=tree.visible())
    return span, tree


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
