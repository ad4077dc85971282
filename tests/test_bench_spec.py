"""bench/spec.py on the CPU with the default model and the shipped draft: a pass runs its
requests in waves of the batch size, or, with --continuous, submits them all at once to
engines that keep at most that many running; in both, greedy speculative output equals plain
decoding's."""

from __future__ import annotations

import pytest

from bench import spec as spec_bench
from engine.loading.default_model import default_model_path
from engine.loading.loader import EngineArgs, resolve
from spec.draft_model import MultiLayerEagleDraft, save_draft

ARGS = ["--prompts", "3", "--requests", "5", "--batch-sizes", "2", "--max-tokens", "6",
        "--repeats", "1", "--no-write"]  # fmt: skip


@pytest.mark.parametrize("continuous", [False, True])
def test_a_pass_submits_waves_or_every_request_at_once(monkeypatch, capsys, continuous) -> None:
    calls: list[tuple[int, int]] = []  # (the engine's max_num_seqs, prompts in the call)
    generate = spec_bench.LLM.generate

    def recording(llm, prompts, *args, **kwargs):
        calls.append((llm.config.max_num_seqs, len(prompts)))
        return generate(llm, prompts, *args, **kwargs)

    monkeypatch.setattr(spec_bench.LLM, "generate", recording)
    spec_bench.main(ARGS + (["--continuous"] if continuous else []))
    # Each of the two engines: a warm-up of one batch, then the pass.
    per_engine = [(2, 2), (2, 5)] if continuous else [(2, 2), (2, 2), (2, 2), (2, 1)]
    assert calls == per_engine * 2
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.startswith("| 2 | 1 chain |") and row.endswith("| yes |")


def test_several_drafts_are_compared_side_by_side(monkeypatch, capsys, tmp_path) -> None:
    # The shipped draft, named with the default model given as a folder, and a two-depth
    # draft, which runs its own two depths: no --num-draft-steps.
    model = default_model_path()
    two_depths = tmp_path / "two-depths"
    config = resolve(EngineArgs(model=str(model), device="cpu")).model_config
    save_draft(two_depths, MultiLayerEagleDraft(config, 2), model.name)
    engines: list[int] = []  # the engine of each wave, warm-ups left out
    generate = spec_bench.LLM.generate

    def recording(llm, prompts, params, *args, **kwargs):
        if isinstance(params, list):
            engines.append(id(llm))
        return generate(llm, prompts, params, *args, **kwargs)

    monkeypatch.setattr(spec_bench.LLM, "generate", recording)
    drafts = ["--model", str(model), "--draft-model", "shipped", str(two_depths)]
    spec_bench.main(ARGS + ["--repeats", "2"] + drafts)
    # Plain, then one engine per draft, alternating pass by pass: three waves a pass.
    passes = [tuple(engines[i : i + 3]) for i in range(0, len(engines), 3)]
    assert len(passes) == 6 and len(set(passes)) == 3
    assert passes[:3] == passes[3:]
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-4].startswith("| batch | draft | drafts |")
    shipped, two = (line.split(" | ") for line in lines[-2:])
    assert shipped[1:3] == ["the shipped default draft", "1 chain"]
    assert two[1:3] == [str(two_depths), "1 chain"]
    # Acceptance per draft position: one figure a depth.
    assert (len(shipped[-2].split(", ")), len(two[-2].split(", "))) == (3, 2)
    assert shipped[-1] == two[-1] == "yes |"


def test_the_section_names_each_draft_and_its_depths() -> None:
    rows = [
        {"draft": "a", "num_draft_steps": 3},
        {"draft": "a", "num_draft_steps": 3},
        {"draft": "b", "num_draft_steps": 4},
    ]
    assert spec_bench._drafts(rows) == "K = 3 draft steps from a; K = 4 draft steps from b"


def test_numbers_of_draft_steps_are_compared_side_by_side(capsys) -> None:
    # The shipped draft has three depths: a fourth step runs the third again.
    spec_bench.main(ARGS + ["--num-draft-steps", "2", "4"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-4].startswith("| batch | draft | drafts |")
    two, four = (line.split(" | ") for line in lines[-2:])
    assert two[1:3] == ["the shipped default draft, 2 steps", "1 chain"]
    assert four[1:3] == ["the shipped default draft, 4 steps", "1 chain"]
    assert (len(two[-2].split(", ")), len(four[-2].split(", "))) == (2, 4)
    assert two[-1] == four[-1] == "yes |"


def test_the_draft_vocabularies_are_compared_side_by_side(capsys) -> None:
    spec_bench.main(ARGS + ["--draft-vocab", "draft", "full"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-4].startswith("| batch | draft | drafts |")
    own, whole = (line.split(" | ") for line in lines[-2:])
    assert own[1] == "the shipped default draft, 8,192-token vocabulary"
    assert whole[1] == "the shipped default draft, whole vocabulary"
    assert own[-1] == whole[-1] == "yes |"


def test_a_draft_without_a_vocabulary_is_named_so(capsys) -> None:
    spec_bench.main(ARGS + ["--draft-model", "random", "--draft-vocab", "draft", "full"])
    lines = capsys.readouterr().out.strip().splitlines()
    asked_own, whole = (line.split(" | ")[1] for line in lines[-2:])
    assert asked_own == "a random (untrained) draft, whole vocabulary (it ships none)"
    assert whole == "a random (untrained) draft, whole vocabulary"


def test_the_round_plans_are_compared_side_by_side(capsys) -> None:
    spec_bench.main(ARGS + ["--speculative-plan", "always", "adaptive"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert "| rounds |" in lines[-4]
    always, adaptive = (line.split(" | ") for line in lines[-2:])
    assert always[1] == "the shipped default draft, always plan"
    assert adaptive[1] == "the shipped default draft, adaptive plan"
    # Rounds: a share of decode steps, between none and all.
    assert all(0 <= int(row[-5].rstrip("%")) <= 100 for row in (always, adaptive))
    # The costs the engine measured: a round at every step measures no plain step.
    assert always[-4].startswith("- / ")
    assert all(float(ms) > 0 for ms in always[-4].split(" / ")[1:])
    assert always[-1] == adaptive[-1] == "yes |"


def test_given_costs_replace_what_adaptive_engines_measure(monkeypatch, capsys) -> None:
    """--given-costs: the adaptive engine weighs another device's costs (here a round at 1.5
    plain steps) at every batch size, and its row says so; the always engine is untouched."""
    built = []
    build = spec_bench.build_engines

    def recording(*args, **kwargs):
        plain, speculative, names = build(*args, **kwargs)
        built.extend(zip(speculative, names))
        return plain, speculative, names

    monkeypatch.setattr(spec_bench, "build_engines", recording)
    plans = ["--speculative-plan", "always", "adaptive", "--given-costs", "2", "3"]
    spec_bench.main(ARGS + plans)
    (always, always_name), (adaptive, adaptive_name) = built
    assert adaptive.engine.speculator.costs.measured(64) == (0.002, 0.003)
    assert always.engine.speculator.costs.measured(64) == (None, None)
    assert adaptive_name.endswith("adaptive plan, given costs 2 / 3 ms")
    assert "given costs" not in always_name
    assert "given costs 2 / 3 ms" in capsys.readouterr().out
