"""The multi-layer EAGLE worker: draft extend after the target's prefill, then per decode step
verify -> accept -> draft extend. One worker for any number of depths and draft chains; the
alignment of tokens, hidden states and positions across depths is spec.draft_extend's, and the
alternative chains' place in the verify forward spec.alternatives'.

A prefill node calls `draft_extend_prefill` after the target's prefill, then sends
`export_state` and each depth's KV (`depth_kv`). A decode node calls `reserve` before receiving
and `adopt` after; EngineCore.step then drives `verify` and `finish_round` every decode step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_pool import KVPool
from engine.model_runner import ModelRunner
from engine.prompt_embeds import InputEmbeds
from engine.request import Request, SpecStats
from engine.sampler import TokenLogprob, compute_logprobs
from engine.step_sampling import position_generator
from spec.acceptance import (
    Verdict,
    accept_greedy,
    accept_sampled,
    grammar_masked_verify_logits,
    processed_verify_logits,
)
from spec.alternatives import Alternative, release_alternatives, take_alternatives, take_slots
from spec.batching import Span, extend_batch
from spec.chain_extender import ChainExtender
from spec.decode_extend import FixedDecodeExtend, FixedExtendItem
from spec.device_round import DeviceRound, placeholder_items, run_device_round, runs_on_device
from spec.draft_extend import DraftExtend
from spec.draft_model import MultiLayerEagleDraft
from spec.draft_runner import DraftRunner, DraftSeq
from spec.draft_vocab import DraftHead
from spec.state import DraftState, SpecRequestState


@dataclass
class VerifyResult:
    tokens: list[list[int]]  # per request: the tokens to commit
    logprobs: list[list[TokenLogprob | None]]
    verdicts: list[Verdict]
    num_drafts: list[int]  # per request: draft positions checked (0: no speculation this step)
    num_proposed: list[int]  # per request: draft tokens checked, on every chain
    hidden: list[torch.Tensor]  # per request: the target's at the kept chain's positions
    num_outputs_before: list[int]
    # Set when the round ran on the device (spec.device_round): the draft extend already ran.
    extended: DeviceRound | None = None


class MultiLayerEagleWorker:
    def __init__(self, runner: ModelRunner, draft: MultiLayerEagleDraft) -> None:
        self.runner = runner
        self.target = runner.model
        # Chains drafted for each greedy request, started with depth 0's most likely tokens; a
        # verify step keeps the one accepted furthest.
        self.num_chains = runner.config.num_draft_chains
        self.num_draft_steps = draft.num_draft_steps
        self.depths = [
            DraftRunner(d, module, runner.model, runner.rotary, runner.config)
            for d, module in enumerate(draft.depths)
        ]
        self.head = DraftHead(runner.model, draft.vocab)
        if runner.config.cuda_graph_max_bs:
            self._capture_graphs()
        # The decode step's extend when every request verified a full chain: one fixed-shape
        # forward of all depths (one graph per batch size where the engine runs graphs).
        self.fixed_extend = FixedDecodeExtend(
            self.depths, self.head, runner.config.cuda_graph_max_bs
        )
        # The general draft extend: prefill, and decode steps the fixed shape does not fit.
        self.extender = ChainExtender(self.depths, self.head, runner.device)

    def _capture_graphs(self) -> None:
        """CUDA graphs for the forwards of every decode step. Verify: the newest token and a
        chain of K drafts in one row, each other chain (K tokens) in a row of its own. Draft
        extend: depth d reads the tokens committed since its last extend (at most K + 1) and
        the d positions before them it left to recompute, so at most 2K; a fork reads at most
        K."""
        k, chains = self.num_draft_steps, self.num_chains
        self.runner.capture_verify_graphs(k + 1, chains)
        max_tokens = self.runner.config.cuda_graph_max_bs * chains * 2 * k
        for depth, runner in enumerate(self.depths):
            # Depth 0 also ranks the first tokens of the alternative chains.
            runner.capture_graphs(2 * k, max_tokens, self.head, chains if depth == 0 else 1)

    # --- after the target's prefill (prefill nodes, and the offline engine) ---
    @torch.inference_mode()
    def draft_extend_prefill(
        self,
        requests: list[Request],
        hidden: list[torch.Tensor],
        input_embeds: list[InputEmbeds | None] | None = None,
    ) -> None:
        """Run every depth over positions [0, n-1] of freshly prefilled requests, whose first
        sampled token x_n is already appended (kv_len == n); `hidden[i]`: the target's hidden
        states at those positions (ModelRunner.forward(..., keep_hidden=True)), and
        `input_embeds[i]` the input-embedding rows that forward read there, if any
        (ForwardOutput.input_embeds): a depth reading a token given as a vector reads these
        rows, not the placeholder's embedding. Builds each request's first chain and boundary
        states, taking draft slots for n positions."""
        items = []
        embeds = input_embeds or [None] * len(requests)
        for req, h, e in zip(requests, hidden, embeds, strict=True):
            assert req.kv_len == req.num_tokens - 1 == h.shape[0], "prefill starts at 0"
            assert e is None or len(e) == h.shape[0], "one input row per prefilled position"
            if req.spec_state is not None:
                self.release(req)
            req.spec_state = self._new_state()
            items.append(DraftExtend(req.spec_state, req.all_token_ids, h, e, self._chains(req)))
        self.extender.run(items)

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

    def depth_kv(self, req: Request, num_positions: int) -> list[tuple[KVPool, list[int]]]:
        """Each depth's pool and the slots of positions [0, num_positions), depth 0 first:
        what a transfer sends after the target's KV, or receives into."""
        state: SpecRequestState = req.spec_state
        return [
            (runner.kv_pool, seq.slots[:num_positions])
            for runner, seq in zip(self.depths, state.seqs)
        ]

    # --- on a decode node, before and after receiving ---
    def reserve(self, req: Request, num_positions: int) -> None:
        """Take slots for positions [0, num_positions) in every depth: a decode node reserves
        the prompt (what the transfer fills) and the first step's draft extend, as many as it
        takes in the target; later extends grow each depth themselves."""
        if req.spec_state is None:
            req.spec_state = self._new_state()
        for runner, seq in zip(self.depths, req.spec_state.seqs):
            runner.grow_to(seq, num_positions)

    def adopt(self, req: Request, sent: DraftState) -> None:
        """Take over a request whose KV landed in the slots `reserve` took."""
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
    @torch.inference_mode()
    def verify(self, requests: list[Request], default_generator: torch.Generator) -> VerifyResult:
        """One target forward over each request's newest token and its draft chain (requests
        not speculating bring just their newest token), and over each alternative chain in a
        row of its own that reads the request's cached KV; then acceptance."""
        spans, chains = [], []
        for req in requests:
            m = req.num_tokens - 1
            assert req.kv_len == m
            k = req.lookahead
            chain = req.spec_state.chain[:k] if k else []
            chains.append(chain)
            tokens = [req.all_token_ids[-1], *chain]
            spans.append(Span(req.row, m, tokens, req.slots[m : m + k + 1]))
        runner = self.runner
        k = self.num_draft_steps
        if runs_on_device(requests, self.num_chains, k):
            items = placeholder_items(requests, k)
            if self.fixed_extend.fits(items):
                return self._device_round(requests, spans, items)
        pool, kv_pool = runner.req_to_token_pool, runner.kv_pool
        alternatives: list[list[Alternative]] = [[] for _ in requests]
        try:
            take_alternatives(requests, chains, pool, kv_pool, len(spans), alternatives)
            return self._verify(requests, chains, spans, alternatives, default_generator)
        finally:
            release_alternatives(alternatives, pool, kv_pool)

    def _device_round(
        self, requests: list[Request], spans: list[Span], items: list[FixedExtendItem]
    ) -> VerifyResult:
        """Verify, acceptance and the draft extend queued back to back (spec.device_round)."""
        runner, k = self.runner, self.num_draft_steps
        batch = runner.graph_batch(spans) or extend_batch(
            spans, runner.kv_pool, runner.req_to_token_pool, runner.attention, runner.device
        )
        outputs_before = [len(req.output_token_ids) for req in requests]
        done = run_device_round(
            batch, runner.forward_every_token, requests, items, self.fixed_extend, k
        )
        return VerifyResult(
            tokens=done.tokens,
            logprobs=[[None] * len(tokens) for tokens in done.tokens],
            verdicts=[Verdict(t, a) for t, a in zip(done.tokens, done.accepted)],
            num_drafts=[k] * len(requests),
            num_proposed=[k] * len(requests),
            hidden=[],
            num_outputs_before=outputs_before,
            extended=done,
        )

    def _verify(
        self,
        requests: list[Request],
        chains: list[list[int]],
        spans: list[Span],
        alternatives: list[list[Alternative]],
        default_generator: torch.Generator,
    ) -> VerifyResult:
        runner = self.runner
        all_spans = spans + [alt.span for alts in alternatives for alt in alts]
        batch = runner.graph_batch(all_spans) or extend_batch(
            all_spans, runner.kv_pool, runner.req_to_token_pool, runner.attention, runner.device
        )
        raw_logits, hidden = runner.forward_every_token(batch)
        alternative_chains = [[alt.chain for alt in alts] for alts in alternatives]
        eos_token_ids = runner.model_config.eos_token_ids
        logits = processed_verify_logits(
            raw_logits, requests, chains, alternative_chains, eos_token_ids
        )
        logits = grammar_masked_verify_logits(
            logits, requests, chains, alternative_chains, unprocessed=raw_logits
        )
        lens = batch.extend_lens
        # One device-to-host copy for every greedy request's targets, not one per request.
        argmax = logits.argmax(dim=-1).tolist()
        starts = _starts(lens) + [sum(lens)]
        all_logits, all_hidden = logits.split(lens), hidden.split(lens)
        # Log-probabilities are the model's own, before any penalty (as `sample`'s caller).
        all_raw = raw_logits.split(lens)
        result = VerifyResult([], [], [], [], [], [], [])
        swaps = []  # row-table writes of requests that keep an alternative's drafts
        for i, (req, chain, alts) in enumerate(zip(requests, chains, alternatives)):
            kept: Alternative | None = None
            if req.params.greedy:
                verdict = accept_greedy(argmax[starts[i] : starts[i] + len(chain) + 1], chain)
                for alt in alts:
                    # The newest token's target is the main span's: alternatives start after it.
                    j = alt.index
                    targets = argmax[starts[i] : starts[i] + 1] + argmax[starts[j] : starts[j + 1]]
                    other = accept_greedy(targets, alt.chain)
                    if other.num_accepted > verdict.num_accepted:
                        verdict, kept = other, alt
            else:
                generators = _generators(req, len(chain) + 1)
                verdict = accept_sampled(
                    all_logits[i], chain, req.params, generators, default_generator
                )
            kept_logits, kept_hidden = all_raw[i], all_hidden[i]
            if kept is not None:
                kept_logits = torch.cat([all_raw[i][:1], all_raw[kept.index]])
                kept_hidden = torch.cat([all_hidden[i][:1], all_hidden[kept.index]])
                swaps.append(take_slots(req, kept, verdict.num_accepted))
            result.tokens.append(verdict.tokens)
            result.logprobs.append(_logprobs(req, kept_logits, verdict.tokens))
            result.verdicts.append(verdict)
            result.num_drafts.append(len(chain))
            result.num_proposed.append(len(chain) * (1 + len(alts)))
            result.hidden.append(kept_hidden)
            result.num_outputs_before.append(len(req.output_token_ids))
        runner.req_to_token_pool.write_many(swaps)
        return result

    @torch.inference_mode()
    def finish_round(self, requests: list[Request], verified: VerifyResult) -> None:
        """After the scheduler committed the verified tokens: statistics, then draft extend
        over the newly committed tokens for the requests that go on speculating."""
        going_on = []  # (index in the batch, request, tokens committed this step)
        for i, req in enumerate(requests):
            committed = len(req.output_token_ids) - verified.num_outputs_before[i]
            if verified.num_drafts[i]:
                drafts, proposed = verified.num_drafts[i], verified.num_proposed[i]
                _count(req, drafts, proposed, verified.verdicts[i], committed)
            if req.finished or req.spec_state is None or not req.lookahead:
                continue
            going_on.append((i, req, committed))
        done = verified.extended
        if done is not None:  # the extend ran with the verify: its chains go to those going on
            indices = [i for i, _, _ in going_on]
            self.fixed_extend.apply(
                [done.items[i] for i in indices],
                [committed for _, _, committed in going_on],
                [done.chains[i] for i in indices],
                done.boundary[:, indices],
            )
            return
        hidden = verified.hidden  # per request: the target's over its verify span
        if self.num_chains == 1:
            fixed = [
                FixedExtendItem(
                    req.spec_state,
                    req.num_tokens - 1 - committed,
                    req.all_token_ids[-committed:],
                    hidden[i],
                )
                for i, req, committed in going_on
            ]
            if self.fixed_extend.fits(fixed):
                self.fixed_extend.run(fixed)
                return
        self.extender.run(
            [
                DraftExtend(
                    req.spec_state,
                    req.all_token_ids,
                    hidden[i][:committed],
                    None,
                    self._chains(req),
                )
                for i, req, committed in going_on
            ]
        )

    def release(self, req: Request) -> None:
        state: SpecRequestState | None = req.spec_state
        if state is None:
            return
        for runner, seq in zip(self.depths, state.seqs):
            runner.release(seq)
        req.spec_state = None

    def is_empty(self) -> bool:
        return all(runner.is_empty() for runner in self.depths)

    def _chains(self, req: Request) -> int:
        # Alternatives are verified for greedy requests only: speculative sampling over several
        # chains needs acceptance rules of its own.
        return self.num_chains if req.params.greedy else 1

    # --- the draft extend shared by prefill and decode ---
    def _new_state(self) -> SpecRequestState:
        return SpecRequestState(
            seqs=[DraftSeq() for _ in self.depths],
            boundary=[None] * (self.num_draft_steps - 1),
        )


