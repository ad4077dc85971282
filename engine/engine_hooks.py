"""What EngineCore asks of those it works with but does not own: the speculator (implemented
in spec/, which depends on engine, never the reverse) and a prefill-only engine's owner."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.executor.prompt_embeds import InputEmbeds
from engine.request import Request
from engine.sampling.sampler import TokenLogprob


class QueuedWork(Protocol):
    """Work queued on the device that the host has not waited for."""

    def done(self) -> bool:
        """Whether it has run (without waiting for it)."""

    def settle(self) -> None:
        """Wait until it has run."""


class StepPlan(Protocol):
    """A decode step's plan as the engine reads it (spec.runtime.round_plan.RoundPlan)."""

    @property
    def speculates(self) -> bool:
        """The step verifies drafts (a round); False: a plain step."""

    @property
    def catches_up(self) -> bool:
        """A plain step after which the requests' drafts catch up over the positions plain
        steps committed."""

    @property
    def label(self) -> str:
        """The plan in a word or two, what traces and counters name it by."""

    def trace_args(self) -> dict[str, Any]:
        """What the step's trace events carry of it."""


class PrefixCompanion(Protocol):
    """KV that other pools hold at each of a request's target positions (a speculator's draft
    depths), cached by the prefix cache together with the target's (engine.scheduling.kv_cache). The
    companion's KV at a position reads up to `lag` tokens after it, so the cache keys it by the
    target slot `lag` positions later, whose path fixes those tokens: it lives as long as that
    slot stays in the cache, and a match of L tokens gives the companion's KV of L - lag."""

    lag: int

    def cacheable_end(self, req: Request, end: int) -> int:
        """How far (at most `end`) the companion holds `req`'s KV computed from its own tokens
        alone, in slots of its own, from `req.cached_len` on: the most the cache may take."""

    def adopt(self, req: Request, present: int, end: int) -> None:
        """The cache took `req`'s target positions [present, end) (its target slots there are
        the keys); the request's companion KV at [cached_len, present), which the cache held
        already, is its own copy, freed now. The request lets go of its slots right after
        unless present == cached_len (a request that goes on)."""

    def evicted(self, target_slots: list[int]) -> None:
        """The cache let go of these target slots: free the companion's slots kept for them."""

    def matched(self, req: Request, target_slots: list[int]) -> None:
        """`req` starts at a cached prefix whose target slots are `target_slots`: give it the
        companion's KV there."""

    def unmatched(self, req: Request) -> None:
        """Undo `matched` (the request was not admitted after all)."""


class Speculator(Protocol):
    """What the engine asks of speculative decoding (implemented in spec/)."""

    num_draft_steps: int

    def prefix_companion(self) -> PrefixCompanion | None:
        """What caches the speculator's KV beside the target's in a prefix cache; None: a prefix
        cache cannot serve this speculator (the engine runs without one)."""

    def draft_extend_prefill(
        self,
        requests: list[Request],
        hidden: list[torch.Tensor],
        input_embeds: list[InputEmbeds | None] | None = None,
        prompt_sources: list[int | None] | None = None,
    ) -> None:
        """Run every draft depth over freshly prefilled prompts (hidden: the target's, per
        request, at every prompt position; input_embeds: the rows the target read in place of
        token embeddings there, if any) and build each request's first draft chain.
        prompt_sources[i]: the index of an earlier request of the same prompt whose draft KV
        request i, another parallel sample, shares (None: its own)."""

    def plan(self, requests: list[Request], waiting: bool) -> StepPlan:
        """The plan of the decode step of `requests` that begins now; `waiting`: prompts wait
        for admission (the next step may not decode the same requests)."""

    def plain_plan(self, requests: list[Request], waiting: bool) -> StepPlan | None:
        """The plan of a decode step of `requests` launched while the step before it is in
        flight (engine.executor.overlap), where it is a plain step that catches no draft up; None,
        recording nothing, otherwise (the step is planned with `plan` once that one is read)."""

    def verify(
        self, requests: list[Request], default_generator: torch.Generator, plan: StepPlan
    ) -> Any:
        """One target forward over each request's newest token and draft chain (a plan that
        speculates); returns the tokens to commit (`.tokens`, one list per request;
        `.logprobs`, one list per request or None when no token has one) and what the draft
        extend needs. The plan may queue the next round's verify now (`queued_verify`)."""

    def queued_verify(self) -> QueuedWork | None:
        """Work queued on the device behind the last verify that may still write the KV of
        the requests it verified, if any."""

    def finish_round(self, requests: list[Request], verified: Any, plan: StepPlan) -> None:
        """After the tokens were committed: count statistics, extend the draft of each request
        still running over its new tokens, building its next chain. Where the plan says so,
        the next round's verify may be queued now (the speculator checks, when the next step
        takes it, that nothing changed)."""

    def after_plain_step(
        self, requests: list[Request], hidden: torch.Tensor, plan: StepPlan
    ) -> None:
        """After a plain step committed one token for each of `requests`, or launched it
        (engine.executor.overlap: its tokens are read later, the hidden states still on their way):
        keep the target's hidden state at the position before it (`hidden` [n, spec_hidden_size])
        for the request's draft, which is one more position behind; where the plan catches up,
        the drafts extend over every position they are behind."""

    def release(self, req: Request) -> None:
        """Free the request's draft KV (called whenever its target KV is freed)."""


class PrefillHandoff(Protocol):
    """The owner of a prefill-only engine (a prefill node): it hears of each prompt's prefill
    and takes the request over once the prompt is done, its KV still held."""

    def prefill_completing(self, completing: list[Request]) -> None:
        """Before a prefill forward: these requests' prompts end in it (all of a prompt, or
        its last chunk), then the parallel samples that take those prompts' KV in it
        (`Request.forks`); the same requests, in the same order, as `forward_enqueued` and
        `prefilled` get."""

    def forward_enqueued(self, completing: list[Request]) -> None:
        """The forward that ends these prompts is enqueued (their KV exists once it runs)."""

    def prefilled(
        self,
        requests: list[Request],
        logprobs: list[TokenLogprob | None],
        last_hidden: torch.Tensor,
    ) -> None:
        """These prompts are done (and the samples that forked them): first token appended,
        draft extended where they draft; `last_hidden[i]`: the target's draft input at
        request i's last prompt position."""

    def failed(self, requests: list[Request], error: str) -> None:
        """These requests failed in the engine (their KV still held)."""
