"""bench/spec_phases.py on the CPU with the default model and the shipped draft: its tables
agree with each other (every speculative round is a decode step, every decode step a round)
and the methods it times are its own again afterwards."""

from __future__ import annotations

import re

import engine.executor.host_copy as host_copy
from bench import spec_phases


def test_the_phase_tables_count_every_round_once(capsys) -> None:
    wait = host_copy.HostCopy.wait
    args = ["--prompts", "3", "--batch-size", "2", "--max-tokens", "12", "--repeats", "1"]
    spec_phases.main(args)
    assert host_copy.HostCopy.wait is wait
    out = capsys.readouterr().out
    plain, speculative = out.split("\nspeculative, pass 1:")

    def steps(table: str, kind: str) -> int:
        return sum(int(n) for n in re.findall(rf"^\| {kind} \| (\d+) \|", table, re.M))

    rounds = int(re.search(r"a speculative round \((\d+) rounds\)", speculative).group(1))
    assert steps(speculative, r"decode \d+") == rounds > 0
    assert steps(plain, "prefill") == steps(speculative, "prefill") == 2
    # The shipped draft accepts some drafts on held-out prompts (greedy, float32: the same
    # every run), so the speculative engine takes fewer decode steps than the plain one.
    assert rounds < steps(plain, r"decode \d+") + steps(plain, "other")
