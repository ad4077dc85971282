"""The draft's incremental bookkeeping: after every decode step, each depth's KV, boundary
hidden states and next chain equal a from-scratch draft prefill over the committed tokens. And
the prefill -> decode hand-off: a second engine that receives the KV of every depth and a
`DraftState` goes on to produce the target's output, verifying the received chain first."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tiny_drafts import make_good_draft, make_predictable_llama, make_random_draft
from tiny_models import make_tiny_llama

from engine import LLM, SamplingParams
from engine.request import Request
from spec import DraftState

PROMPTS = [[1, 17, 99, 4, 250, 31, 8], [1, 200], list(range(3, 30)), [5] * 13, [7]]
PARAMS = SamplingParams(max_tokens=18, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("spec_state")
    make_tiny_llama(root / "target", seed=0)
    make_random_draft(root / "random", root / "target", 3, seed=1)
    make_predictable_llama(root / "predictable", seed=0)
    make_good_draft(root / "good", root / "predictable", 4, noise=0.01)
    return {
        "random": (root / "target", root / "random"),
        "good": (root / "predictable", root / "good"),
    }


def _llm(folders: tuple[Path, Path], **kw) -> LLM:
    target, draft = folders
    return LLM(
        str(target),
        device="cpu",
        kv_cache_tokens=2048,
        max_num_seqs=8,
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(draft),
        **kw,
    )


def _assert_same_draft_state(ours: Request, scratch: Request, ours_llm: LLM, scratch_llm: LLM):
    a, b = ours.spec_state, scratch.spec_state
    assert a.chain == b.chain
    assert a.chain_probs == pytest.approx(b.chain_probs, abs=1e-4)
    torch.testing.assert_close(a.target_hidden, b.target_hidden, atol=1e-4, rtol=1e-4)
    for x, y in zip(a.boundary, b.boundary):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    depths = zip(ours_llm.engine.speculator.depths, scratch_llm.engine.speculator.depths)
    for d, ((ours_depth, scratch_depth), x, y) in enumerate(zip(depths, a.seqs, b.seqs)):
        assert x.valid_len == y.valid_len == max(0, ours.num_tokens - 1 - d)
        for buffers in ("k_buffers", "v_buffers"):
            mine = getattr(ours_depth.kv_pool, buffers)[0][x.slots[: x.valid_len]]
            theirs = getattr(scratch_depth.kv_pool, buffers)[0][y.slots[: y.valid_len]]
            torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["random", "good"])
def test_incremental_draft_state_equals_a_fresh_prefill(models, kind: str) -> None:
    llm, scratch_llm = _llm(models[kind]), _llm(models[kind])
    engine, scratch = llm.engine, scratch_llm.engine
    requests = [engine.make_request(str(i), p, PARAMS) for i, p in enumerate(PROMPTS)]
    for req in requests:
        engine.add_request(req)
    rounds = 0
    while engine.has_work():
        engine.step()
        # A request with one token left drafts no chain: nothing would verify it.
        alive = [r for r in requests if not r.finished and r.lookahead]
        # The same committed tokens, prefilled at once: prompt x_0..x_{m-1}, then greedy x_m
        # (from the longest prefix the scratch engine's prefix cache holds of the last round's).
        fresh = [
            scratch.make_request(f"s{r.request_id}", r.all_token_ids[:-1], PARAMS) for r in alive
        ]
        for req in fresh:
            scratch.add_request(req)
        scratch.step()
        for ours, theirs in zip(alive, fresh):
            assert theirs.output_token_ids == [ours.all_token_ids[-1]]
            _assert_same_draft_state(ours, theirs, llm, scratch_llm)
            scratch.scheduler.abort(theirs.request_id)
        rounds += 1
    assert rounds > 3
    assert scratch.kv_cache.is_empty() and scratch.speculator.is_empty()
    if kind == "good":
        assert sum(r.spec_stats.accepted_tokens for r in requests) > 0


def _copy_kv(src_pool, src_slots: list[int], dst_pool, dst_slots: list[int]) -> None:
    for layer in range(src_pool.num_layers):
        for buffers in ("k_buffers", "v_buffers"):
            getattr(dst_pool, buffers)[layer][dst_slots] = getattr(src_pool, buffers)[layer][
                src_slots
            ]


@pytest.mark.parametrize("kind", ["random", "good"])
def test_decode_goes_on_from_a_transferred_draft_state(models, kind: str) -> None:
    prefill, decode = _llm(models[kind]).engine, _llm(models[kind]).engine
    expected = LLM(str(models[kind][0]), device="cpu", kv_cache_tokens=2048).generate(
        PROMPTS, PARAMS
    )
    k = prefill.speculator.num_draft_steps
    received = []
    for i, prompt in enumerate(PROMPTS):
        # Prefill side: the target's prefill, then draft extend for prefill.
        sent = prefill.make_request(str(i), prompt, PARAMS)
        prefill.add_request(sent)
        prefill.step()
        n = len(prompt)
        state = prefill.speculator.export_state(sent)
        assert len(state.draft_token_ids) == len(state.draft_probs) == k
        assert state.target_hidden.shape == (64,)  # spec_hidden_size
        assert state.boundary_hidden.shape == (k - 1, 64)
        # What crosses the wire: plain values and fresh tensors, nothing shared.
        state = DraftState(
            **{
                f.name: (v.clone() if isinstance(v, torch.Tensor) else v)
                for f in dataclasses.fields(state)
                for v in [getattr(state, f.name)]
            }
        )
        # Decode side: reserve the whole generation, receive the KV, adopt, join the batch.
        req = decode.make_request(str(i), prompt, PARAMS)
        decode.kv_cache.grow(req, n + PARAMS.max_tokens)
        decode.speculator.reserve(req, n + PARAMS.max_tokens)
        _copy_kv(prefill.runner.kv_pool, sent.slots[:n], decode.runner.kv_pool, req.slots[:n])
        pairs = zip(prefill.speculator.depth_kv(sent, n), decode.speculator.depth_kv(req, n))
        for (src_pool, src_slots), (dst_pool, dst_slots) in pairs:
            assert src_pool is not dst_pool and len(dst_slots) == n
            _copy_kv(src_pool, src_slots, dst_pool, dst_slots)
        req.output_token_ids.append(sent.output_token_ids[0])
        req.kv_len = n
        decode.speculator.adopt(req, state)
        decode.scheduler.add_running(req)
        prefill.scheduler.abort(sent.request_id)
        received.append(req)
    assert prefill.kv_cache.is_empty() and prefill.speculator.is_empty()

    decode.step()  # the first step verifies the received chains
    assert all(r.spec_stats.verify_steps == 1 for r in received)
    assert all(r.spec_stats.proposed_tokens == min(k, PARAMS.max_tokens - 2) for r in received)
    if kind == "good":
        assert sum(r.spec_stats.accepted_tokens for r in received) > 0
    while decode.has_work():
        decode.step()
    assert [r.output_token_ids for r in received] == [o.token_ids for o in expected]
    assert decode.kv_cache.is_empty() and decode.speculator.is_empty()


def test_boundary_rows_of_one_batch_are_read_back_whole_only_in_that_batchs_order() -> None:
    """A decode step's extend leaves each request the index of its row in one batch tensor;
    the next extend copies that tensor whole only when its requests are the same, in order."""
    from spec.runtime.state import BatchRows, whole_batch

    batch = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)  # [K-1, n, hidden]
    rows = [BatchRows(batch, i) for i in range(3)]
    assert len(rows[1]) == 2 and torch.equal(rows[1][0], batch[0, 1])
    assert [r.tolist() for r in rows[2]] == [batch[0, 2].tolist(), batch[1, 2].tolist()]
    with pytest.raises(IndexError):
        rows[0][2]
    assert whole_batch(rows) is batch
    assert whole_batch(rows[::-1]) is None  # the same requests in another order
    assert whole_batch(rows[:2]) is None  # some of them finished
    assert whole_batch([list(rows[0]), *rows[1:]]) is None  # one drafted elsewhere
    other = [BatchRows(batch.clone(), 0), *rows[1:]]
    assert whole_batch(other) is None
