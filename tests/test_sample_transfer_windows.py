"""The transfer of a parallel sample's draft KV, as both nodes size it: the carrier's brings
each depth's whole prompt, another sample's only the positions from n-1-d on (the rest it
shares with the carrier, in the slots the decode node reserved for both). The prefill node's
slots, the decode node's receive slots, the scratch sizes of a transfer no request takes and
the void transfer of a failed prefill all agree, and the decode node reserves each depth's
prompt once."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_drafts import make_good_draft, make_predictable_llama

from decode_node.prealloc import first_step_slots, fits, preallocate
from decode_node.receives import receive_pools, scratch_sizes
from engine import LLM, SamplingParams
from metadata.buffers import MetadataBuffers
from metadata.messages import TransferAnnounce
from metadata.wire import kv_nbytes
from prefill_node.transfer_contents import void_pools
from spec.runtime.sample_extend import shared_prompt_len

K = 3
PROMPT = [3 + (7 * j) % 250 for j in range(40)]
PARAMS = SamplingParams(n=3, max_tokens=8, temperature=0.8, seed=4, ignore_eos=True)
ROW_NBYTES = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sample_windows")
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "draft", root / "target", K, noise=0.01)
    return root / "target", root / "draft"


def _llm(models: tuple[Path, Path]) -> LLM:
    target, draft = models
    return LLM(
        str(target),
        device="cpu",
        kv_cache_tokens=512,
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(draft),
        num_draft_steps=K,
    )


def test_both_nodes_size_a_samples_draft_kv_alike(models):
    n = len(PROMPT)
    prefill = _llm(models).engine
    sent = [prefill.make_request(str(s), PROMPT, PARAMS.for_sample(s)) for s in range(3)]
    prefill.add_samples(sent)
    prefill.step()  # the prompt, each sample's first token and its draft extend
    speculator = prefill.speculator
    sent_slots = [
        [len(slots) for _, slots in speculator.depth_kv(req, n, shares_prompt=i > 0)]
        for i, req in enumerate(sent)
    ]
    assert sent_slots[0] == [n] * K
    assert sent_slots[1] == sent_slots[2] == [n - shared_prompt_len(n, d) for d in range(K)]

    decode = _llm(models).engine
    metadata = MetadataBuffers(4, 64, K, 1, decode.runner.config.dtype, "cpu")
    waiting = [decode.make_request(str(s), PROMPT, PARAMS.for_sample(s)) for s in range(3)]
    assert fits(waiting, decode, metadata)
    preallocate(waiting, decode, metadata)
    depths = decode.speculator.depths
    for d, runner in enumerate(depths):
        carrier, *others = [req.spec_state.seqs[d] for req in waiting]
        shared = shared_prompt_len(n, d)
        assert all(seq.slots[:shared] == carrier.slots[:shared] for seq in others)
        # The prompt once, then each sample's own positions of its first step.
        own = first_step_slots(waiting[0]) - shared
        assert runner.kv_pool.allocator.num_used == first_step_slots(waiting[0]) + 2 * own

    pools = [kv_nbytes(runner.kv_pool, 1) for runner in depths]
    for i, req in enumerate(waiting):
        announce = TransferAnnounce(int(req.request_id) + 1, 0, n, K, 0 if i == 0 else 1)
        received = receive_pools(announce, req, decode.runner.kv_pool, decode.speculator)
        depth_slots = [len(slots) for _, slots in received[-K:]]
        assert depth_slots == sent_slots[i]
        sizes, reason = scratch_sizes(
            announce, decode.runner.kv_pool, decode.speculator, ROW_NBYTES
        )
        assert reason is None
        assert sizes[-1 - K : -1] == [p * count for p, count in zip(pools, depth_slots)]
        assert len(sizes) == len(received) + 1
        void = void_pools(prefill.runner.kv_pool, speculator, n, True, carries_prompt=i == 0)
        assert [len(slots) for _, slots in void] == [len(slots) for _, slots in received]
