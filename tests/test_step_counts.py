"""An engine counts its forward steps by kind (engine.step_counts), and a serving node's loop
its time by part (metadata.loop_clock): what a served run is compared with the offline
engine by."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.scheduling.scheduled_batch import ScheduledBatch
from engine.step_counts import StepCounts
from metadata.loop_clock import LOOP_PARTS, LoopClock

GREEDY = dict(temperature=0, ignore_eos=True)


def test_a_batch_is_counted_by_kind():
    counts = StepCounts()
    running = ScheduledBatch([object()], is_prefill=False)  # type: ignore[list-item]
    prompts = ScheduledBatch([object()], is_prefill=True, ends=[3])  # type: ignore[list-item]
    mixed = ScheduledBatch(
        [object()], is_prefill=True, ends=[3], decoding=[object()]  # type: ignore[list-item]
    )
    for batch in (running, running, prompts, mixed):
        counts.count(batch)
    assert counts.as_dict() == {"decode": 2, "prefill": 1, "mixed": 1, "drains": 0}
    assert counts.total == 4


def test_the_loop_clock_charges_each_lap_to_its_part():
    now = [10.0]
    clock = LoopClock(lambda: now[0])
    for part, seconds in (("waiting", 0.5), ("engine", 2.0), ("streams", 0.25), ("engine", 1.0)):
        now[0] += seconds
        clock.lap(part)
    now[0] += 9.0  # the part under way is not counted until its lap
    assert clock.stats() == {"waiting": 0.5, "engine": 3.0, "streams": 0.25, "other": 0.0}
    assert tuple(clock.stats()) == LOOP_PARTS


def test_waves_of_prompts_count_a_prefill_each_and_a_decode_step_a_token(tiny_model_path):
    llm = LLM(str(tiny_model_path), device="cpu", max_num_seqs=4, kv_cache_tokens=2048)
    llm.generate([[5, 6, 7]] * 6, SamplingParams(max_tokens=5, **GREEDY))
    # Four prompts, four decode steps for their tokens 2 to 5; then the other two, the same.
    assert llm.engine.step_counts().as_dict() == {
        "decode": 8,
        "prefill": 2,
        "mixed": 0,
        "drains": 0,
    }


def test_a_prompt_admitted_beside_running_requests_is_a_mixed_step(tiny_model_path):
    llm = LLM(str(tiny_model_path), device="cpu", max_num_seqs=2, kv_cache_tokens=2048)
    # The short request ends first: the third prompt takes its seat while the long one runs.
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (3, 12, 4)]
    llm.generate([[5, 6, 7], [8, 9, 10], [11, 12, 13]], params)
    counts = llm.engine.step_counts()
    assert counts.prefill == 1 and counts.mixed == 1
    # Every step after the first prefill gives the long request one more token.
    assert counts.total == 12


@pytest.mark.parametrize("overlap", [False, True])
def test_overlapped_steps_count_as_decode_steps_and_each_drain_is_counted(
    tiny_model_path, overlap
):
    llm = LLM(
        str(tiny_model_path),
        device="cpu",
        max_num_seqs=2,
        kv_cache_tokens=2048,
        overlap_schedule=overlap,
    )
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (3, 12, 4)]
    llm.generate([[5, 6, 7], [8, 9, 10], [11, 12, 13]], params)
    counts = llm.engine.step_counts()
    assert counts.total == 12
    assert counts.decode == 10 and counts.prefill == 1 and counts.mixed == 1
    # With overlap, the step in flight is drained before the mixed step admits the prompt.
    assert (counts.drains > 0) == overlap
    if overlap:
        assert llm.engine.overlap is not None and llm.engine.overlap.num_overlapped_steps > 0