def _starts(lens: list[int]) -> list[int]:
    starts, total = [], 0
    for n in lens:
        starts.append(total)
        total += n
    return starts


def _generators(req: Request, count: int) -> list[torch.Generator | None]:
    """Output token number len(output) + j draws from generator j, as `sample` would."""
    seed, done = req.params.seed, len(req.output_token_ids)
    return [None if seed is None else position_generator(seed, done + j) for j in range(count)]


def _logprobs(req: Request, logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob | None]:
    if req.params.logprobs is None:
        return [None] * len(tokens)
    rows = logits[: len(tokens)]
    return compute_logprobs(rows, torch.tensor(tokens), [req.params] * len(tokens))


def _count(
    req: Request, num_drafts: int, num_proposed: int, verdict: Verdict, committed: int
) -> None:
    stats = req.spec_stats
    if stats is None:  # a request built without EngineCore.make_request
        stats = req.spec_stats = SpecStats()
    if len(stats.accepted_per_position) < num_drafts:
        stats.accepted_per_position.extend([0] * (num_drafts - len(stats.accepted_per_position)))
    # A stop condition may cut the committed tokens short of the accepted drafts.
    accepted = min(verdict.num_accepted, committed)
    stats.verify_steps += 1
    stats.proposed_tokens += num_proposed
    stats.accepted_tokens += accepted
    stats.emitted_tokens += committed
    for j in range(accepted):
        stats.accepted_per_position[j] += 1
