"""The next speculative round's verify queued before its step (spec.device_round.LaunchedVerify):
behind the last round's extend, for the requests that round leaves running, reading their
chains on the device. The step takes it only if it is of the same requests with the same
tokens; a request joining or aborted in between makes the step verify afresh, and the output
is the same as without it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from devices import DEVICES
from tiny_drafts import make_good_draft, make_predictable_llama

import spec.device_round
from engine import LLM, SamplingParams

SPEC = "multi-layer-eagle"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("launch_ahead")
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "draft", root / "target", 3, noise=0.05)
    return root / "target", root / "draft"


def _llm(models, launch_ahead: bool, monkeypatch, device: str) -> tuple[LLM, dict[str, int]]:
    target, draft = models
    llm = LLM(
        str(target), device=device, speculative_algorithm=SPEC, draft_model=str(draft),
        num_draft_steps=3, kv_cache_tokens=8192, max_num_seqs=16,
    )  # fmt: skip
    worker = llm.engine.speculator
    counts = {"launched": 0, "taken": 0, "rounds": 0}
    launched_batches = []
    launch, device_round = worker._launch_verify, worker._device_round

    def counted_launch(*args):
        launch(*args)
        if worker._launched is not None:
            counts["launched"] += 1
            launched_batches.append(worker._launched.batch)

    def counted_round(inputs, batch, outputs, *rest):
        counts["rounds"] += 1
        counts["taken"] += any(batch is launched for launched in launched_batches)
        return device_round(inputs, batch, outputs, *rest)

    if launch_ahead:
        monkeypatch.setattr(worker, "_launch_verify", counted_launch)
    else:
        monkeypatch.setattr(worker, "_launch_verify", lambda *args: None)
    monkeypatch.setattr(worker, "_device_round", counted_round)
    # The verify queued by the host only: the one the device queues on a GPU is
    # tests/test_spec_queued_verify.py's.
    monkeypatch.setattr(spec.device_round, "holds_next_round", lambda *args: False)
    return llm, counts


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(4, 30))] for _ in range(n)]


def _check_empty(llm: LLM) -> None:
    assert not llm.engine.has_work()
    assert llm.engine.kv_cache.is_empty() and llm.engine.speculator.is_empty()


@pytest.mark.parametrize("device", DEVICES)
def test_the_next_verify_is_taken_and_changes_nothing(models, monkeypatch, device):
    """Requests finish at different rounds (their max_tokens, EOS for some): each round but
    the last queues the next one's verify, of the requests it leaves running."""
    prompts = _prompts(1, 6)
    params = [
        SamplingParams(max_tokens=12 + 7 * i, temperature=0, ignore_eos=i % 2 == 0)
        for i in range(len(prompts))
    ]
    plain, _ = _llm(models, False, monkeypatch, device)
    expected = [(o.token_ids, o.usage.spec_verify_steps) for o in plain.generate(prompts, params)]
    llm, counts = _llm(models, True, monkeypatch, device)
    got = [(o.token_ids, o.usage.spec_verify_steps) for o in llm.generate(prompts, params)]
    assert got == expected
    _check_empty(llm)
    # Nothing joins between steps here: every round but the last launched the next one's
    # verify, and each was taken.
    assert counts["taken"] == counts["launched"] == counts["rounds"] - 1 > 0


def _stepped(llm: LLM, prompts, params, join_at: int, abort_at: int | None) -> dict[str, list]:
    """Steps the engine by hand: the last prompt joins after `join_at` steps, and the first
    request is aborted after `abort_at`."""
    engine = llm.engine
    requests = [engine.make_request(str(i), p, params) for i, p in enumerate(prompts)]
    for req in requests[:-1]:
        engine.add_request(req)
    steps = 0
    while engine.has_work() or steps <= join_at:
        if steps == join_at:
            engine.add_request(requests[-1])
        if steps == abort_at:
            assert engine.abort(requests[0].request_id) is requests[0]
        engine.step()
        steps += 1
    return {req.request_id: list(req.output_token_ids) for req in requests}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("abort_at", [None, 7])
def test_a_request_joining_or_aborted_between_steps_voids_the_launched_verify(
    models, monkeypatch, abort_at, device
):
    prompts = _prompts(2, 4)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain, _ = _llm(models, False, monkeypatch, device)
    expected = _stepped(plain, prompts, params, join_at=5, abort_at=abort_at)
    llm, counts = _llm(models, True, monkeypatch, device)
    got = _stepped(llm, prompts, params, join_at=5, abort_at=abort_at)
    assert got == expected
    _check_empty(llm)
    assert llm.engine.speculator._launched is None
    # Some launched verifies were voided (the join, the abort), the others taken.
    assert 0 < counts["taken"] < counts["launched"]
