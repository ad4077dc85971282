"""Per-request speculative statistics: verify steps, accepted and rejected draft tokens, accept
length and the per-position acceptance counts, and how `usage` reports them."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_drafts import make_good_draft, make_predictable_llama, make_random_draft

from engine import LLM, SamplingParams

K = 4
PROMPTS = [[1, 17, 99, 4, 250, 31, 8], [1, 200], list(range(3, 40)), [5] * 23, [7]]
PARAMS = SamplingParams(max_tokens=25, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("spec_stats")
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "good", root / "target", K, noise=0.01)
    make_random_draft(root / "random", root / "target", K, seed=1)
    return {"good": (root / "target", root / "good"), "random": (root / "target", root / "random")}


def _run(folders: tuple[Path, Path]):
    target, draft = folders
    llm = LLM(
        str(target),
        device="cpu",
        kv_cache_tokens=2048,
        max_num_seqs=8,
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(draft),
    )
    engine = llm.engine
    requests = [engine.make_request(str(i), p, PARAMS) for i, p in enumerate(PROMPTS)]
    for req in requests:
        engine.add_request(req)
    while engine.has_work():
        engine.step()
    return [(req.spec_stats, engine.output(req)) for req in requests]


@pytest.mark.parametrize("kind", ["good", "random"])
def test_counts_are_consistent(folders, kind: str) -> None:
    for stats, out in _run(folders[kind]):
        usage = out.usage
        details = usage.completion_tokens_details
        # Every token but the prefill's came from a verify step, except the last one when it
        # was all that max_tokens left: a step with no room for drafts is a plain decode.
        assert usage.completion_tokens - 1 - stats.emitted_tokens in (0, 1)
        assert stats.accepted_tokens + stats.verify_steps == stats.emitted_tokens
        assert details.accepted_prediction_tokens == stats.accepted_tokens
        assert details.rejected_prediction_tokens == stats.proposed_tokens - stats.accepted_tokens
        assert usage.spec_verify_steps == stats.verify_steps
        assert usage.spec_accept_length == pytest.approx(stats.emitted_tokens / stats.verify_steps)
        # Draft j+1 is accepted only after draft j was: the counts never rise with position.
        per_position = stats.accepted_per_position
        assert len(per_position) == K
        assert all(a >= b for a, b in zip(per_position, per_position[1:]))
        assert sum(per_position) == stats.accepted_tokens
        assert per_position[0] <= stats.verify_steps
        # The chain is shorter only where max_tokens leaves no room for it.
        assert stats.verify_steps * K - 6 <= stats.proposed_tokens <= stats.verify_steps * K


def test_a_good_draft_commits_several_tokens_per_step(folders) -> None:
    results = _run(folders["good"])
    for stats, out in results:
        assert out.usage.spec_accept_length > 1.8
        assert stats.accepted_per_position[0] > stats.verify_steps / 2


def test_a_random_draft_commits_about_one_token_per_step(folders) -> None:
    results = _run(folders["random"])
    assert sum(out.usage.spec_accept_length for _, out in results) / len(results) < 1.3


def test_plain_engine_reports_no_speculation(folders) -> None:
    target, _ = folders["good"]
    out = LLM(str(target), device="cpu", kv_cache_tokens=256).generate(PROMPTS[0], PARAMS)[0]
    assert out.usage.completion_tokens_details is None
    assert out.usage.spec_verify_steps is None
    assert out.usage.total_tokens == len(PROMPTS[0]) + 25
