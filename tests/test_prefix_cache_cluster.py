"""The prefix cache through the cluster (Ray local actors on CPU): a 1P1D cluster, whose prefill
node reuses cached prefixes and still sends the whole prompt's KV, and an aggregated replica
give the greedy output of an offline engine without the cache over shared prefixes and
multi-turn histories; usage's prompt_tokens_details.cached_tokens and the nodes' stats count
the reuse; every node's KV audit finds the cached slots accounted for; a speculating 1P1D
cluster's prefill node caches its draft KV with the target's and sends both, and so do the
prefill nodes of a 2P2D cluster drafting trees, routed by cache_aware; with
--disable-prefix-cache nothing is cached; with two prefill nodes and --prefill-policy
cache_aware, a conversation's turns go to the prefill node that holds it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest
from cluster_helpers import launch, launch_aggregated, serve, wait_for
from tiny_drafts import make_good_draft
from tiny_models import make_tiny_llama

from engine import LLM, SamplingParams
from engine.sampling.grammar import grammar_library_available, json_schema_grammar

ray = pytest.importorskip("ray")

ENGINE = dict(max_model_len=512, kv_cache_tokens=2048, max_num_seqs=16, chunked_prefill_size=16)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-prefix-cluster")
    make_tiny_llama(path)
    return str(path)


def _turns(seed: int) -> list[list[list[int]]]:
    """Rounds of prompts: two conversations sharing a system prompt, each round resending a
    conversation's history with a new message (the answers are added as they come)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 300) for _ in range(40)]
    return [
        [system + [rng.randrange(3, 300) for _ in range(rng.randint(2, 8))] for _ in range(2)]
        for _ in range(3)
    ]


def _converse(complete, seed: int) -> tuple[list[list[int]], list[int]]:
    """Every round's answers and the cached tokens each request's usage reported."""
    histories: list[list[int]] = [[], []]
    answers, cached = [], []
    for round_prompts in _turns(seed):
        for i, message in enumerate(round_prompts):
            prompt = histories[i] + (message if not histories[i] else message[40:])
            tokens, usage = complete(prompt)
            answers.append(tokens)
            cached.append(usage.get("prompt_tokens_details", {}).get("cached_tokens"))
            histories[i] = prompt + tokens
    return answers, cached


