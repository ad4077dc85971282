"""Speculative decoding on the offline engine: accept length and tokens/s with and without it.

    python bench/spec.py [--model PATH] [--draft-model PATH] [--num-draft-steps 3]

Without --draft-model a random (untrained) draft is made for the model: it accepts almost
nothing, so this shows what speculation costs and that it is lossless, not what it gains; a
trained draft is issue "Train the default draft". Both engines run the same chat prompts,
greedy, EOS ignored, and must produce identical tokens. Prints a table and rewrites the
"Speculative decoding" section of docs/BENCHMARKS.md (raw figures in docs/bench/spec.json)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.offline import CHATS  # noqa: E402
from bench.report import write_section  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.cpu_tuning import keep_large_allocations_in_heap  # noqa: E402
from spec.draft_model import MultiLayerEagleDraft, save_draft  # noqa: E402


def random_draft(llm: LLM, num_draft_steps: int, folder: Path) -> Path:
    torch.manual_seed(0)
    save_draft(folder, MultiLayerEagleDraft(llm.model_config, num_draft_steps), llm.model_path.name)
    return folder


def run(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:batch], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    outputs, started = [], time.perf_counter()
    for start in range(0, len(prompts), batch):
        outputs += llm.generate(prompts[start : start + batch], params)
    elapsed = time.perf_counter() - started
    details = [o.usage.completion_tokens_details for o in outputs]
    steps = sum(o.usage.spec_verify_steps or 0 for o in outputs)
    emitted = sum(o.usage.completion_tokens for o in outputs)
    # Tokens per verify step, bonus included (1.0: no draft token was ever accepted).
    by_verify = sum(
        (o.usage.spec_accept_length or 0) * (o.usage.spec_verify_steps or 0) for o in outputs
    )
    return {
        "tokens": [o.token_ids for o in outputs],
        "tok_s": emitted / elapsed,
        "verify_steps": steps,
        "accepted": sum(d.accepted_prediction_tokens for d in details if d),
        "rejected": sum(d.rejected_prediction_tokens for d in details if d),
        "accept_length": by_verify / steps if steps else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--num-draft-steps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    keep_large_allocations_in_heap()
    plain = LLM(args.model, device="cpu", max_num_seqs=max(args.batch_sizes))
    with tempfile.TemporaryDirectory() as scratch:
        draft = args.draft_model or random_draft(
            plain, args.num_draft_steps, Path(scratch) / "draft"
        )
        speculative = LLM(
            args.model,
            device="cpu",
            max_num_seqs=max(args.batch_sizes),
            speculative_algorithm="multi-layer-eagle",
            draft_model=draft,
            num_draft_steps=args.num_draft_steps,
        )
    chats = [plain.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    prompts = [chats[i % len(chats)] for i in range(args.prompts)]
    rows = []
    for batch in args.batch_sizes:
        base = run(plain, prompts, batch, args.max_tokens)
        spec = run(speculative, prompts, batch, args.max_tokens)
        rows.append(
            {
                "batch": batch,
                "plain_tok_s": base["tok_s"],
                "spec_tok_s": spec["tok_s"],
                "accept_length": spec["accept_length"],
                "accepted": spec["accepted"],
                "rejected": spec["rejected"],
                "identical": base["tokens"] == spec["tokens"],
            }
        )
    lines = [
        "| batch | plain tokens/s | speculative tokens/s | accept length | accepted / proposed "
        "| identical output |",
        "| ---: | ---: | ---: | ---: | ---: | :---: |",
    ]
    for r in rows:
        proposed = r["accepted"] + r["rejected"]
        lines.append(
            f"| {r['batch']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | "
            f"{r['accept_length']:.2f} | {r['accepted']} / {proposed} | "
            f"{'yes' if r['identical'] else 'NO'} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.no_write:
        return
    command = "python bench/spec.py " + " ".join(sys.argv[1:])
    draft_name = args.draft_model or "a random (untrained) draft"
    body = (
        f"Command: `{command.strip()}` (default model, CPU float32, {torch.get_num_threads()} "
        f"threads, K = {args.num_draft_steps} draft depths from {draft_name}, "
        f"{args.prompts} chat prompts, {args.max_tokens} new tokens each, greedy, EOS ignored)."
        "\n\n" + table + "\n\nAn untrained draft accepts almost nothing, so speculation only "
        "costs here (a draft forward per depth and a wider verify per step); what this run "
        "shows is that the output is token-for-token the same. A trained draft is the subject "
        'of the issue "Train the default draft".\n'
    )
    write_section("Speculative decoding", body, {"rows": rows, "command": command}, "spec.json")


if __name__ == "__main__":
    main()
