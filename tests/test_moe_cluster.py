"""Mixtral and Qwen3-MoE through a prefill node and a decode node on CPU: the prompt's KV (shaped
as a dense model's: the experts keep no state) crosses over gloo, and the greedy output is
transformers' own token for token, whole prompts and prompts prefilled in chunks alike; the
transfer spec the two nodes compare at connect time tells apart two MoE configs that differ in
their routing alone (the offline engine against transformers: test_moe_models.py)."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from family_checks import hf_greedy
from tiny_families import make_tiny_family

from engine import SamplingParams
from engine.loading.loader import EngineArgs, resolve
from metadata.handshake import spec_mismatches
from metadata.node_common import transfer_spec

# The longest prompt (57 tokens) is prefilled in chunks of CHUNK, the others whole.
CHUNK = 16
PROMPTS = [
    [1, 17, 99, 4, 250, 31, 8],
    [1, 200],
    list(range(3, 60)),
    [5] * 23,
]
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
# family -> (seed, overrides), as in test_moe_models.py.
FAMILIES = {
    "mixtral": (3, dict(num_hidden_layers=3)),
    "qwen3_moe": (1, dict(num_hidden_layers=3, mlp_only_layers=[1])),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_and_decode_nodes_give_transformers_output(tmp_path, family: str) -> None:
    pytest.importorskip("ray")
    from cluster_helpers import launch

    seed, overrides = FAMILIES[family]
    hf = make_tiny_family(tmp_path / family, family, seed, **overrides)
    expected = hf_greedy(hf, PROMPTS, MAX_TOKENS)
    cluster = launch(
        str(tmp_path / family),
        prefill=1,
        decode=1,
        kv_cache_tokens=2048,
        chunked_prefill_size=CHUNK,
    )
    try:
        outputs = asyncio.run(_generate_all(cluster.router, family))
        assert cluster.kv_pools_empty()
    finally:
        cluster.shutdown()
    assert outputs == expected


async def _generate_all(router, family: str) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for delta in router.generate(f"{family}-{i}", prompt, GREEDY):
            tokens += delta.token_ids
        return tokens

    try:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
    finally:
        await router.close()


def test_the_transfer_spec_tells_routings_apart(tmp_path) -> None:
    """A prefill node whose model renormalises its top-k weights and a decode node whose model
    does not have the same KV layout, but refuse to pair: the spec fingerprints the config."""
    seed, overrides = FAMILIES["qwen3_moe"]
    # Folders of one name: the spec names the folder beside the config's fingerprint.
    plain, normed = tmp_path / "plain" / "model", tmp_path / "normed" / "model"
    make_tiny_family(plain, "qwen3_moe", seed, **overrides)
    shutil.copytree(plain, normed)
    config_file = normed / "config.json"
    config_file.write_text(
        json.dumps({**json.loads(config_file.read_text()), "norm_topk_prob": True})
    )
    specs = [
        transfer_spec(resolve(EngineArgs(model=str(folder), device="cpu")))
        for folder in (plain, normed, plain)
    ]
    assert specs[0].num_layers == 3 and specs[0].num_kv_heads == 2 and specs[0].head_dim == 16
    assert [m.split()[0] for m in spec_mismatches(specs[0], specs[1])] == ["model"]
    assert spec_mismatches(specs[0], specs[2]) == []
