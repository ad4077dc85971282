"""Fair KV (issue 21, item 3): requests hold the KV they have computed plus their next step, not
prompt + max_tokens; when the pool runs short the request that costs least to redo is retracted
and runs again later with the same output; `max_tokens_cap` bounds one request.

Starvation, from the issue: five requests with max_tokens near the context length and
ignore_eos, then twenty short ones, on a pool too small for the long ones' whole answers. The
short ones finish within a few steps of what they take alone, and the long ones, retracted on
the way, still finish with the output they have alone. Steps are counted, never seconds."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from cluster_helpers import launch, serve, wait_for
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from tiny_drafts import make_good_draft, make_predictable_llama
from tiny_models import CHAT_TEMPLATE, make_tiny_llama

from cluster.client import AsyncClient
from cluster.control.local_backend import LocalBackend
from cluster.frontend.openai_api import create_app
from engine import LLM, RequestRejectedError, SamplingParams
from engine.request import Request
from engine.scheduling.scheduler import retraction_victim

LONG_PROMPT = 8
SHORT_PROMPT = 6
SHORT_TOKENS = 6
SHORT = SamplingParams(max_tokens=SHORT_TOKENS, temperature=0, ignore_eos=True)
SPEC = "multi-layer-eagle"


@dataclass(frozen=True)
class Workload:
    """Long answers fill the context. Five of them need 5 * context slots, more than the pool:
    they cannot all be held at once, so they are retracted on the way. Prompt + max_tokens
    reserved up front would hold only four of them (pool = 4 * context), and the short requests
    would wait behind the fifth until a long one finished."""

    context: int

    @property
    def pool(self) -> int:
        return 4 * self.context

    @property
    def small_pool(self) -> int:
        """For fewer requests, or with speculation: still short of their answers."""
        return 2 * self.context + self.context // 2

    @property
    def long_tokens(self) -> int:
        return self.context - LONG_PROMPT

    @property
    def long(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.long_tokens, temperature=0, ignore_eos=True)

    def engine(self, **overrides: object) -> dict:
        return dict(max_model_len=self.context, kv_cache_tokens=self.pool, max_num_seqs=32) | (
            overrides
        )


# The engine's own steps are counted exactly: a short context keeps CPU steps quick. On the
# cluster, a short request's trip through HTTP, the prefill node and the transfer takes tens of
# the decode node's steps: the long answers must outlast it by far.
OFFLINE = Workload(context=160)
CLUSTER = Workload(context=512)


def _prompts(count: int, length: int, first: int) -> list[list[int]]:
    return [[3 + (first + i * 7 + j * 13) % 300 for j in range(length)] for i in range(count)]


LONG_PROMPTS = _prompts(5, LONG_PROMPT, first=0)
SHORT_PROMPTS = _prompts(20, SHORT_PROMPT, first=101)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fair_kv")
    make_tiny_llama(path / "target", seed=0)
    return path / "target"


def _alone(target: Path, workload: Workload) -> tuple[list[list[int]], list[list[int]]]:
    """Each request's output run by itself on a pool where nothing is ever retracted."""
    llm = LLM(str(target), device="cpu", **workload.engine(kv_cache_tokens=8 * workload.context))
    longs = [o.token_ids for o in llm.generate(LONG_PROMPTS, workload.long)]
    shorts = [llm.generate([p], SHORT)[0].token_ids for p in SHORT_PROMPTS]
    return longs, shorts


@pytest.fixture(scope="module")
def alone(target: Path):
    return _alone(target, OFFLINE)


# --- the rule ---------------------------------------------------------------------------------


def _request(name: str, prompt_len: int, decoded: int) -> Request:
    req = Request(name, [5] * prompt_len, SamplingParams(max_tokens=100))
    req.output_token_ids = [7] * decoded
    return req


def test_the_victim_is_the_fewest_decoded_then_the_longest_prompt_then_the_newest():
    oldest = _request("oldest", prompt_len=4, decoded=3)
    far_along = _request("far along", prompt_len=2, decoded=40)
    long_prompt = _request("long prompt", prompt_len=30, decoded=3)
    newest = _request("newest", prompt_len=30, decoded=3)
    running = [oldest, long_prompt, far_along, newest]
    assert retraction_victim(running) is newest
    assert retraction_victim(running[:3]) is long_prompt
    assert retraction_victim([oldest, far_along]) is oldest
    # The newest running request is not the victim when it has decoded more (the old rule).
    assert retraction_victim([oldest, far_along]) is not far_along


# --- the offline engine -----------------------------------------------------------------------


def _steps_until_finished(llm: LLM, requests: list[Request]) -> list[int]:
    """Steps the engine runs until each of `requests` finished (1: in the first step)."""
    steps = [0] * len(requests)
    count = 0
    while not all(req.finished for req in requests):
        llm.engine.step()
        count += 1
        llm.engine.kv_cache.kv_pool.allocator.check_integrity()
        for i, req in enumerate(requests):
            if req.finished and not steps[i]:
                steps[i] = count
    return steps


