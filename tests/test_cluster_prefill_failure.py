"""A prefill that fails after its transfer was announced (the announcement goes out when the
prefill batch is admitted, before the forward): the prefill node still sends what it announced,
under a void row, so the channel with the decode node stays in order; the request ends with an
error naming the prefill node, every other request is served as before, and every KV pool ends
empty on both nodes. CPU cluster over gloo, tiny models."""

from __future__ import annotations

import asyncio

import pytest
from cluster_helpers import launch, wait_for
from tiny_drafts import make_good_draft, make_predictable_llama
from tiny_models import make_tiny_llama

import cluster.deploy.launcher as launcher
from cluster.frontend.backend import BackendError
from engine import LLM, SamplingParams

ray = pytest.importorskip("ray")

ENGINE = dict(max_model_len=256, kv_cache_tokens=4096, max_num_seqs=32)
FORWARD_FAILS = [97, 98, 99]  # a prompt that starts so fails its whole batch's forward
SEND_FAILS = [96, 95]  # ... fails its own transfer's preparation, after the forward
DRAFT_FAILS = [94, 93]  # ... fails the batch's draft extend


def failing_prefill_class():
    """A PrefillNode that fails where a prompt's first tokens say (made here, so that Ray
    pickles it by value)."""
    import torch

    from prefill_node import PrefillNode

    def marked(req, mark: list[int]) -> bool:
        return req.prompt_token_ids[: len(mark)] == mark

    class FailingPrefillNode(PrefillNode):
        def __init__(self, args, options) -> None:
            super().__init__(args, options)
            build_batch = self.runner.build_batch

            def failing_build_batch(requests, ends=None):
                if any(marked(r, FORWARD_FAILS) for r in requests):
                    raise RuntimeError("injected forward failure")
                return build_batch(requests, ends)

            self.runner.build_batch = failing_build_batch
            if self.speculator is not None:
                draft_extend = self.speculator.draft_extend_prefill

                def failing_draft_extend(requests, *rest):
                    if any(marked(r, DRAFT_FAILS) for r in requests):
                        raise RuntimeError("injected draft extend failure")
                    return draft_extend(requests, *rest)

                self.speculator.draft_extend_prefill = failing_draft_extend
            send = self.outgoing.send

            def failing_send(pending, logprob, last_hidden) -> None:
                if marked(pending.req, SEND_FAILS):
                    last_hidden = torch.zeros(3)  # no row takes a hidden state this narrow
                send(pending, logprob, last_hidden)

            self.outgoing.send = failing_send

    return FailingPrefillNode


@pytest.fixture
def failing_prefill(monkeypatch):
    monkeypatch.setattr(launcher, "_prefill_class", failing_prefill_class)


async def _generate(router, name: str, prompt: list[int], params: SamplingParams):
    """(tokens, first token's top logprobs) or the BackendError's message."""
    tokens, top = [], None
    try:
        async for delta in router.generate(name, prompt, params):
            tokens += delta.token_ids
            if top is None and delta.logprobs:
                top = delta.logprobs[0].top_logprobs
    except BackendError as err:
        return str(err)
    return tokens, top


def _prompts(count: int) -> list[list[int]]:
    return [[1 + (7 * i + j) % 200 for j in range(5 + 3 * i)] for i in range(count)]


def test_failures_after_the_announcement_fail_their_requests_only(tmp_path, failing_prefill):
    make_tiny_llama(tmp_path / "model")
    model = str(tmp_path / "model")
    prompts = _prompts(20)
    failing = [SEND_FAILS + [5 + i] * (3 + i) for i in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    expected = [o.token_ids for o in LLM(model, device="cpu", **ENGINE).generate(prompts, params)]
    cluster = launch(model, prefill=1, decode=1, **ENGINE)
    try:

        async def main():
            router = cluster.router
            try:
                alone = await _generate(router, "forward-fails", FORWARD_FAILS + [4, 5], params)
                together = await asyncio.gather(
                    *(_generate(router, f"r{i}", p, params) for i, p in enumerate(prompts)),
                    *(_generate(router, f"f{i}", p, params) for i, p in enumerate(failing)),
                )
                after = await _generate(router, "after", prompts[0], params)
            finally:
                await router.close()
            return alone, together, after

        alone, together, after = asyncio.run(main())
        assert isinstance(alone, str), alone
        assert "prefill-0: prefill forward failed: RuntimeError: injected forward failure" in alone
        served, failed = together[: len(prompts)], together[len(prompts) :]
        # Announced before the forward, the first token's top logprobs still reach the client.
        assert [tokens for tokens, _ in served] == expected
        assert all(len(top) == 2 for _, top in served)
        assert all("prefill-0: preparing the transfer failed" in error for error in failed)
        assert after[0] == expected[0]
        assert wait_for(cluster.kv_pools_empty, 30)
    finally:
        cluster.shutdown()


SPEC_PROMPTS = [[1, 17, 99, 4, 250, 31, 8], [1, 200], list(range(3, 40)), [5] * 23, [7], [9, 9]]


def test_a_draft_extend_that_fails_sends_every_announced_depth(tmp_path, failing_prefill):
    """The void transfer of a request announced as drafting carries one pool per depth: were
    one missing, the next transfer on the channel would land in the wrong buffers."""
    make_predictable_llama(tmp_path / "target", seed=0)
    make_good_draft(tmp_path / "draft", tmp_path / "target", 2, noise=0.01)
    target = str(tmp_path / "target")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(target, device="cpu", **ENGINE)
    expected = [o.token_ids for o in llm.generate(SPEC_PROMPTS, params)]
    cluster = launch(
        target,
        prefill=1,
        decode=1,
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(tmp_path / "draft"),
        num_draft_steps=2,
        **ENGINE,
    )
    try:

        async def main():
            router = cluster.router
            try:
                alone = await _generate(router, "draft-fails", DRAFT_FAILS + [4, 5, 6], params)
                served = await asyncio.gather(
                    *(_generate(router, f"r{i}", p, params) for i, p in enumerate(SPEC_PROMPTS))
                )
            finally:
                await router.close()
            return alone, served

        alone, served = asyncio.run(main())
        assert isinstance(alone, str), alone
        error = "prefill-0: draft extend (prefill) forward failed: RuntimeError: injected draft"
        assert error in alone
        assert [tokens for tokens, _ in served] == expected
        assert wait_for(cluster.kv_pools_empty, 30)
    finally:
        cluster.shutdown()
