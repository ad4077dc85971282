"""The next speculative round's verify queued before its step
(spec.runtime.device_round.LaunchedVerify):
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

from engine import LLM, SamplingParams
from spec.runtime.round_plan import PlanPolicy

SPEC = "multi-layer-eagle"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("launch_ahead")
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "draft", root / "target", 3, noise=0.05)
    return root / "target", root / "draft"


def _llm(models, launch_ahead: bool, device: str) -> LLM:
    """An engine whose rounds on the device queue the next round's verify from the host
    (with `launch_ahead`; the one the device queues on a GPU is
    tests/test_spec_queued_verify.py's), or queue none."""
    target, draft = models
    llm = LLM(
        str(target), device=device, speculative_algorithm=SPEC, draft_model=str(draft),
        num_draft_steps=3, kv_cache_tokens=8192, max_num_seqs=16,
    )  # fmt: skip
    queue_next = "host" if launch_ahead else "none"
    llm.engine.speculator.set_plan_policy(PlanPolicy("always", queue_next=queue_next))
    return llm


def _stepped(
    llm: LLM, prompts, params, join_at: int | None = None, abort_at: int | None = None
) -> tuple[dict[str, list], dict[str, int]]:
    """Steps the engine by hand: the last prompt joins after `join_at` steps (None: with the
    others), and the first request is aborted after `abort_at`. Returns each request's
    output, and counts: rounds on the device, verifies queued before their step
    (`launched`) and rounds that took one (`taken`)."""
    engine = llm.engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    requests = [engine.make_request(str(i), *pair) for i, pair in enumerate(zip(prompts, params))]
    joining = requests[-1] if join_at is not None else None
    for req in requests:
        if req is not joining:
            engine.add_request(req)
    steps, launched, last = 0, 0, None
    while engine.has_work() or (join_at is not None and steps <= join_at):
        if steps == join_at:
            engine.add_request(joining)
        if steps == abort_at:
            assert engine.abort(requests[0].request_id) is requests[0]
        engine.step()
        steps += 1
        queued = engine.speculator.queued_verify()
        launched += queued is not None and queued is not last
        last = queued
    plans = engine.plan_counts()
    counts = {
        "rounds": sum(n for plan, n in plans.items() if plan.startswith(("chain/d", "chain/q"))),
        "launched": launched,
        "taken": plans.get("chain/queued_by_host", 0),
    }
    return {req.request_id: list(req.output_token_ids) for req in requests}, counts


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(4, 30))] for _ in range(n)]


def _check_empty(llm: LLM) -> None:
    assert not llm.engine.has_work()
    assert llm.engine.kv_cache.is_empty() and llm.engine.speculator.is_empty()


@pytest.mark.parametrize("device", DEVICES)
def test_the_next_verify_is_taken_and_changes_nothing(models, device):
    """Requests finish at different rounds (their max_tokens, EOS for some): each round but
    the last queues the next one's verify, of the requests it leaves running."""
    prompts = _prompts(1, 6)
    params = [
        SamplingParams(max_tokens=12 + 7 * i, temperature=0, ignore_eos=i % 2 == 0)
        for i in range(len(prompts))
    ]
    expected, plain_counts = _stepped(_llm(models, False, device), prompts, params)
    assert plain_counts["launched"] == plain_counts["taken"] == 0
    llm = _llm(models, True, device)
    got, counts = _stepped(llm, prompts, params)
    assert got == expected
    _check_empty(llm)
    # Nothing joins between steps here: every round but the last launched the next one's
    # verify, and each was taken.
    assert counts["taken"] == counts["launched"] == counts["rounds"] - 1 > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("abort_at", [None, 7])
def test_a_request_joining_or_aborted_between_steps_voids_the_launched_verify(
    models, abort_at, device
):
    prompts = _prompts(2, 4)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    expected, _ = _stepped(_llm(models, False, device), prompts, params, 5, abort_at)
    llm = _llm(models, True, device)
    got, counts = _stepped(llm, prompts, params, 5, abort_at)
    assert got == expected
    _check_empty(llm)
    assert llm.engine.speculator.queued_verify() is None
    # Some launched verifies were voided (the join, the abort), the others taken.
    assert 0 < counts["taken"] < counts["launched"]