def test_starvation_short_requests_finish_as_if_alone_offline(target: Path, alone):
    expected_longs, expected_shorts = alone
    llm = LLM(str(target), device="cpu", **OFFLINE.engine())
    engine = llm.engine
    shorts_alone = []
    for i, prompt in enumerate(SHORT_PROMPTS[:3]):
        req = engine.make_request(f"alone{i}", prompt, SHORT)
        engine.add_request(req)
        shorts_alone += _steps_until_finished(llm, [req])
    steps_alone = max(shorts_alone)
    assert steps_alone == SHORT_TOKENS  # one prefill step, then a token per decode step

    longs = [engine.make_request(f"long{i}", p, OFFLINE.long) for i, p in enumerate(LONG_PROMPTS)]
    for req in longs:
        engine.add_request(req)
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 5  # all five run: nothing held for their answers
    shorts = [engine.make_request(f"short{i}", p, SHORT) for i, p in enumerate(SHORT_PROMPTS)]
    for req in shorts:
        engine.add_request(req)
    steps = _steps_until_finished(llm, shorts)
    assert max(steps) <= steps_alone + 2, steps
    assert [req.output_token_ids for req in shorts] == expected_shorts
    while engine.has_work():
        engine.step()
    assert engine.scheduler.num_retractions >= 1
    assert sum(req.num_preemptions for req in longs) >= 1
    assert [req.output_token_ids for req in longs] == expected_longs
    assert engine.kv_cache.is_empty()


def test_a_retracted_request_gives_what_it_gives_alone(target: Path, alone):
    """Greedy, and seeded sampling (each position draws from its own generator)."""
    expected_longs, _ = alone
    long = OFFLINE.long
    seeded = SamplingParams(max_tokens=long.max_tokens, temperature=1.0, seed=5, ignore_eos=True)
    roomy = LLM(str(target), device="cpu", **OFFLINE.engine(kv_cache_tokens=8192))
    seeded_alone = [roomy.generate([p], seeded)[0].token_ids for p in LONG_PROMPTS[:3]]
    llm = LLM(str(target), device="cpu", **OFFLINE.engine(kv_cache_tokens=OFFLINE.small_pool))
    engine = llm.engine
    requests = [engine.make_request(f"g{i}", p, long) for i, p in enumerate(LONG_PROMPTS[:3])]
    requests += [engine.make_request(f"s{i}", p, seeded) for i, p in enumerate(LONG_PROMPTS[:3])]
    for req in requests:
        engine.add_request(req)
    _steps_until_finished(llm, requests)
    retracted = [i for i, req in enumerate(requests) if req.num_preemptions]
    assert retracted, "the pool is meant to be too small for all of them"
    for i in retracted:
        expected = expected_longs[i] if i < 3 else seeded_alone[i - 3]
        assert requests[i].output_token_ids == expected, requests[i].request_id
    assert engine.kv_cache.is_empty()


@pytest.fixture(scope="module")
def spec_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fair_kv_spec")
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "draft", root / "target", 3, noise=0.01)
    return root / "target", root / "draft"


def test_pools_are_back_to_empty_after_retractions_under_speculation(spec_models):
    target, draft = spec_models
    expected = [
        o.token_ids
        for o in LLM(str(target), device="cpu", **OFFLINE.engine(kv_cache_tokens=8192)).generate(
            LONG_PROMPTS, OFFLINE.long
        )
    ]
    llm = LLM(
        str(target),
        device="cpu",
        speculative_algorithm=SPEC,
        draft_model=str(draft),
        num_draft_steps=3,
        **OFFLINE.engine(kv_cache_tokens=OFFLINE.small_pool),
    )
    engine = llm.engine
    requests = [engine.make_request(str(i), p, OFFLINE.long) for i, p in enumerate(LONG_PROMPTS)]
    for req in requests:
        engine.add_request(req)
    while engine.has_work():
        engine.step()
        engine.kv_cache.kv_pool.allocator.check_integrity()
        for depth in engine.speculator.depths:
            depth.kv_pool.allocator.check_integrity()
            # A depth holds no more of a request than the target does: it never runs short
            # where the target did not.
            assert depth.kv_pool.allocator.num_used <= engine.kv_cache.kv_pool.allocator.num_used
    assert engine.scheduler.num_retractions >= 1
    assert [req.output_token_ids for req in requests] == expected
    assert engine.kv_cache.is_empty()
    assert engine.speculator.is_empty()


# --- max_tokens_cap ---------------------------------------------------------------------------


def test_max_tokens_over_the_cap_is_a_400_naming_it(target: Path):
    llm = LLM(str(target), device="cpu", max_model_len=OFFLINE.context, max_tokens_cap=8)
    with pytest.raises(RequestRejectedError, match="cap of 8"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=9))
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8))[0].token_ids) <= 8
    llm.tokenizer.chat_template = CHAT_TEMPLATE
    backend = LocalBackend(llm, model_name="tiny")
    try:
        with TestClient(create_app(backend)) as client:
            body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 9}
            refused = client.post("/v1/completions", json=body)
            assert refused.status_code == 400
            error = refused.json()["error"]
            assert "--max-tokens-cap" in error["message"] and "8" in error["message"]
            assert error["param"] == "max_tokens"
            # Left out, max_tokens is the cap (chat: until the context is full, up to the cap).
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            answer = client.post("/v1/chat/completions", json=chat | {"ignore_eos": True})
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 8
            body.pop("max_tokens")
            assert client.post("/v1/completions", json=body).status_code == 200
    finally:
        backend.close()


