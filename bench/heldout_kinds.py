"""A draft's held-out accept length by prompt kind, as the offline engine speculates.

    python bench/heldout_kinds.py [--device cpu|cuda] [--model PATH] [--draft-model PATH]
        [--trees 4:8] [--temperatures 0 0.7] [--max-tokens 256] [--batch-size 16]

Every held-out chat prompt (spec.train.prompts.heldout_prompts, never used to train the shipped
draft) is answered once per draft shape (one chain, then each --trees TOPK:NODES tree) and
temperature (0: greedy; otherwise each prompt sampled with a seed of its own), stopping at EOS or
--max-tokens. A kind's accept length is its tokens per verify step, bonus token included, over
all of its conversations' steps (spec.train.prompts.heldout_kinds: single turn, system prompt,
other language, multi-turn, code). Prints a table and rewrites the "Held-out accept length by
prompt kind (DEVICE)" section of docs/training.md (raw figures in
docs/bench/heldout_kinds_DEVICE.json)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import DOCS, device_description, write_section  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.cpu_tuning import keep_large_allocations_in_heap  # noqa: E402
from spec.default_draft import default_draft_path  # noqa: E402
from spec.train.prompts import HELDOUT_KINDS, heldout_kinds, heldout_prompts  # noqa: E402


def accept_lengths(
    llm: LLM, prompts: list[list[int]], kinds: list[str], temperature: float, args
) -> tuple[dict[str, float], float]:
    """Each kind's accept length, and all prompts' ("all" in the dict); seconds taken."""
    params = [
        SamplingParams(
            max_tokens=args.max_tokens, temperature=temperature, seed=i if temperature else None
        )
        for i in range(len(prompts))
    ]
    started = time.perf_counter()
    outputs = []
    for start in range(0, len(prompts), args.batch_size):
        end = start + args.batch_size
        outputs += llm.generate(prompts[start:end], params[start:end])
    committed: dict[str, float] = {}
    steps: dict[str, int] = {}
    for output, kind in zip(outputs, kinds):
        n = output.usage.spec_verify_steps or 0
        for key in (kind, "all"):
            steps[key] = steps.get(key, 0) + n
            committed[key] = committed.get(key, 0.0) + (output.usage.spec_accept_length or 0) * n
    lengths = {key: committed[key] / steps[key] for key in steps if steps[key]}
    return lengths, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None)
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--num-draft-steps", type=int, default=3)
    parser.add_argument("--trees", nargs="*", default=[], metavar="TOPK:NODES")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    keep_large_allocations_in_heap()
    draft = args.draft_model
    if draft is None:
        if args.model is not None or default_draft_path() is None:
            sys.exit("bench/heldout_kinds.py: --draft-model is needed for this model")
        draft = str(default_draft_path())
    shapes = [("1 chain", {"num_draft_chains": 1})]
    for tree in args.trees:
        topk, nodes = (int(v) for v in tree.split(":"))
        shapes.append(
            (f"top-{topk} tree of {nodes}", {"speculative_topk": topk, "num_draft_tokens": nodes})
        )
    conversations, kinds = heldout_prompts(), heldout_kinds()
    counts = {kind: kinds.count(kind) for kind in HELDOUT_KINDS}
    columns, results = [], {}
    for name, shape in shapes:
        llm = LLM(
            args.model,
            device=args.device,
            max_num_seqs=args.batch_size,
            speculative_algorithm="multi-layer-eagle",
            draft_model=draft,
            num_draft_steps=args.num_draft_steps,
            # Accept lengths are what it measures: a round at every step.
            speculative_plan="always",
            **shape,
        )
        prompts = [llm.apply_chat_template(c) for c in conversations]
        for temperature in args.temperatures:
            column = f"{name}, {'greedy' if not temperature else f'temperature {temperature:g}'}"
            lengths, seconds = accept_lengths(llm, prompts, kinds, temperature, args)
            print(f"[heldout_kinds] {column}: {lengths['all']:.2f} in {seconds:.0f} s", flush=True)
            columns.append(column)
            results[column] = lengths
        del llm
    lines = [
        "| kind | conversations | " + " | ".join(columns) + " |",
        "| :--- | ---: |" + " ---: |" * len(columns),
    ]
    for kind in (*HELDOUT_KINDS, "all"):
        count = counts.get(kind, len(kinds))
        cells = [f"{results[c][kind]:.2f}" if kind in results[c] else "-" for c in columns]
        label = f"**{kind}**" if kind == "all" else kind
        lines.append(f"| {label} | {count} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.no_write:
        return
    command = "python bench/heldout_kinds.py " + " ".join(sys.argv[1:])
    device = torch.device(args.device).type
    where = device_description(args.device)
    body = (
        f"Command: `{command.strip()}` ({where}; K = {args.num_draft_steps} draft depths from "
        f"{'the shipped draft' if args.draft_model is None else args.draft_model}; all "
        f"{len(kinds)} held-out conversations, at most {args.max_tokens} new tokens, stopping "
        f"at EOS, {args.batch_size} at a time; sampled ones seeded per prompt).\n\n"
        + table
        + "\n\nAccept length: tokens per verify step, bonus token included, over all verify "
        "steps of a kind's conversations. Kinds: a conversation about code is *code* whatever "
        "its form; the others are single-turn English requests, requests under a system "
        "prompt, requests in French, Spanish, German or Chinese, and three-turn "
        "conversations.\n"
    )
    write_section(
        f"Held-out accept length by prompt kind ({device.upper()})",
        body,
        {"columns": columns, "results": results, "counts": counts, "command": command},
        f"heldout_kinds_{device}.json",
        DOCS / "training.md",
    )


if __name__ == "__main__":
    main()
