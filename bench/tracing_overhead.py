"""What per-request tracing costs a decode step when it is off, and when it is on.

    python bench/tracing_overhead.py [--batch-sizes 1 16] [--max-tokens 64] [--repeats 15]

Two measurements:

1. The calls alone: one `set_time_batch` (or `set_correct_drafts`) with tracing off, on a
   batch of requests whose `trace` is None, timed over a million calls; a speculative decode
   step makes SPEC_STEP_CALLS of them, a plain prefill or decode step two.
2. Whole decode steps of the offline engine, speculating (a one-layer tiny Llama and a draft
   that copies it, from tests/tiny_drafts.py, so a step is short and any overhead shows): the
   engine as built with tracing off, the same engine with tracing on, and a build with no
   tracing calls at all (engine/engine_core.py and engine/speculative_steps.py compiled with
   every stamping line removed), twice, to show how far two runs of one build land apart. The
   variants take turns on one runner and one speculator; medians of `--repeats` runs.

Prints a table and rewrites the "Tracing overhead" section of docs/BENCHMARKS.md (raw figures
in docs/bench/tracing_overhead.json)."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import timeit
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench.report import write_section  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.engine_core import EngineCore  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.tracing import RequestTrace, set_correct_drafts, set_time_batch  # noqa: E402

K = 3
SPEC_STEP_CALLS = 7  # set_time_batch x 6 + set_correct_drafts in SpeculativeSteps.decode
STAMPING = ("set_time_batch(", "set_correct_drafts(", "set_time(", "started, ended = ")


def _untraced(name: str) -> tuple[types.ModuleType, int]:
    """engine/`name`.py compiled with each stamping line made a `pass` (a loop may hold
    nothing else); and how many it had."""
    source = (ROOT / "engine" / f"{name}.py").read_text().splitlines(keepends=True)
    kept, removed = [], 0
    for line in source:
        stripped = line.lstrip()
        if stripped.startswith(STAMPING):
            line, removed = line[: len(line) - len(stripped)] + "pass\n", removed + 1
        kept.append(line)
    module = types.ModuleType(f"{name}_untraced")
    exec(compile("".join(kept), f"{name}_untraced", "exec"), module.__dict__)
    return module, removed


def untraced_engine_class() -> type:
    """EngineCore compiled from engine/engine_core.py and engine/speculative_steps.py without
    a single tracing call."""
    steps, removed = _untraced("speculative_steps")
    # The decode step's, and two around the draft extend for prefill.
    assert removed == SPEC_STEP_CALLS + 2, f"expected the stamping lines, removed {removed}"
    core, removed = _untraced("engine_core")
    assert removed >= 4, f"expected the stamping lines, removed {removed}"
    core.SpeculativeSteps = steps.SpeculativeSteps  # read when an EngineCore is made
    return core.EngineCore


def call_ns(batch: int) -> dict[str, float]:
    """ns per call on a batch of `batch` requests: tracing off (a plain stamp, one with a
    `where`, set_correct_drafts), and tracing on (a stamp with a `where`)."""
    untraced = [Request(str(i), [1, 2], SamplingParams()) for i in range(batch)]
    traced = [Request(str(i), [1, 2], SamplingParams(), trace=RequestTrace()) for i in untraced]

    def where(req: Request) -> bool:
        return True

    def per_call(stamp, calls: int) -> float:
        empty = min(timeit.repeat(lambda: None, number=calls, repeat=3))  # the lambda's own
        return (min(timeit.repeat(stamp, number=calls, repeat=3)) - empty) / calls * 1e9

    off = 1_000_000
    return {
        "off": per_call(lambda: set_time_batch(untraced, "verify_start"), off),
        "off_where": per_call(lambda: set_time_batch(untraced, "verify_end", where=where), off),
        "off_correct": per_call(lambda: set_correct_drafts(untraced), off),
        # Fewer calls: each appends an event to every request.
        "on_where": per_call(lambda: set_time_batch(traced, "verify_end", where=where), 20_000),
    }


def decode_ms_per_step(engine: EngineCore, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.make_request(str(i), prompt, params))
    engine.step()  # the prefill batch
    steps, started = 0, time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
    return (time.perf_counter() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    from tiny_drafts import make_good_draft, make_predictable_llama

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        make_predictable_llama(root / "target", seed=0)
        make_good_draft(root / "draft", root / "target", K, noise=0.01)
        llm = LLM(
            str(root / "target"),
            device="cpu",
            max_num_seqs=max(args.batch_sizes),
            kv_cache_tokens=8192,
            speculative_algorithm="multi-layer-eagle",
            draft_model=str(root / "draft"),
        )
    runner, tokenizer, speculator = llm.engine.runner, llm.tokenizer, llm.engine.speculator
    untraced = untraced_engine_class()
    variants = {
        "no calls": untraced(runner, tokenizer, speculator),
        # The same build again: how far apart two runs of one build land on this machine.
        "no calls again": untraced(runner, tokenizer, speculator),
        "tracing off": EngineCore(runner, tokenizer, speculator),
        "tracing on": EngineCore(runner, tokenizer, speculator, tracing=True),
    }
    prompt_pool = [[1, 17, 99, 4, 250, 31, 8], [1, 200], list(range(3, 40)), [5] * 23]
    rows = []
    for batch in args.batch_sizes:
        prompts = [prompt_pool[i % len(prompt_pool)] for i in range(batch)]
        times: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for round in range(args.repeats + 1):  # the first round warms up
            # Each round in another order, so that none always runs right after another.
            for name in names[round % len(names) :] + names[: round % len(names)]:
                times[name].append(decode_ms_per_step(variants[name], prompts, args.max_tokens))
        median = {name: statistics.median(t[1:]) for name, t in times.items()}
        calls = call_ns(batch)
        rows.append({"batch": batch, "ms_per_step": median, "runs": times, "call_ns": calls})

    lines = [
        "| batch | decode step, no calls | same build again | tracing off | tracing on "
        "| stamps per step, off | stamps per step, on |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ms, ns = r["ms_per_step"], r["call_ns"]
        step_ns = ms["no calls"] * 1e6
        off_ns = (SPEC_STEP_CALLS - 1) * ns["off_where"] + ns["off_correct"]
        on_ns = SPEC_STEP_CALLS * ns["on_where"]
        cells = [str(r["batch"]), f"{ms['no calls']:.3f} ms"]
        cells += [
            f"{ms[name]:.3f} ms ({_change(ms[name], ms['no calls'])})"
            for name in ("no calls again", "tracing off", "tracing on")
        ]
        cells += [f"{t / 1e3:.2f} us ({t / step_ns * 100:.3f} %)" for t in (off_ns, on_ns)]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.no_write:
        return
    command = "python bench/tracing_overhead.py " + " ".join(sys.argv[1:])
    body = (
        f"Command: `{command.strip()}` (CPU, {torch.get_num_threads()} threads; the offline "
        f"engine speculating with K = {K} on a one-layer tiny Llama and a draft that copies it, "
        f"so a step is about a millisecond and any overhead shows; {args.max_tokens} new tokens "
        f"per request, greedy; median ms per decode step of {args.repeats} runs, the builds "
        "taking turns on one runner).\n\n"
        + table
        + "\n\n*No calls* is engine/engine_core.py and engine/speculative_steps.py compiled "
        "with every stamping line removed. "
        "With tracing off each call returns at its first test (`requests[0].trace is None`): "
        f"a speculative decode step makes {SPEC_STEP_CALLS} of them, which *stamps per step, "
        "off* adds up from a million-call loop (in % of the step). That is far below what "
        "separates two runs of one build (*same build again*) on this shared machine, so the "
        "step times of *no calls* and *tracing off* differ by noise only. Tracing on reads the "
        "clock once per stamp and appends an event to each request (*stamps per step, on*, "
        "from the same loop with tracing on). Whole steps move by as much as *same build "
        "again* does, either way (other jobs share the cores): the last two columns are the "
        "cost.\n"
    )
    raw = {"rows": rows, "command": command, "spec_step_calls": SPEC_STEP_CALLS}
    write_section("Tracing overhead", body, raw, "tracing_overhead.json")


def _change(value: float, base: float) -> str:
    return f"{(value - base) / base * 100:+.1f} %"


if __name__ == "__main__":
    main()
