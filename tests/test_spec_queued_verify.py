"""The next round's verify queued from the device (spec.runtime.device_round.queue_next_verify):
behind a round's extend, before the host has read that round's outcome, each request's verify span
moved on by its accepted count on the device (CudaGraphs.advance_uniform). Requests that the round
ends keep their slots until that verify has run (SpeculativeSteps.release_held)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from devices import DEVICES
from queued_rounds import (
    check_empty,
    count_rounds,
    plain_outputs,
    run_aborting_one,
    stop_token_workload,
    with_emulated_graphs,
    workload,
)
from tiny_drafts import make_good_draft, make_predictable_llama

import spec.runtime.device_round as device_round
from engine import LLM, SamplingParams
from engine.executor.cuda_graph import CudaGraphs
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool
from spec.runtime.device_round import holds_next_round

SPEC = "multi-layer-eagle"


def _graphs(width: int, max_requests: int, context: int, device: str) -> CudaGraphs:
    """A graph set over a small pool whose buffers are loaded and moved, never captured."""
    pool = KVPool(64, 1, 1, 4, torch.float32, device)
    table = ReqToTokenPool(max_requests, context, device)
    attention = SimpleNamespace(supports_cuda_graph=True)
    return CudaGraphs("verify", None, attention, pool, table, [32, 64], width)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 3, 7])
@pytest.mark.parametrize("strided", [False, True])
@torch.inference_mode()
def test_a_moved_span_equals_the_span_loaded_where_it_moved(
    n: int, device: str, strided: bool
) -> None:
    """advance_uniform gives the graph's inputs exactly what load_uniform gives for the spans
    each moved past its kept tokens and the one after: ids, positions, slots from the row
    table, lengths; the padding columns untouched (on a GPU, the Triton kernel). `strided`:
    the counts and candidates are columns of one block, as a round's verdicts are."""
    k = 3
    width, context = k + 1, 40
    graphs = _graphs(width, 8, context, device)
    rng = np.random.default_rng(n)
    table = graphs.req_to_token_pool.req_to_token
    table[:8] = torch.from_numpy(rng.integers(1, 64, size=(8, context))).to(device)
    rows = rng.permutation(8)[:n]
    starts = rng.integers(k, 20, size=n)
    tokens = rng.integers(3, 100, size=(n, width))
    host_table = table.cpu().numpy()
    slots = host_table[rows[:, None], starts[:, None] + np.arange(width)]
    batch = graphs.load_uniform(rows, starts, tokens, slots)

    kept = rng.integers(0, k + 1, size=n)
    candidates = rng.integers(3, 100, size=(n, width))
    rest = rng.integers(3, 100, size=(n, k))
    on = [torch.from_numpy(a).to(device) for a in (kept, candidates, rest)]
    if strided:  # the verdict block a round reads: candidates, then the kept count
        block = torch.cat([on[1], on[0][:, None]], dim=1)
        on[:2] = block[:, width], block[:, :width]
    graphs.advance_uniform(batch, *on)
    moved = graphs.inputs.clone()

    moved_starts = starts + kept + 1
    moved_tokens = np.concatenate([candidates[np.arange(n), kept][:, None], rest], axis=1)
    moved_slots = host_table[rows[:, None], moved_starts[:, None] + np.arange(width)]
    graphs.load_uniform(rows, moved_starts, moved_tokens, moved_slots)
    assert torch.equal(moved, graphs.inputs)


def _request(out: int, slots: int, max_tokens: int, prompt: int = 10):
    return SimpleNamespace(
        slots=[0] * slots,
        num_tokens=prompt + out,
        output_token_ids=[0] * out,
        params=SimpleNamespace(max_tokens=max_tokens),
    )


def test_the_next_verify_is_queued_only_where_every_request_holds_it() -> None:
    """Queued before the round's outcome is known, the next verify must fit whatever the round
    accepts: slots up to m + 2k + 1, and k drafts left after k + 1 tokens committed."""
    k = 3
    # num_tokens 15, m = 14: the next verify reaches position m + 2k + 1 = 21 (22 slots).
    assert holds_next_round([_request(5, 22, 100)], k)
    assert not holds_next_round([_request(5, 21, 100)], k)
    # 8 outputs left (2k + 2): after 4 committed, 4 left, so a lookahead of 3.
    assert holds_next_round([_request(5, 40, 13)], k)
    assert not holds_next_round([_request(5, 40, 12)], k)
    assert not holds_next_round([_request(5, 40, 100), _request(5, 21, 100)], k)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("queued_verify")
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "draft", root / "target", 3, noise=0.05)
    return root / "target", root / "draft"