# --- the decode node (1 prefill + 1 decode on CPU) --------------------------------------------


def _metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


async def _stream(router, request_id: str, prompt: list[int], params, progress: list[int]):
    """Through the router (no HTTP server: one event loop drives the router)."""
    tokens: list[int] = []
    async for delta in router.generate(request_id, prompt, params):
        tokens += delta.token_ids
        progress[0] = len(tokens)
    return tokens


async def _http_stream(client: AsyncClient, prompt: list[int], max_tokens: int, progress):
    tokens: list[int] = []
    stream = await client.generate(
        prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True
    )
    async for chunk in stream:
        tokens += chunk.token_ids
        progress[0] = len(tokens)
    return tokens


def test_starvation_on_the_decode_node(target: Path):
    """The steps of the decode node are counted in the long requests' tokens: a long request
    that is running gets one token per decode step. Reserving prompt + max_tokens, the fifth
    long request waits for a long one to finish, and the short ones wait behind it: about
    `long_tokens` steps. Counted from when each short request is sent, the
    HTTP server's, the prefill node's and the transfer's work take decode steps too (a CPU step
    of the tiny model takes a few milliseconds), hence `slack` steps on top of its own: on a
    busy two-core host that trip has taken over 200 steps, still well short of the
    `long_tokens` (504) a starved request waits. The offline test holds the engine itself to a
    few steps."""
    slack = 250
    expected_longs, expected_shorts = _alone(target, CLUSTER)
    long_tokens = CLUSTER.long_tokens
    engine = CLUSTER.engine(max_tokens_cap=long_tokens)
    cluster = launch(str(target), prefill=1, decode=1, **engine)
    server = serve(cluster)
    try:

        async def run():
            async with AsyncClient(server.url, timeout=300) as client:
                progress = [[0] for _ in LONG_PROMPTS]
                longs = [
                    asyncio.create_task(_http_stream(client, p, long_tokens, progress[i]))
                    for i, p in enumerate(LONG_PROMPTS)
                ]
                while max(p[0] for p in progress) < 3:
                    await asyncio.sleep(0.01)

                async def short(prompt: list[int]) -> tuple[list[int], int]:
                    sent_at = max(p[0] for p in progress)
                    tokens = await _http_stream(client, prompt, SHORT_TOKENS, [0])
                    return tokens, max(p[0] for p in progress) - sent_at

                shorts = await asyncio.gather(*(short(p) for p in SHORT_PROMPTS))
                return await asyncio.gather(*longs), shorts

        longs, shorts = asyncio.run(asyncio.wait_for(run(), 300))
        assert [tokens for tokens, _ in shorts] == expected_shorts
        steps = [waited for _, waited in shorts]
        assert max(steps) <= SHORT_TOKENS + slack, steps
        assert longs == expected_longs
        assert wait_for(cluster.kv_pools_empty, 30)
        decode = next(s for s in cluster.node_stats() if s["node"] == "decode-0")
        assert decode["retractions"] >= 1
        with httpx.Client(base_url=server.url) as http:
            metrics = http.get("/metrics").text
            assert _metric(metrics, "pdcluster_node_retractions_total", node="decode-0") >= 1
            body = {"prompt": [5, 6], "max_tokens": long_tokens + 1}
            refused = http.post("/v1/completions", json=body)
            assert refused.status_code == 400
            assert "--max-tokens-cap" in json.loads(refused.text)["error"]["message"]
    finally:
        server.stop()
        cluster.shutdown()


def test_retraction_on_a_speculating_decode_node_keeps_output_and_frees_every_pool(spec_models):
    target, draft = spec_models
    engine = OFFLINE.engine(kv_cache_tokens=OFFLINE.small_pool)
    expected = [
        o.token_ids
        for o in LLM(str(target), device="cpu", **engine).generate(LONG_PROMPTS, OFFLINE.long)
    ]
    cluster = launch(
        str(target),
        prefill=1,
        decode=1,
        speculative_algorithm=SPEC,
        draft_model=str(draft),
        num_draft_steps=3,
        **engine,
    )
    try:

        async def run():
            return await asyncio.gather(
                *(
                    _stream(cluster.router, f"r{i}", p, OFFLINE.long, [0])
                    for i, p in enumerate(LONG_PROMPTS)
                )
            )

        assert asyncio.run(asyncio.wait_for(run(), 300)) == expected
        assert wait_for(cluster.kv_pools_empty, 30)
        decode = next(s for s in cluster.node_stats() if s["node"] == "decode-0")
        assert decode["retractions"] >= 1
        assert decode["kv_used"] == 0
    finally:
        cluster.shutdown()
