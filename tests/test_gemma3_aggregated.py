"""A Gemma 3 model served by an aggregated replica on CPU (prefill and decode in one node, behind
the router and the HTTP API): the answers of the offline engine, which tests/test_gemma3.py holds
to transformers' own, here checked against transformers too, over prompts longer than the
sliding window."""

from __future__ import annotations

import pytest
from cluster_helpers import launch_aggregated, serve, wait_for
from family_checks import hf_greedy
from tiny_families import make_tiny_family

from cluster.client import Client
from engine import LLM, SamplingParams

ray = pytest.importorskip("ray")

PROMPTS = ["hello there", "a", "the quick brown fox jumps over the lazy dog", "1 2 3 4 5 6 7"]
ENGINE = dict(max_model_len=512, kv_cache_tokens=2048, max_num_seqs=8)
LAYERS = dict(
    num_hidden_layers=3,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    sliding_window=6,
)


def test_an_aggregated_replica_gives_the_offline_and_transformers_output(tmp_path) -> None:
    path = tmp_path / "gemma3"
    hf = make_tiny_family(path, "gemma3", seed=4, **LAYERS)
    offline = LLM(str(path), device="cpu", **ENGINE)
    expected = offline.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0))
    prompt_ids = [offline.tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    assert [out.token_ids for out in expected] == hf_greedy(hf, prompt_ids, 16, stop_at_eos=True)
    cluster = launch_aggregated(str(path), replicas=1, **ENGINE)
    server = serve(cluster)
    try:
        with Client(server.url) as client:
            for prompt, ref in zip(PROMPTS, expected):
                out = client.generate(prompt, max_tokens=16, temperature=0)
                assert (out.token_ids, out.text, out.finish_reason) == (
                    ref.token_ids,
                    ref.text,
                    ref.finish_reason,
                )
        assert wait_for(cluster.kv_pools_empty, 30)
    finally:
        server.stop()
        cluster.shutdown()