def _llm(models, device: str, **kwargs) -> LLM:
    target, draft = models
    options = dict(kv_cache_tokens=8192, max_num_seqs=16) | kwargs
    return LLM(
        str(target), device=device, speculative_algorithm=SPEC, draft_model=str(draft),
        num_draft_steps=3, **options,
    )  # fmt: skip


class _Slow:
    """A queued verify that reports itself still running until settled."""

    def __init__(self) -> None:
        self.settled = False

    def done(self) -> bool:
        return self.settled

    def settle(self) -> None:
        self.settled = True


def test_requests_ended_under_a_queued_verify_keep_their_slots_until_it_has_run(
    models, monkeypatch
):
    """With a verify queued behind each round, a request that the round ends keeps its target
    slots until the next round's verify has been read (or the engine waits for it), then
    frees them: the pools come back empty and the output is unchanged."""
    prompts, params = workload(3, 6, 14)
    expected = [o.token_ids for o in _llm(models, "cpu").generate(prompts, params)]
    llm = _llm(models, "cpu")
    engine = llm.engine
    worker, steps = engine.speculator, engine.speculative
    held_slots = []
    queued_verify = worker.queued_verify
    process_tokens = engine.scheduler.process_tokens

    def queued():
        return queued_verify() or _Slow()

    def counted_process_tokens(*args, **kwargs):
        finished = process_tokens(*args, **kwargs)
        held_slots.extend(len(req.slots) for req in finished)
        return finished

    monkeypatch.setattr(worker, "queued_verify", queued)
    monkeypatch.setattr(engine.scheduler, "process_tokens", counted_process_tokens)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    # Ended requests were held with their slots, and freed later.
    assert held_slots and all(n > 0 for n in held_slots)
    assert not steps.held and not engine.has_work()
    assert engine.kv_cache.is_empty() and worker.is_empty()


def _counted(llm: LLM, monkeypatch) -> dict[str, int]:
    return count_rounds(llm, monkeypatch, device_round, "queue_next_verify")


@pytest.mark.parametrize("device", DEVICES)
def test_verifies_queued_from_the_device_change_no_output(models, monkeypatch, device):
    """Requests ending at different rounds (max_tokens, EOS for some): where the rounds run in
    graphs, the device queues the next verify, every round but the last takes a verify queued
    before it, and the tokens are those of plain decoding."""
    prompts, params = workload(4, 6, 14)
    plain = LLM(str(models[0]), device=device, kv_cache_tokens=8192, max_num_seqs=16)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    llm = _llm(models, device)
    counts = _counted(llm, monkeypatch)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    # Nothing joins between steps: every round but the last took a verify queued before it.
    assert counts["taken"] == counts["rounds"] - 1 > 0
    if device == "cuda":
        assert counts["from_device"] > 0
        # The host commits a round while the device still runs its extend: it reads no chain
        # before a round that the device queued.
        assert counts["unread"] == counts["taken_from_device"] > 0
    else:  # eager batches cannot be moved on the device
        assert counts["from_device"] == 0
    engine = llm.engine
    assert not engine.has_work() and not engine.speculative.held
    assert engine.kv_cache.is_empty() and engine.speculator.is_empty()


def _plain(models, prompts, params) -> list[list[int]]:
    return plain_outputs(models[0], prompts, params)


def test_requests_ending_under_a_verify_queued_from_the_device(models, monkeypatch):
    """Stop tokens end requests while the next verify is queued from the device: they are
    held until it has run, the output is plain decoding's, and the pools come back empty."""
    prompts, _ = workload(5, 6, 14)
    params, expected = stop_token_workload(models[0], prompts)
    llm = with_emulated_graphs(_llm(models, "cpu"))
    counts = _counted(llm, monkeypatch)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert counts["from_device"] > 0
    assert counts["unread"] == counts["taken_from_device"] > 0
    check_empty(llm)


@pytest.mark.parametrize("kv_cache_tokens", [8192, 300])
def test_aborts_and_retractions_under_a_verify_queued_from_the_device(models, kv_cache_tokens):
    """A request aborted while the next verify is queued from the device, and (in a pool too
    small for every request) requests retracted meanwhile: the others' output is plain
    decoding's and every slot comes back."""
    prompts, _ = workload(6, 6, 14)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    expected = _plain(models, prompts, [params] * len(prompts))
    llm = with_emulated_graphs(_llm(models, "cpu", kv_cache_tokens=kv_cache_tokens))
    requests, aborted = run_aborting_one(llm, prompts, params, lambda requests, _: requests[2])
    assert aborted is not None, "no verify was queued from the device"
    for i, req in enumerate(requests):
        if req is not aborted:
            assert req.output_token_ids == expected[i]
    if kv_cache_tokens == 300:
        assert llm.engine.scheduler.num_retractions > 0
    check_empty(llm)
