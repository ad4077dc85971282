"""Every forward of draft depth d is built from depth d's own pools: poisoning every other
pool (the other depths' and the target's KV with NaN, their request tables with wrong slots)
while depth d runs changes neither its outputs nor the poisoned pools. The target's verify
forward likewise never touches a draft pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_drafts import make_good_draft, make_predictable_llama

from engine import LLM, SamplingParams
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool

K = 3
PROMPTS = [[1, 17, 99, 4, 250, 31, 8], [1, 200], list(range(3, 40)), [5] * 23, [7]]
PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("spec_isolation")
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "draft", root / "target", K, noise=0.01)
    return root / "target", root / "draft"


def _llm(folders: tuple[Path, Path]) -> LLM:
    target, draft = folders
    return LLM(
        str(target),
        device="cpu",
        kv_cache_tokens=1024,
        max_num_seqs=8,
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(draft),
    )


class _Poison:
    """Overwrite pools with garbage, then check the garbage is intact and restore them."""

    def __init__(self, pools: list[tuple[KVPool, ReqToTokenPool]]) -> None:
        self.pools = pools
        self.saved: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        self.garbage: list[torch.Tensor] = []

    def __enter__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        for kv, table in self.pools:
            buffers = kv.k_buffers + kv.v_buffers
            self.saved.append(([b.clone() for b in buffers], table.req_to_token.clone()))
            for b in buffers:
                b.fill_(float("nan"))
            # Real slot numbers, but the wrong ones: a stray read gathers NaN, not an error.
            garbage = torch.randint(
                1, kv.capacity + 1, table.req_to_token.shape, generator=generator
            )
            table.req_to_token.copy_(garbage)
            self.garbage.append(garbage)

    def __exit__(self, *exc: object) -> None:
        for (kv, table), (buffers, rows), garbage in zip(self.pools, self.saved, self.garbage):
            for b, original in zip(kv.k_buffers + kv.v_buffers, buffers):
                assert torch.isnan(b).all(), "a forward wrote into a pool that is not its own"
                b.copy_(original)
            assert torch.equal(table.req_to_token, garbage), "a forward wrote a foreign table"
            table.req_to_token.copy_(rows)


def _run(llm: LLM, poison: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
    worker = llm.engine.speculator
    runner = llm.engine.runner
    target_pools = (runner.kv_pool, runner.req_to_token_pool)
    depth_pools = [(d.kv_pool, d.req_to_token_pool) for d in worker.depths]
    recorded: list[torch.Tensor] = []

    def wrap_depth(d: int):
        original = worker.depths[d].forward_flat
        others = [p for i, p in enumerate(depth_pools) if i != d] + [target_pools]

        def forward(inputs, patch=None):
            if poison:
                with _Poison(others):
                    outputs, lens, proposal = original(inputs, patch)
            else:
                outputs, lens, proposal = original(inputs, patch)
            recorded.extend(o.clone() for o in outputs.split(lens))
            return outputs, lens, proposal

        return forward

    original_verify = runner.forward_every_token

    def verify_forward(batch):
        if not poison:
            return original_verify(batch)
        with _Poison(depth_pools):
            return original_verify(batch)

    for d, depth in enumerate(worker.depths):
        depth.forward_flat = wrap_depth(d)
    runner.forward_every_token = verify_forward
    outputs = llm.generate(PROMPTS, PARAMS)
    return [o.token_ids for o in outputs], recorded


def test_each_depth_uses_only_its_own_pools(folders: tuple[Path, Path]) -> None:
    clean_tokens, clean = _run(_llm(folders), poison=False)
    poisoned_tokens, poisoned = _run(_llm(folders), poison=True)
    assert poisoned_tokens == clean_tokens
    assert len(poisoned) == len(clean) > 0
    for ours, reference in zip(poisoned, clean):
        assert not torch.isnan(ours).any()
        assert torch.equal(ours, reference)


def test_the_depths_own_distinct_pools(folders: tuple[Path, Path]) -> None:
    llm = _llm(folders)
    worker = llm.engine.speculator
    runner = llm.engine.runner
    kv_pools = [runner.kv_pool] + [d.kv_pool for d in worker.depths]
    tables = [runner.req_to_token_pool] + [d.req_to_token_pool for d in worker.depths]
    allocators = [p.allocator for p in kv_pools]
    for group in (kv_pools, tables, allocators):
        assert len({id(x) for x in group}) == K + 1
    assert all(d.kv_pool.num_layers == 1 for d in worker.depths)
