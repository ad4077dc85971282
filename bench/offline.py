"""Offline throughput: engine.LLM against transformers' generate, same model, prompts and length;
or, with --admission, the engine given many prompts at once against waves of them, with mixed
steps (a prompt's prefill in the running requests' decode step) and without.

    python bench/offline.py [--model PATH] [--device cpu] [--max-tokens 64] [--batch-sizes 1 16]

Prints a table and rewrites the "Offline engine" section of docs/BENCHMARKS.md (raw figures in
docs/bench/offline.json). Both sides generate exactly --max-tokens tokens per request (EOS
ignored) from the same chat prompts, greedy, in one process with the same allocator settings
(engine.cpu_tuning, as `pdcluster` applies them); each is warmed up once, then timed --repeats
times, alternating, and the median is reported.

    python bench/offline.py --admission [--random-model smollm2 | --model PATH] [--device cpu]
        [--num-prompts 256] [--prompt-len 128] [--max-tokens 256] [--wave-size 64]
        [--max-num-seqs N] [--ignore-eos-length-spread S]

--num-prompts prompts of --prompt-len random tokens, greedy, EOS ignored, each answer
--max-tokens long (or, with a spread S, from max-tokens - S to max-tokens, so that requests end
at different steps and prompts are admitted while others run). Two engines (mixed_prefill on
and off, otherwise alike: max_num_seqs --max-num-seqs, by default --num-prompts) each run the
prompts given all at once and in waves of --wave-size (each finished before the next starts),
warmed up once, then timed --repeats times, alternating, the median reported: output tokens/s,
forwards per run and how many were mixed. Prints a table and writes
bench/results/offline_admission.json (not with --no-write)."""

from __future__ import annotations

import argparse
import json
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

from bench.report import device_description, write_section  # noqa: E402
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


# --- --admission: all prompts at once against waves, mixed steps on and off ---


def admission_params(args: argparse.Namespace) -> list[SamplingParams]:
    """Greedy, EOS ignored; answer lengths spread over the last `spread` tokens below
    max_tokens, request by request (the same for every run)."""
    spread = args.ignore_eos_length_spread
    return [
        SamplingParams(max_tokens=args.max_tokens - i % (spread + 1), temperature=0,
                       ignore_eos=True)
        for i in range(args.num_prompts)
    ]  # fmt: skip


def time_admission(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams], wave: int
) -> tuple[float, int, int]:
    """(output tokens/s, forwards, mixed forwards) of generating `prompts` in waves of `wave`
    (the engine's own step counts, engine.step_counts)."""
    before = llm.engine.step_counts()
    _sync(torch.device(llm.config.device))
    started = time.perf_counter()
    tokens = 0
    for start in range(0, len(prompts), wave):
        outputs = llm.generate(prompts[start : start + wave], params[start : start + wave])
        tokens += sum(len(o.token_ids) for o in outputs)
    elapsed = time.perf_counter() - started
    after = llm.engine.step_counts()
    return tokens / elapsed, after.total - before.total, after.mixed - before.mixed


def admission_model(args: argparse.Namespace, scratch: Path) -> str | None:
    if args.random_model is None:
        return args.model
    from bench.random_models import random_model

    folder = scratch / args.random_model
    random_model(args.random_model, folder, args.device)
    return str(folder)


def run_admission(args: argparse.Namespace) -> None:
    keep_large_allocations_in_heap()
    with tempfile.TemporaryDirectory() as scratch:
        model = admission_model(args, Path(scratch))
        seats = args.max_num_seqs or args.num_prompts
        engine_kw = dict(
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=seats,
            max_model_len=args.prompt_len + args.max_tokens + 8,
            kv_cache_tokens=min(seats, args.num_prompts) * (args.prompt_len + args.max_tokens + 8),
        )
        engines = {mixed: LLM(model, mixed_prefill=mixed, **engine_kw) for mixed in (True, False)}
        config = engines[True].config
        vocab = engines[True].model_config.vocab_size
        rng = random.Random(0)
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)]
                   for _ in range(args.num_prompts)]  # fmt: skip
        params = admission_params(args)
        schedules = {"all at once": args.num_prompts, f"waves of {args.wave_size}": args.wave_size}
        for llm in engines.values():  # warm-up: kernels compiled for every shape
            for wave in schedules.values():
                time_admission(llm, prompts, params, wave)
        runs: dict[tuple[str, bool], list[tuple[float, int, int]]] = {}
        for _ in range(args.repeats):
            for name, wave in schedules.items():
                for mixed, llm in engines.items():
                    runs.setdefault((name, mixed), []).append(
                        time_admission(llm, prompts, params, wave)
                    )
    rows = [
        {
            "schedule": name,
            "mixed_prefill": mixed,
            "tok_s": statistics.median(r[0] for r in result),
            "forwards": statistics.median(r[1] for r in result),
            "mixed_forwards": statistics.median(r[2] for r in result),
        }
        for (name, mixed), result in runs.items()
    ]
    lines = [
        "| prompts given | mixed steps | output tokens/s | forwards | of them mixed |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r['schedule']} | {'on' if r['mixed_prefill'] else 'off'} | {r['tok_s']:,.0f} | "
        f"{r['forwards']:.0f} | {r['mixed_forwards']:.0f} |"
        for r in rows
    ]
    setup = {
        "command": "python bench/offline.py " + " ".join(sys.argv[1:]),
        "model": args.random_model or args.model or "default",
        "device": device_description(args.device),
        "dtype": str(config.dtype),
        "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "max_num_seqs": seats,
        "overlap_schedule": config.overlap_schedule,
        "chunked_prefill_size": config.chunked_prefill_size,
        "max_prefill_tokens": config.max_prefill_tokens,
        "cuda_graph_max_bs": config.cuda_graph_max_bs,
        "cuda_graph_max_prefill_tokens": config.cuda_graph_max_prefill_tokens,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "repeats": args.repeats,
    }
    print(", ".join(f"{k}={v}" for k, v in setup.items()))
    print("\n".join(lines))
    if not args.no_write:
        out = ROOT / "bench" / "results" / "offline_admission.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"setup": setup, "rows": rows}, indent=2) + "\n")
        print(f"wrote {out.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only, leave docs/ alone")
    parser.add_argument(
        "--admission",
        action="store_true",
        help="all prompts at once against waves, mixed steps on and off (no transformers)",
    )
    parser.add_argument(
        "--random-model",
        choices=["smollm2", "llama8b", "tiny"],
        default=None,
        help="--admission: random weights of this shape (bench/random_models.py)",
    )
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--wave-size", type=int, default=64)
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="--admission: the engines' max_num_seqs (default: --num-prompts)",
    )
    parser.add_argument(
        "--ignore-eos-length-spread",
        type=int,
        default=0,
        metavar="S",
        help="--admission: answers of max-tokens - S to max-tokens tokens",
    )
    args = parser.parse_args()
    if args.admission:
        run_admission(args)
        return

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
