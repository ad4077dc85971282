"""Tensor parallelism on this host's CPU: output tokens/s of LLM(tensor_parallel_size=N) for
each N given, same model, prompts and length (greedy, EOS ignored, float32).

    python bench/tensor_parallel.py [--model PATH | --random-model smollm2-8h] [--ranks 1 3]
        [--batch-sizes 1 8] [--prompt-len 64] [--max-tokens 32] [--repeats 3] [--threads T]

By default the embedded model (SmolLM2-135M: 9 query heads and 3 KV heads, so 3 ranks and not
2); `--random-model smollm2-8h` is its shape with 8 and 2 heads (bench/random_models.py), which 2
ranks split. Every engine is built and kept, warmed up once per batch size, then the engines are
timed in turns, --repeats runs each, the median reported (a host shared with other work slows
them alike). Rank 0 is this process (--threads: its torch threads; on a host shared with other
work, 1 keeps each forward's parallel regions from waiting on descheduled threads); every other
rank takes cpu_count / N threads (engine/tensor_parallel/follower.py). Prints a table and writes
bench/results/tensor_parallel_<model>.json (not with --no-write)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import LLM, SamplingParams  # noqa: E402
from engine.cpu_tuning import keep_large_allocations_in_heap  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def timed_rate(llm: LLM, batch: list[list[int]], params: SamplingParams) -> float:
    """Output tokens/s of one generate call over `batch`."""
    start = time.perf_counter()
    outputs = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    return sum(len(out.token_ids) for out in outputs) / elapsed


def model_folder(args: argparse.Namespace, scratch: Path) -> str | None:
    if args.random_model is None:
        return args.model
    from bench.random_models import random_model

    folder = scratch / args.random_model
    random_model(args.random_model, folder, "cpu")
    return str(folder)


def run(args: argparse.Namespace, model: str | None) -> list[dict]:
    """Every engine is built first and kept, then timed in turns (one run of each per repeat),
    so that a load that changes over time weighs on all of them alike."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engines: dict[int, LLM] = {}
    build_s: dict[int, float] = {}
    try:
        for ranks in args.ranks:
            start = time.perf_counter()
            engines[ranks] = LLM(model, device="cpu", dtype="float32", tensor_parallel_size=ranks)
            build_s[ranks] = time.perf_counter() - start
        rows = []
        for size in args.batch_sizes:
            vocab = engines[args.ranks[0]].model_config.vocab_size
            batch = prompts(size, args.prompt_len, vocab, seed=size)
            rates: dict[int, list[float]] = {ranks: [] for ranks in engines}
            for llm in engines.values():
                llm.generate(batch, params)  # warm-up
            for _ in range(args.repeats):
                for ranks, llm in engines.items():
                    rates[ranks].append(timed_rate(llm, batch, params))
            for ranks, measured in rates.items():
                rate = statistics.median(measured)
                rows.append(
                    dict(
                        ranks=ranks,
                        batch_size=size,
                        tokens_per_s=rate,
                        runs=measured,
                        build_s=build_s[ranks],
                    )
                )
                print(f"ranks {ranks} batch {size}: {rate:.1f} tokens/s", flush=True)
        return rows
    finally:
        for llm in engines.values():
            llm.close()


def table(rows: list[dict]) -> str:
    base = {r["batch_size"]: r["tokens_per_s"] for r in rows if r["ranks"] == 1}
    lines = ["| ranks | batch | output tokens/s | vs 1 rank | start-up s |"]
    lines.append("|---|---|---|---|---|")
    for r in rows:
        ratio = r["tokens_per_s"] / base[r["batch_size"]] if r["batch_size"] in base else None
        shown = "" if ratio is None else f"{ratio:.2f}x"
        lines.append(
            f"| {r['ranks']} | {r['batch_size']} | {r['tokens_per_s']:.1f} | {shown} "
            f"| {r['build_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a HF folder (default: the embedded model)")
    parser.add_argument("--random-model", default=None, help="a shape of bench/random_models.py")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="rank 0's torch threads (default: torch's)"
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    keep_large_allocations_in_heap()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        rows = run(args, model_folder(args, Path(scratch)))
    print(table(rows))
    if not args.no_write:
        name = args.random_model or ("default" if args.model is None else Path(args.model).name)
        path = RESULTS / f"tensor_parallel_{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        report = dict(
            model=args.random_model or args.model or "default (SmolLM2-135M-Instruct)",
            host=dict(cpus=os.cpu_count(), machine=platform.machine(), torch=torch.__version__),
            load_average=os.getloadavg(),
            args={k: v for k, v in vars(args).items() if k != "no_write"},
            rows=rows,
        )
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
