"""Offline throughput: engine.LLM against transformers' generate, same model, prompts and length.

    python bench/offline.py [--model PATH] [--device cpu] [--max-tokens 64] [--batch-sizes 1 16]

Prints a table and rewrites the "Offline engine" section of docs/BENCHMARKS.md (raw figures in
docs/bench/offline.json). Both sides generate exactly --max-tokens tokens per request (EOS
ignored) from the same chat prompts, greedy, in one process with the same allocator settings
(engine.cpu_tuning, as `pdcluster` applies them); each is warmed up once, then timed --repeats
times, alternating, and the median is reported."""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import write_section  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.cpu_tuning import keep_large_allocations_in_heap  # noqa: E402

CHATS = [
    "Tell me a story about a lighthouse keeper.",
    "Explain how vaccines work.",
    "Write a poem about the moon.",
    "What should I pack for a week of hiking?",
    "Describe the water cycle.",
    "Why do cats purr?",
    "How does a bicycle stay upright?",
    "Give me ideas for a birthday party.",
    "What is machine learning?",
    "Summarize the history of the printing press.",
    "How do I make bread at home?",
    "What causes earthquakes?",
    "Write a letter to a future self.",
    "Compare tea and coffee.",
    "What is the meaning of friendship?",
    "How do planes fly?",
]


def time_engine(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    assert all(len(o.token_ids) == max_tokens for o in outputs)
    return len(prompts) * max_tokens / elapsed


def time_transformers(hf, pad_id: int, prompts: list[list[int]], max_tokens: int) -> float:
    width = max(map(len, prompts))
    # Left padding, as batched generation with a decoder-only model requires.
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device)
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=pad_id, eos_token_id=None)
    with torch.no_grad():
        _sync(hf.device)
        started = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kwargs)
        _sync(hf.device)
        elapsed = time.perf_counter() - started
    assert out.shape[1] == width + max_tokens
    return len(prompts) * max_tokens / elapsed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only, leave docs/ alone")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    keep_large_allocations_in_heap()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=max(args.batch_sizes))
    hf = AutoModelForCausalLM.from_pretrained(llm.model_path, dtype=llm.config.dtype).to(
        args.device
    )
    hf.eval()
    pad_id = llm.tokenizer.pad_token_id or 0
    chats = [llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]

    rows = []
    for batch in args.batch_sizes:
        prompts = [chats[i % len(chats)] for i in range(batch)]
        # Warm-ups, then alternating timed runs, so drift on a shared host hits both sides.
        time_engine(llm, prompts, 4)
        time_transformers(hf, pad_id, prompts, 4)
        runs = [
            (
                time_engine(llm, prompts, args.max_tokens),
                time_transformers(hf, pad_id, prompts, args.max_tokens),
            )
            for _ in range(args.repeats)
        ]
        ours = statistics.median(r[0] for r in runs)
        theirs = statistics.median(r[1] for r in runs)
        rows.append(
            {
                "batch": batch,
                "engine_tok_s": ours,
                "transformers_tok_s": theirs,
                "speedup": ours / theirs,
            }
        )

    header = "| batch | engine.LLM tokens/s | transformers generate tokens/s | speedup |"
    lines = [header, "| ---: | ---: | ---: | ---: |"]
    lines += [
        f"| {r['batch']} | {r['engine_tok_s']:.1f} | {r['transformers_tok_s']:.1f} | "
        f"{r['speedup']:.2f}x |"
        for r in rows
    ]
    table = "\n".join(lines)
    print(table)
    if args.no_write:
        return
    setup = {
        "command": "python bench/offline.py " + " ".join(sys.argv[1:]),
        "model": str(llm.model_path.name),
        "device": args.device,
        "dtype": str(llm.config.dtype),
        "max_tokens": args.max_tokens,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
    }
    body = (
        f"Command: `{setup['command'].strip()}` ({setup['model']}, {setup['device']}, "
        f"{setup['dtype']}, {args.max_tokens} new tokens per request, greedy, EOS ignored, "
        f"torch {torch.__version__}, {setup['threads']} CPU threads, median of "
        f"{args.repeats} runs per side).\n\n{table}\n"
    )
    write_section("Offline engine", body, {"setup": setup, "rows": rows}, "offline.json")


if __name__ == "__main__":
    main()
