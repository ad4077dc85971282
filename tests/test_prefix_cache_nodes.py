"""The prefix cache where nodes serve: a prefill node reuses a cached prefix yet sends the KV
of the whole prompt, equal to what a node without the cache computes, says how many tokens
came from the cache (PrefillResult.cached_tokens) and passes its KV audit with cached slots;
the OpenAI API's usage carries prompt_tokens_details.cached_tokens; /metrics counts lookups,
hits, evictions and the tokens held; `--disable-prefix-cache` turns it off."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_BACKEND_MODEL as MODEL
from fastapi.testclient import TestClient
from node_builders import built, new_prefill_node
from prometheus_client.parser import text_string_to_metric_families
from test_early_announce import Recorder, finish_sends, run_batch

from cluster.client_protocol import CompletionUsage
from cluster.commands.cli import build_parser
from cluster.commands.cli_commands import engine_args
from cluster.control.local_backend import LocalBackend
from cluster.frontend.backend import cached_prompt_usage
from cluster.frontend.choices import total_usage
from cluster.frontend.openai_api import create_app
from engine import LLM
from metadata.messages import PrefillResult

SYSTEM = list(range(30, 70))


class KVRecorder(Recorder):
    """A Recorder that also keeps the KV each send would read, by room."""

    def __init__(self) -> None:
        super().__init__()
        self.kv: dict[int, list[torch.Tensor]] = {}

    def send_kv(self, dst_rank, room, pools_and_slots, metadata, row, begun=None):
        self.kv[room] = [pool.kv_buffer[slots].clone() for pool, slots in pools_and_slots]
        return super().send_kv(dst_rank, room, pools_and_slots, metadata, row, begun)


@contextmanager
def _real_prefill_node(model: Path, recorder: Recorder, cache: bool, chunk: int | None = None):
    """A prefill node built through its constructor on the tiny model (tests/node_builders.py),
    whose outboxes and KV sender are `recorder`."""
    engine = dict(chunked_prefill_size=chunk, enable_prefix_cache=cache)
    with built(new_prefill_node(model, 512, 4, **engine)) as node:
        node.rank = 0
        node.outgoing.outboxes = {0: recorder}
        node.outgoing.sender = SimpleNamespace(send=recorder.send_kv, begin=recorder.begin_kv)
        yield node


def _serve(node, prompts: dict[int, list[int]]) -> None:
    for room, prompt in prompts.items():
        run_batch(node, {room: (prompt, 4)})
        while node.prefilling:  # a prompt in chunks takes several steps
            node.engine.step()
        finish_sends(node, node.outgoing.outboxes[0])


@pytest.mark.parametrize("chunk", [None, 16])
def test_a_prefill_node_reuses_a_cached_prefix_and_sends_the_whole_prompts_kv(
    tiny_model_path, chunk
):
    prompts = {11: SYSTEM + [5, 6, 7], 12: SYSTEM + [8, 9], 13: SYSTEM + [5, 6, 7]}
    sent = {}
    for cache in (False, True):
        recorder = KVRecorder()
        with _real_prefill_node(tiny_model_path, recorder, cache, chunk) as node:
            _serve(node, prompts)
            sent[cache] = recorder.kv
            results = {r.room: r.cached_tokens for r in recorder.messages(PrefillResult)}
            if cache:
                assert results == {11: 0, 12: len(SYSTEM), 13: len(SYSTEM) + 2}
                stats = node.kv_cache.prefix_cache_stats()
                assert stats["prefix_cache_hit_tokens"] == 2 * len(SYSTEM) + 2
                assert stats["prefix_cache_tokens"] == len(SYSTEM) + 5
            else:
                assert results == {11: None, 12: None, 13: None}
                assert node.kv_cache.prefix_cache_stats() == {}
            assert all(p.used == p.held for p in node._pool_counts())  # the audit
            assert node.kv_cache.is_empty()
    for room, prompt in prompts.items():
        [with_cache], [without] = sent[True][room], sent[False][room]
        assert with_cache.shape[0] == len(prompt)  # the whole prompt's KV crosses
        torch.testing.assert_close(with_cache, without, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def cached_client(tiny_model_path):
    llm = LLM(str(tiny_model_path), device="cpu", max_model_len=256, kv_cache_tokens=2048)
    backend = LocalBackend(llm, model_name=MODEL)
    yield TestClient(create_app(backend)), backend
    backend.close()


def _complete(client: TestClient, **body) -> dict:
    response = client.post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_usage_reports_the_cached_prompt_tokens(cached_client):
    client, backend = cached_client
    prompt = "The prefix cache keeps what was computed before."
    first = _complete(client, prompt=prompt, max_tokens=4)
    second = _complete(client, prompt=prompt, max_tokens=4)
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": prompt_tokens - 1}
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    # Parallel samples read the prompt once: it counts once.
    both = _complete(client, prompt=prompt, max_tokens=4, n=2)
    assert both["usage"]["prompt_tokens_details"] == {"cached_tokens": prompt_tokens - 1}
    text = asyncio.run(backend.metrics_text()).decode()
    samples = {
        s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
    }
    assert samples["pdcluster_node_prefix_cache_hit_tokens_total"] >= 2 * (prompt_tokens - 1)
    assert samples["pdcluster_node_prefix_cache_lookup_tokens_total"] >= 3 * (prompt_tokens - 1)
    assert samples["pdcluster_node_prefix_cache_tokens"] > 0
    assert samples["pdcluster_node_prefix_cache_evicted_tokens_total"] == 0


def test_usage_without_a_prefix_cache_says_nothing_of_it():
    assert cached_prompt_usage(None) == {}
    assert cached_prompt_usage(3) == {"prompt_tokens_details": {"cached_tokens": 3}}
    usages = [{"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}] * 2
    requests = [type("R", (), {"sample": s})() for s in (0, 1)]
    assert "prompt_tokens_details" not in total_usage(usages, requests)


def test_disable_prefix_cache_reaches_the_engine():
    parser = build_parser()
    on = engine_args(parser.parse_args(["serve"]))
    off = engine_args(parser.parse_args(["serve", "--disable-prefix-cache"]))
    assert on.enable_prefix_cache and not off.enable_prefix_cache


def test_the_client_reads_the_cached_tokens():
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    parsed = CompletionUsage.parse({**usage, "prompt_tokens_details": {"cached_tokens": 4}})
    assert parsed.cached_tokens == 4 and parsed.extra == {}
    assert CompletionUsage.parse(usage).cached_tokens is None
    # What the server had cached does not make two answers' usage differ.
    assert parsed == CompletionUsage.parse(usage)
