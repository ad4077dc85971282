"""A speculative round decided on the device (spec/device_round.py): verify, acceptance and the
fixed draft extend queued back to back and read once. It must commit what the host's round
commits, with the same statistics, and leave nothing behind; requests whose round needs the
host (sampling, penalties, logprobs) make their steps take the host's round."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tiny_drafts import make_good_draft, make_predictable_llama, make_random_draft
from tiny_models import make_tiny_llama

import spec.worker
from engine import LLM, SamplingParams
from engine.kv_pool import KVPool, ReqToTokenPool, grow_holders
from engine.request import Request
from spec.device_round import grow_for_next_round

SPEC = "multi-layer-eagle"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("device_round")
    make_tiny_llama(root / "target", seed=0)
    make_random_draft(root / "random", root / "target", 3, seed=1)
    make_predictable_llama(root / "predictable", seed=0)
    make_good_draft(root / "good", root / "predictable", 3, noise=0.05)
    return {
        "random": (root / "target", root / "random"),
        "good": (root / "predictable", root / "good"),
    }


def _llm(models, kind: str, k: int) -> LLM:
    target, draft = models[kind]
    return LLM(
        str(target), device="cpu", speculative_algorithm=SPEC, draft_model=str(draft),
        num_draft_steps=k, kv_cache_tokens=8192, max_num_seqs=16,
    )  # fmt: skip


def _workload(seed: int, extra: list[SamplingParams] = ()) -> tuple[list, list]:
    """Greedy prompts of 4 to 40 tokens; answers that stop at EOS, a stop token or max_tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(4, 40))] for _ in range(10)]
    params = [
        SamplingParams(
            max_tokens=rng.randint(5, 40),
            temperature=0,
            ignore_eos=i % 3 != 0,
            stop_token_ids=[rng.randrange(3, 300)] if i % 3 == 1 else [],
        )
        for i in range(len(prompts))
    ]
    params[: len(extra)] = extra
    return prompts, params


def _run(llm: LLM, prompts, params, on_device: bool, monkeypatch) -> tuple[list, int]:
    worker = llm.engine.speculator
    rounds = {"device": 0}
    if on_device:
        original = worker._device_round

        def counted(*args):
            rounds["device"] += 1
            return original(*args)

        monkeypatch.setattr(worker, "_device_round", counted)
    else:
        monkeypatch.setattr(spec.worker, "runs_on_device", lambda *args: False)
    outputs = llm.generate(prompts, params)
    monkeypatch.undo()
    assert not llm.engine.has_work()
    assert llm.engine.kv_cache.is_empty() and worker.is_empty()
    summary = [
        (
            o.token_ids,
            o.finish_reason,
            o.usage.spec_verify_steps,
            o.usage.spec_accepted_per_position,
        )
        for o in outputs
    ]
    return summary, rounds["device"]


@pytest.mark.parametrize("kind", ["good", "random"])
@pytest.mark.parametrize("k", [1, 3])
def test_the_device_round_commits_what_the_host_round_does(models, kind, k, monkeypatch):
    prompts, params = _workload(seed=k)
    device, rounds = _run(_llm(models, kind, k), prompts, params, True, monkeypatch)
    host, _ = _run(_llm(models, kind, k), prompts, params, False, monkeypatch)
    assert rounds > 5
    assert device == host
    if kind == "good":
        assert sum(sum(per_position) for *_, per_position in device) > 0


def test_requests_that_need_the_host_take_the_host_round(models, monkeypatch):
    """A sampled request, a penalized one and one with logprobs in the batch: while they run,
    rounds are the host's; output is unchanged, and rounds go to the device once they left."""
    extra = [
        SamplingParams(max_tokens=4, temperature=0.8, seed=3),
        SamplingParams(max_tokens=5, temperature=0, repetition_penalty=1.2),
        SamplingParams(max_tokens=6, temperature=0, logprobs=1),
    ]
    prompts, params = _workload(seed=7, extra=extra)
    device, rounds = _run(_llm(models, "good", 3), prompts, params, True, monkeypatch)
    host, _ = _run(_llm(models, "good", 3), prompts, params, False, monkeypatch)
    assert device == host
    steps = max(steps for _, _, steps, _ in device)
    assert 0 < rounds < steps


def test_the_next_rounds_slots_are_taken_while_the_device_verifies() -> None:
    """Slots for the next verify whatever this round accepts (k + 1 tokens, then the newest and
    k drafts: num_tokens + 2k + 1), never past prompt + max_tokens, and only where the pool
    keeps a step's room for every request after them."""

    def setup(capacity: int) -> tuple[KVPool, ReqToTokenPool, list[Request]]:
        pool, table = KVPool(capacity, 1, 1, 2, torch.float32, "cpu"), ReqToTokenPool(4, 64, "cpu")
        short = Request("short", [1] * 5, SamplingParams(max_tokens=6))  # bound 11
        long = Request("long", [1] * 5, SamplingParams(max_tokens=50))
        for req in (short, long):
            req.output_token_ids = [2, 2]  # num_tokens 7
            grow_holders(pool, table, [(req, req.num_tokens + 3)])  # this round's verify
        return pool, table, [short, long]

    pool, table, (short, long) = setup(capacity=100)
    grow_for_next_round([short, long], 3, pool, table)
    assert len(short.slots) == 11 and len(long.slots) == 7 + 2 * 3 + 1
    assert table.req_to_token[long.row, : len(long.slots)].tolist() == long.slots
    pool.allocator.check_integrity()

    pool, table, (short, long) = setup(capacity=20 + 1 + 8 - 1)  # 8 free once grown: too few
    grow_for_next_round([short, long], 3, pool, table)
    assert len(short.slots) == len(long.slots) == 10
