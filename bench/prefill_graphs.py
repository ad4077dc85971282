"""Prefill with and without CUDA graphs: the time to a request's first token, in one process.

    python bench/prefill_graphs.py [--model PATH] [--prompt-lens 16 64 256 512]
        [--batch-sizes 1 4] [--repeats 20] [--no-write]

For each prompt length and batch size, the engine generates one token for `batch` prompts of
that many pseudo-random tokens (a prefill step and its sampling), eagerly
(cuda_graph_max_prefill_tokens=0) and replaying a prefill graph (the default, 512), median
milliseconds of --repeats after a warm-up. The same engine settings otherwise (decode graphs,
bfloat16). Without --model: the embedded default model. Prints a table and writes the section
"Prefill with CUDA graphs" of docs/BENCHMARKS.md (raw figures in docs/bench/prefill_graphs.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import device_description, write_section  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def first_token_ms(llm: LLM, prompts: list[list[int]], repeats: int) -> float:
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[16, 64, 256, 512])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/prefill_graphs.py needs a CUDA GPU")
    max_batch = max(args.batch_sizes)
    max_tokens = max(args.prompt_lens) * max_batch
    common = dict(
        device="cuda",
        max_num_seqs=max_batch,
        max_model_len=max(args.prompt_lens) + 16,
        kv_cache_tokens=max_tokens + 64 * max_batch,
        max_prefill_tokens=max(max_tokens, 8192),
    )
    engines = {
        "eager": LLM(args.model, cuda_graph_max_prefill_tokens=0, **common),
        "graphs": LLM(args.model, **common),
    }
    limit = engines["graphs"].config.cuda_graph_max_prefill_tokens
    generator = torch.Generator().manual_seed(0)
    vocab = engines["eager"].model_config.vocab_size
    rows = []
    for length in args.prompt_lens:
        for batch in args.batch_sizes:
            prompts = torch.randint(3, vocab, (batch, length), generator=generator).tolist()
            row = {"prompt_tokens": length, "batch": batch}
            for name, llm in engines.items():
                row[name] = first_token_ms(llm, prompts, args.repeats)
            row["graphed"] = length * batch <= limit
            rows.append(row)
            print(row, flush=True)
    header = ["prompt tokens", "batch", "eager ms", "graphs ms", "speedup", "in a graph"]
    table = [
        [r["prompt_tokens"], r["batch"], f"{r['eager']:.2f}", f"{r['graphs']:.2f}",
         f"{r['eager'] / r['graphs']:.2f}x", "yes" if r["graphed"] else "no (too long)"]
        for r in rows
    ]  # fmt: skip
    md = ["| " + " | ".join(header) + " |", "|" + " ---: |" * len(header)]
    md += ["| " + " | ".join(map(str, r)) + " |" for r in table]
    print("\n".join(md))
    if args.no_write:
        return
    command = "python bench/prefill_graphs.py " + " ".join(sys.argv[1:])
    body = (
        f"Command: `{command.strip()}` ({device_description('cuda')}, "
        f"{'the default model' if args.model is None else 'the model given'}; prefill graphs up to "
        f"{limit} tokens).\n\n"
        "Milliseconds to generate one token for `batch` prompts of that many pseudo-random "
        f"tokens (one prefill step and its sampling), median of {args.repeats} after a "
        "warm-up; eager prefill against a prefill replayed from a CUDA graph, same engine "
        "settings otherwise.\n\n" + "\n".join(md) + "\n"
    )
    write_section("Prefill with CUDA graphs", body, {"args": vars(args), "rows": rows},
                  "prefill_graphs.json")  # fmt: skip


if __name__ == "__main__":
    main()
