"""Speculative decoding on the offline engine: accept length and tokens/s with and without it,
side by side in one run.

    python bench/spec.py [--device cpu|cuda] [--model PATH] [--draft-model PATH|random]
        [--num-draft-chains 1 3]

Plain decoding and one speculative engine per --num-draft-chains value answer the held-out chat
prompts (spec.train.prompts.heldout_prompts, never used to train the shipped draft), greedy,
stopping at EOS or --max-tokens, and must produce identical tokens. With N chains, each greedy
step verifies N draft chains that start with the first depth's N most likely tokens and keeps
the one accepted furthest. The draft is the shipped default draft for the default model unless
--draft-model names one; `--draft-model random` makes an untrained one, which shows the cost of
speculating and nothing else. Prints a table and rewrites the "Speculative decoding (DEVICE)"
section of docs/BENCHMARKS.md (raw figures in docs/bench/spec_DEVICE.json)."""

from __future__ import annotations

import argparse
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
from engine.request import spec_totals  # noqa: E402
from spec.default_draft import default_draft_path  # noqa: E402
from spec.draft_model import MultiLayerEagleDraft, save_draft  # noqa: E402
from spec.train.prompts import heldout_prompts  # noqa: E402


def random_draft(llm: LLM, num_draft_steps: int, folder: Path) -> Path:
    torch.manual_seed(0)
    save_draft(folder, MultiLayerEagleDraft(llm.model_config, num_draft_steps), llm.model_path.name)
    return folder


def run(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    llm.generate(prompts[:batch], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    outputs, started = [], time.perf_counter()
    for start in range(0, len(prompts), batch):
        outputs += llm.generate(prompts[start : start + batch], params)
    elapsed = time.perf_counter() - started
    emitted = sum(o.usage.completion_tokens for o in outputs)
    totals = spec_totals(o.usage for o in outputs)
    steps = totals.verify_steps
    return {
        "tokens": [o.token_ids for o in outputs],
        "completion_tokens": emitted,
        "tok_s": emitted / elapsed,
        "verify_steps": steps,
        # Tokens per verify step, bonus included (1.0: no draft token was ever accepted).
        "accept_length": totals.accept_length if steps else None,
        "acceptance": [c / steps for c in totals.accepted_per_position] if steps else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None)
    parser.add_argument("--draft-model", default=None, help="a draft folder, or 'random'")
    parser.add_argument("--num-draft-steps", type=int, default=3)
    parser.add_argument(
        "--num-draft-chains",
        type=int,
        nargs="+",
        default=[None],
        help="one speculative engine per value (default: the engine's default for the device)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompts", type=int, default=16, help="held-out conversations used")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    keep_large_allocations_in_heap()
    common = {"device": args.device, "max_num_seqs": max(args.batch_sizes)}
    chain_counts = list(dict.fromkeys(args.num_draft_chains))
    plain = LLM(args.model, **common)
    with tempfile.TemporaryDirectory() as scratch:
        if args.draft_model == "random":
            draft = random_draft(plain, args.num_draft_steps, Path(scratch) / "draft")
            draft_name = "a random (untrained) draft"
        elif args.draft_model is not None:
            draft, draft_name = Path(args.draft_model), args.draft_model
        elif args.model is None and default_draft_path() is not None:
            draft, draft_name = default_draft_path(), "the shipped default draft"
        else:
            sys.exit("bench/spec.py: --draft-model is needed for a model without a shipped draft")
        speculative = [
            LLM(
                args.model,
                **common,
                speculative_algorithm="multi-layer-eagle",
                draft_model=draft,
                num_draft_steps=args.num_draft_steps,
                num_draft_chains=chains,
            )
            for chains in chain_counts
        ]
    conversations = heldout_prompts()[: args.prompts]
    prompts = [plain.apply_chat_template(c) for c in conversations]
    rows = []
    for batch in args.batch_sizes:
        base = run(plain, prompts, batch, args.max_tokens)
        for llm in speculative:
            spec = run(llm, prompts, batch, args.max_tokens)
            rows.append(
                {
                    "batch": batch,
                    "draft_chains": llm.config.num_draft_chains,
                    "plain_tok_s": base["tok_s"],
                    "spec_tok_s": spec["tok_s"],
                    "speedup": spec["tok_s"] / base["tok_s"],
                    "accept_length": spec["accept_length"],
                    "acceptance": spec["acceptance"],
                    "completion_tokens": spec["completion_tokens"],
                    "identical": base["tokens"] == spec["tokens"],
                }
            )
    lines = [
        "| batch | draft chains | plain tokens/s | speculative tokens/s | speedup | accept length "
        "| acceptance per draft position | identical output |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | :--- | :---: |",
    ]
    for r in rows:
        acceptance = ", ".join(f"{a:.2f}" for a in r["acceptance"])
        lines.append(
            f"| {r['batch']} | {r['draft_chains']} | {r['plain_tok_s']:.1f} | "
            f"{r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | {r['accept_length']:.2f} | "
            f"{acceptance} | {'yes' if r['identical'] else 'NO'} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.no_write:
        return
    command = "python bench/spec.py " + " ".join(sys.argv[1:])
    device = torch.device(args.device).type
    where = device_description(args.device)
    body = (
        f"Command: `{command.strip()}` (default model, {where}, K = {args.num_draft_steps} "
        f"draft depths from {draft_name}, the first {len(prompts)} held-out chat prompts, "
        f"greedy, at most {args.max_tokens} new tokens, stopping at EOS).\n\n" + table + "\n\n"
        "Accept length: tokens per verify step, bonus token included. Acceptance per draft "
        "position: the share of verify steps that accepted draft token 1, 2, 3. Draft "
        "chains: with N, each step verifies N chains that start with the first depth's N most "
        "likely tokens and keeps the one accepted furthest.\n"
    )
    write_section(
        f"Speculative decoding ({device.upper()})",
        body,
        {"rows": rows, "command": command, "where": where},
        f"spec_{device}.json",
    )


if __name__ == "__main__":
    main()
