"""Where a batch's time goes, plain decoding against speculative: the engine's steps by kind and
by batch size, and the host's time by phase of a speculative round.

    python bench/spec_phases.py [--device cuda] [--model PATH] [--draft-model PATH]
        [--batch-size 64] [--prompts 57] [--max-tokens 128] [--repeats 2]

Runs the held-out chat prompts (stopping at EOS) in groups of --batch-size, through a plain
engine and then a speculative one, --repeats times each after a warm-up, with timers around
the engine's calls: each step (by kind: prefill, or decode by how many requests it ran), and
in the speculative engine the scheduler, the verify, committing, the round's finish, the draft
extend's launch and every wait for a copy from the device. A batch's steps are set by its
slowest request: speculation's rounds by the request that accepts least. Without --model it
uses the default model and the shipped draft. The timers cost the host a little; compare their
figures with each other. Prints tables only; writes nothing."""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import engine.executor.host_copy as host_copy  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


class Timers:
    """Seconds and calls per name, over what `wrap` wraps."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner: object, attribute: str, name: str) -> Callable:
        """Time `owner.attribute` under `name` from now on; returns what it was."""
        inner = getattr(owner, attribute)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started
                self.calls[name] += 1

        setattr(owner, attribute, timed)
        return inner

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def step_kinds(llm: LLM) -> list[tuple[str, float]]:
    """Records (kind, seconds) of every engine step from now on: 'prefill', 'decode N' (N: the
    requests it ran, rounded up to a power of two), or 'other' (a step that ran no batch)."""
    engine = llm.engine
    record: list[tuple[str, float]] = []
    run, step = engine._run, engine.step
    kind: list[str] = []

    def timed_run(batch):
        n = len(batch.requests)
        kind.append("prefill" if batch.is_prefill else f"decode {1 << (n - 1).bit_length()}")
        return run(batch)

    def timed_step():
        kind.clear()
        started = time.perf_counter()
        finished = step()
        record.append((kind[0] if kind else "other", time.perf_counter() - started))
        return finished

    engine._run, engine.step = timed_run, timed_step
    return record


def speculative_phases(llm: LLM, timers: Timers) -> None:
    engine = llm.engine
    worker = engine.speculator
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.scheduler, "process_tokens", "commit (process_tokens)")
    timers.wrap(worker, "verify", "verify (with waits)")
    timers.wrap(worker, "finish_round", "finish_round (with waits)")
    timers.wrap(worker.fixed_extend, "launch", "draft extend launch")


def run_batches(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    started, tokens = time.perf_counter(), 0
    for first in range(0, len(prompts), batch):
        outputs = llm.generate(prompts[first : first + batch], params)
        tokens += sum(len(o.token_ids) for o in outputs)
    return time.perf_counter() - started, tokens


def report(name: str, wall: float, tokens: int, steps: list[tuple[str, float]]) -> None:
    by_kind: dict[str, list[float]] = defaultdict(list)
    for kind, seconds in steps:
        by_kind[kind].append(seconds)
    print(f"\n{name}: {wall * 1e3:.1f} ms, {tokens} tokens, {tokens / wall:.0f} tokens/s")
    print("| step | steps | total ms | ms a step |")
    print("| :--- | ---: | ---: | ---: |")
    order = sorted(by_kind, key=lambda k: (k != "prefill", int(k.split()[-1]) if " " in k else 0))
    for kind in order:
        total, count = sum(by_kind[kind]), len(by_kind[kind])
        print(f"| {kind} | {count} | {total * 1e3:.1f} | {total / count * 1e3:.3f} |")


def report_phases(timers: Timers, rounds: int) -> None:
    print(f"\nhost time by phase, a speculative round ({rounds} rounds):")
    print("| phase | calls a round | ms a round |")
    print("| :--- | ---: | ---: |")
    for name, seconds in sorted(timers.seconds.items(), key=lambda item: -item[1]):
        print(f"| {name} | {timers.calls[name] / rounds:.2f} | {seconds / rounds * 1e3:.3f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None)
    parser.add_argument("--draft-model", default=None, help="default: the shipped draft")
    parser.add_argument("--num-draft-steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=57, help="held-out conversations used")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)

    from spec.default_draft import default_draft_path
    from spec.train.prompts import heldout_prompts

    draft = args.draft_model or default_draft_path()
    if draft is None:
        parser.error("--draft-model is needed: no shipped draft is installed")
    common = {"device": args.device, "max_num_seqs": args.batch_size}
    spec = {
        "speculative_algorithm": "multi-layer-eagle",
        "draft_model": str(draft),
        "num_draft_steps": args.num_draft_steps,
        # The phases of a round are what it times: a round at every step.
        "speculative_plan": "always",
    }
    for name, options in (("plain", {}), ("speculative", spec)):
        llm = LLM(args.model, **common, **options)
        prompts = [llm.apply_chat_template(c) for c in heldout_prompts()[: args.prompts]]
        warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        llm.generate(prompts[: args.batch_size], warm)
        steps = step_kinds(llm)
        timers = Timers()
        wait = host_copy.HostCopy.wait
        if options:
            speculative_phases(llm, timers)
            timers.wrap(host_copy.HostCopy, "wait", "wait for a copy from the device")
        try:
            for repeat in range(args.repeats):
                steps.clear()
                timers.clear()
                wall, tokens = run_batches(llm, prompts, args.batch_size, args.max_tokens)
                report(f"{name}, pass {repeat + 1}", wall, tokens, steps)
                rounds = timers.calls.get("verify (with waits)", 0)
                if rounds:
                    report_phases(timers, rounds)
        finally:
            host_copy.HostCopy.wait = wait
        del llm


if __name__ == "__main__":
    main()