def _http_complete(url: str):
    def complete(prompt: list[int]) -> tuple[list[int], dict]:
        body = {
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        answer = response.json()
        return answer["choices"][0]["token_ids"], answer["usage"]

    return complete


def _offline(tiny_model: str):
    llm = LLM(tiny_model, device="cpu", enable_prefix_cache=False, **ENGINE)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

    def complete(prompt: list[int]) -> tuple[list[int], dict]:
        return llm.generate([prompt], params)[0].token_ids, {}

    return complete


@pytest.mark.parametrize(
    "layout", ["1P1D", "aggregated", "1P1D-speculative", "2P2D-speculative-tree"]
)
def test_the_cluster_reuses_prefixes_without_changing_output(tiny_model, layout, tmp_path):
    expected, _ = _converse(_offline(tiny_model), seed=1)
    given = 40  # the system prompt
    if layout == "1P1D-speculative":
        draft = make_good_draft(tmp_path / "draft", Path(tiny_model), 2, noise=0.01)
        speculation = dict(
            speculative_algorithm="multi-layer-eagle", draft_model=str(draft), num_draft_steps=2
        )
        cluster = launch(tiny_model, prefill=1, decode=1, **speculation, **ENGINE)
        given -= 2  # a match's last K positions are computed again (spec/runtime/prefix_drafts.py)
    elif layout == "2P2D-speculative-tree":
        draft = make_good_draft(tmp_path / "draft", Path(tiny_model), 2, noise=0.01)
        speculation = dict(
            speculative_algorithm="multi-layer-eagle",
            draft_model=str(draft),
            num_draft_steps=2,
            speculative_topk=2,
            num_draft_tokens=4,
        )
        # cache_aware: a conversation's turns go to the prefill node that holds its prefix.
        cluster = launch(
            tiny_model, prefill=2, decode=2, prefill_policy="cache_aware", **speculation,
            **ENGINE,
        )  # fmt: skip
        given -= 2
    elif layout == "1P1D":
        cluster = launch(tiny_model, prefill=1, decode=1, **ENGINE)
    else:
        cluster = launch_aggregated(tiny_model, replicas=1, **ENGINE)
    server = serve(cluster)
    try:
        answers, cached = _converse(_http_complete(server.url), seed=1)
        assert answers == expected
        # The first prompt finds nothing; every later one at least the system prompt.
        assert cached[0] == 0 and all(c >= given for c in cached[1:]), cached
        assert wait_for(cluster.kv_pools_empty, 30), cluster.node_stats()
        for actor in cluster.prefill_actors + cluster.decode_actors:
            assert ray.get(actor.audit_kv.remote()) == []
        stats = {s["node"]: s for s in cluster.node_stats()}
        # The prefill node or the replica computes prompts; a decode node's cache (its
        # conversations' KV, decode_node.reuse) is tested in tests/test_decode_reuse.py.
        caching = [s for name, s in stats.items() if name in ("replica-0", "prefill-0")]
        caching += [s for name, s in stats.items() if name == "prefill-1"]
        assert sum(s["prefix_cache_hit_tokens"] for s in caching) == sum(cached)
        assert caching[0]["prefix_cache_tokens"] > 0
    finally:
        server.stop()
        cluster.shutdown()


def _conversations(seed: int, count: int, turns: int) -> list[list[list[int]]]:
    """Each conversation's messages: an opening of 30 tokens that starts with a token of its
    own (no two conversations share a prefix), then messages of 4 to 8 tokens."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 300) for _ in range(n)]

    return [
        [[300 + c] + tokens(29)] + [tokens(rng.randint(4, 8)) for _ in range(turns - 1)]
        for c in range(count)
    ]


def _converse_in_turns(complete, conversations) -> tuple[list[list[int]], list[int], list[int]]:
    """The conversations' turns one request at a time, round by round: every answer, the
    cached tokens each usage reported, and each prompt's length."""
    histories: list[list[int]] = [[] for _ in conversations]
    answers, cached, lengths = [], [], []
    for turn in range(len(conversations[0])):
        for c, messages in enumerate(conversations):
            prompt = histories[c] + messages[turn]
            tokens, usage = complete(prompt)
            answers.append(tokens)
            cached.append(usage.get("prompt_tokens_details", {}).get("cached_tokens"))
            lengths.append(len(prompt))
            histories[c] = prompt + tokens
    return answers, cached, lengths


def test_cache_aware_routing_keeps_a_conversation_on_the_prefill_node_that_holds_it(tiny_model):
    """Three conversations over two prefill nodes, a turn at a time: each turn after the first
    finds the whole previous prompt cached, so it went to the node that prefilled it (round
    robin would send a conversation's second turn to the other node), and the output is the
    offline engine's without a cache."""
    conversations = _conversations(seed=3, count=3, turns=3)
    expected, _, _ = _converse_in_turns(_offline(tiny_model), conversations)
    cluster = launch(tiny_model, prefill=2, decode=1, prefill_policy="cache_aware", **ENGINE)
    server = serve(cluster)
    try:
        answers, cached, lengths = _converse_in_turns(_http_complete(server.url), conversations)
        assert answers == expected
        count = len(conversations)
        assert cached[:count] == [0] * count, cached
        later = zip(cached[count:], lengths)  # a turn, and the same conversation's turn before
        assert all(hit >= previous for hit, previous in later), (cached, lengths)
        stats = {s["node"]: s for s in cluster.node_stats()}
        prefill = [stats[f"prefill-{i}"] for i in range(2)]
        assert all(node["prompts_done"] > 0 for node in prefill), prefill
        assert sum(node["prefix_cache_hit_tokens"] for node in prefill) == sum(cached)
    finally:
        server.stop()
        cluster.shutdown()


def test_disable_prefix_cache_through_the_cluster(tiny_model):
    cluster = launch(tiny_model, prefill=1, decode=1, enable_prefix_cache=False, **ENGINE)
    server = serve(cluster)
    try:
        _, cached = _converse(_http_complete(server.url), seed=2)
        assert cached == [None] * len(cached)  # no prompt_tokens_details at all
        assert all("prefix_cache_hit_tokens" not in s for s in cluster.node_stats())
    finally:
        server.stop()
        cluster.shutdown()


DIGIT_OBJECT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x"],
    "additionalProperties": False,
}


@pytest.mark.skipif(not grammar_library_available(), reason="needs llguidance")
def test_grammar_and_parallel_samples_over_cached_prefixes_match_offline(tiny_model):
    """Requests over a cached system prompt through a 1P1D cluster, with a JSON grammar and with
    n = 2 (each sample decodes from the cached prefix the carrier matched), give the offline
    engine's output without the cache."""
    rng = random.Random(7)
    system = [rng.randrange(3, 300) for _ in range(40)]
    prompts = [system + [rng.randrange(3, 300) for _ in range(5)] for _ in range(3)]
    grammar = json_schema_grammar(DIGIT_OBJECT, "response_format")
    llm = LLM(tiny_model, device="cpu", enable_prefix_cache=False, **ENGINE)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    expected_json = [
        llm.generate([p], SamplingParams(max_tokens=24, temperature=0, grammar=grammar))[0]
        for p in prompts
    ]
    expected_greedy = [llm.generate([p], greedy)[0].token_ids for p in prompts]
    cluster = launch(tiny_model, prefill=1, decode=1, **ENGINE)
    server = serve(cluster)
    try:
        url = f"{server.url}/v1/completions"
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": DIGIT_OBJECT, "strict": True},
        }
        for prompt, expected in zip(prompts, expected_json, strict=True):
            body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
            body["response_format"] = response_format
            answer = httpx.post(url, json=body, timeout=60).json()
            assert answer["choices"][0]["text"] == expected.text
            assert json.loads(expected.text).keys() == {"x"}
        for prompt, expected in zip(prompts, expected_greedy, strict=True):
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "n": 2}
            body["ignore_eos"] = True
            answer = httpx.post(url, json=body, timeout=60).json()
            assert [c["token_ids"] for c in answer["choices"]] == [expected, expected]
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(system)
        assert wait_for(cluster.kv_pools_empty, 30), cluster.node_stats()
        for actor in cluster.prefill_actors + cluster.decode_actors:
            assert ray.get(actor.audit_kv.remote()) == []
    finally:
        server.stop()
        cluster.shutdown()
