"""The multi-layer EAGLE worker: draft extend after the target's prefill, then per decode step
verify -> accept -> draft extend. One worker for any number of depths (chain, topk = 1); the
alignment of tokens, hidden states and positions across depths is spec.draft_extend's.

A prefill node calls `draft_extend_prefill` after the target's prefill, then sends
`export_state` and each depth's KV (`depth_kv`). A decode node calls `reserve` before receiving
and `adopt` after; EngineCore.step then drives `verify` and `finish_round` every decode step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.engine_core import position_generator
from engine.kv_pool import KVPool
from engine.model_runner import ModelRunner
from engine.prompt_embeds import InputEmbeds
from engine.request import Request, SpecStats
from engine.sampler import TokenLogprob, compute_logprobs
from spec.acceptance import Verdict, accept_greedy, accept_sampled
from spec.batching import Span, extend_batch
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
    num_drafts: list[int]  # per request: draft tokens checked (0: no speculation this step)
    hidden: list[torch.Tensor]  # per request: the target's at the verified positions
    num_outputs_before: list[int]


class MultiLayerEagleWorker:
    def __init__(self, runner: ModelRunner, draft: MultiLayerEagleDraft) -> None:
        self.runner = runner
        self.target = runner.model
        self.num_draft_steps = draft.num_draft_steps
        self.depths = [
            DraftRunner(d, module, runner.model, runner.rotary, runner.config)
            for d, module in enumerate(draft.depths)
        ]
        self.head = DraftHead(runner.model, draft.vocab)

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
            items.append(DraftExtend(req.spec_state, req.all_token_ids, h, e))
        self._extend(items)

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
        """Take slots for positions [0, num_positions) in every depth (decode nodes reserve
        prompt + max_tokens up front, as they do for the target)."""
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
        not speculating bring just their newest token), then acceptance."""
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
        batch = extend_batch(
            spans, runner.kv_pool, runner.req_to_token_pool, runner.attention, runner.device
        )
        logits, hidden = runner.forward_every_token(batch)
        lens = batch.extend_lens
        # One device-to-host copy for every greedy request's targets, not one per request.
        argmax = logits.argmax(dim=-1).tolist()
        result = VerifyResult([], [], [], [], list(hidden.split(lens)), [])
        per_request = zip(requests, chains, logits.split(lens), _starts(lens))
        for req, chain, req_logits, start in per_request:
            if req.params.greedy:
                verdict = accept_greedy(argmax[start : start + len(chain) + 1], chain)
            else:
                generators = _generators(req, len(chain) + 1)
                verdict = accept_sampled(
                    req_logits, chain, req.params, generators, default_generator
                )
            result.tokens.append(verdict.tokens)
            result.logprobs.append(_logprobs(req, req_logits, verdict.tokens))
            result.verdicts.append(verdict)
            result.num_drafts.append(len(chain))
            result.num_outputs_before.append(len(req.output_token_ids))
        return result

    @torch.inference_mode()
    def finish_round(self, requests: list[Request], verified: VerifyResult) -> None:
        """After the scheduler committed the verified tokens: statistics, then draft extend
        over the newly committed tokens for the requests that go on speculating."""
        items = []
        for i, req in enumerate(requests):
            committed = len(req.output_token_ids) - verified.num_outputs_before[i]
            if verified.num_drafts[i]:
                _count(req, verified.num_drafts[i], verified.verdicts[i], committed)
            if req.finished or req.spec_state is None or not req.lookahead:
                continue
            hidden = verified.hidden[i][:committed]
            items.append(DraftExtend(req.spec_state, req.all_token_ids, hidden))
        self._extend(items)

    def release(self, req: Request) -> None:
        state: SpecRequestState | None = req.spec_state
        if state is None:
            return
        for runner, seq in zip(self.depths, state.seqs):
            runner.release(seq)
        req.spec_state = None

    def is_empty(self) -> bool:
        return all(runner.is_empty() for runner in self.depths)

    # --- the draft extend shared by prefill and decode ---
    def _new_state(self) -> SpecRequestState:
        return SpecRequestState(
            seqs=[DraftSeq() for _ in self.depths],
            boundary=[None] * (self.num_draft_steps - 1),
        )

    def _extend(self, items: list[DraftExtend]) -> None:
        if not items:
            return
        for depth, runner in enumerate(self.depths):
            outputs = runner.forward([item.input_for(depth) for item in items])
            last = torch.stack([out[-1] for out in outputs])
            # A depth's output is hidden_size wide whatever the target's stream: norm + head only.
            best, best_p = self.head.propose(last)
            # One copy to the host for both (ids are exact in float64).
            ids, probs = torch.stack([best.double(), best_p.double()]).tolist()
            for item, out, token, prob in zip(items, outputs, ids, probs):
                item.take(depth, out, int(token), prob)
        for item in items:
            item.finish()


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


def _count(req: Request, num_drafts: int, verdict: Verdict, committed: int) -> None:
    stats = req.spec_stats
    if stats is None:  # a request built without EngineCore.make_request
        stats = req.spec_stats = SpecStats()
    if len(stats.accepted_per_position) < num_drafts:
        stats.accepted_per_position.extend([0] * (num_drafts - len(stats.accepted_per_position)))
    # A stop condition may cut the committed tokens short of the accepted drafts.
    accepted = min(verdict.num_accepted, committed)
    stats.verify_steps += 1
    stats.proposed_tokens += num_drafts
    stats.accepted_tokens += accepted
    stats.emitted_tokens += committed
    for j in range(accepted):
        stats.accepted_per_position[j] += 1
