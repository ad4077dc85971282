"""bench/spec.py on the CPU with the default model and the shipped draft: a pass runs its
requests in waves of the batch size, or, with --continuous, submits them all at once to
engines that keep at most that many running; in both, greedy speculative output equals plain
decoding's."""

from __future__ import annotations

import pytest

from bench import spec as spec_bench

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
