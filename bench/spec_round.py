"""What a speculative round costs against a plain decode step, apart from any draft's quality.

    python bench/spec_round.py [--device cpu|cuda] [--model PATH] [--draft-vocab-size N]

Builds a model of the target's shapes with random weights (speed does not depend on the
values) and a random K-depth draft, then decodes the same prompts plainly and speculatively,
ignoring EOS, one group of --batch-sizes requests after another. The prompts vary in length, so
each round meets new sequence lengths, as real traffic does. It times `verify` and
`finish_round` (draft extend and the next chain) of every round, synchronising the device
around each. A random draft accepts almost nothing, so each round emits about one token: the
ratio round / plain step is the accept length a draft needs just to break even.
Prints a table and rewrites the "Speculative round cost (DEVICE)" section of
docs/BENCHMARKS.md (raw figures in docs/bench/spec_round_DEVICE.json)."""

from __future__ import annotations

import argparse
import random
import shutil
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
from engine.loading.weights import load_hf_config, resolve_model  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.request import spec_totals  # noqa: E402
from spec.draft_model import MultiLayerEagleDraft, save_draft  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def random_copy(model: Path, folder: Path) -> Path:
    """`model`'s config and tokenizer with random weights, saved under `folder`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (model / name).exists():
            shutil.copy(model / name, folder / name)
    return folder


def random_draft(target: Path, steps: int, vocab_size: int | None, folder: Path) -> Path:
    config = ModelConfig.from_hf(load_hf_config(target))
    vocab = None
    if vocab_size is not None and vocab_size < config.vocab_size:
        # Evenly spread ids: which ones does not matter to the cost.
        vocab = torch.linspace(0, config.vocab_size - 1, vocab_size).long().unique()
    torch.manual_seed(1)
    save_draft(folder, MultiLayerEagleDraft(config, steps, vocab), target.name)
    return folder


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_calls(obj, name: str, device: str, record: list[float]) -> None:
    """Wrap obj.name so that each call's wall time, device work included, lands in record."""
    inner = getattr(obj, name)

    def timed(*args, **kwargs):
        _sync(device)
        started = time.perf_counter()
        result = inner(*args, **kwargs)
        _sync(device)
        record.append(time.perf_counter() - started)
        return result

    setattr(obj, name, timed)


def measure(llm: LLM, prompts: list[list[int]], batch: int, tokens: int, device: str) -> dict:
    """Decode `prompts` in groups of `batch` requests, one generate call per group."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate([[7] * 16] * batch, params)  # warm-up, on lengths none of the prompts has
    verify: list[float] = []
    finish: list[float] = []
    worker = llm.engine.speculator
    if worker is not None:
        time_calls(worker, "verify", device, verify)
        time_calls(worker, "finish_round", device, finish)
    _sync(device)
    started = time.perf_counter()
    outputs = []
    for start in range(0, len(prompts), batch):
        outputs += llm.generate(prompts[start : start + batch], params)
    elapsed = time.perf_counter() - started
    groups = -(-len(prompts) // batch)
    if worker is not None:
        del worker.verify, worker.finish_round  # back to the class's methods
        # Rounds of a group: its requests' verify steps run side by side.
        steps = spec_totals(o.usage for o in outputs).verify_steps / len(prompts) * groups
    else:
        steps = tokens * groups
    row = {"batch": batch, "ms_per_step": elapsed / steps * 1e3, "steps": steps}
    if verify:
        row["verify_ms"] = sum(verify) / len(verify) * 1e3
        row["finish_round_ms"] = sum(finish) / len(finish) * 1e3
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="whose shapes to copy (default: embedded)")
    parser.add_argument("--num-draft-steps", type=int, default=3)
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per request")
    parser.add_argument(
        "--prompt-lens",
        type=int,
        nargs=2,
        default=[20, 220],
        metavar=("MIN", "MAX"),
        help="prompt lengths, drawn uniformly (seeded): each round meets new sequence lengths, "
        "as real traffic does",
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    keep_large_allocations_in_heap()
    source = resolve_model(args.model)
    batch_max = max(args.batch_sizes)
    rng = random.Random(0)
    low, high = args.prompt_lens
    prompts = [
        [rng.randrange(100, 5000) for _ in range(rng.randint(low, high))]
        for _ in range(max(args.prompts, batch_max))
    ]
    common = {
        "device": args.device,
        "max_num_seqs": batch_max,
        "kv_cache_tokens": batch_max * (high + args.tokens + 16) + 64,
    }
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        target = random_copy(source, Path(scratch) / "target")
        drafts = {
            "whole vocabulary": random_draft(
                target, args.num_draft_steps, None, Path(scratch) / "d1"
            ),
            "draft vocabulary": random_draft(
                target, args.num_draft_steps, args.draft_vocab_size, Path(scratch) / "d2"
            ),
        }
        for label in ("plain", *drafts):
            draft = drafts.get(label)
            extra = {}
            if draft is not None:
                # "draft": each folder as saved, the second's vocabulary used on a GPU too.
                extra = {
                    "speculative_algorithm": "multi-layer-eagle",
                    "draft_model": draft,
                    "draft_vocab": "draft",
                    # A round's cost is what it measures: one at every step (the adaptive
                    # plan would stop speculating with a random draft).
                    "speculative_plan": "always",
                }
            llm = LLM(str(target), **common, **extra)
            for batch in args.batch_sizes:
                row = measure(llm, prompts, batch, args.tokens, args.device)
                rows.append({"variant": label, **row})
            del llm
    plain = {r["batch"]: r["ms_per_step"] for r in rows if r["variant"] == "plain"}
    lines = [
        "| batch | variant | ms per step or round | round / plain step | verify ms "
        "| draft extend + next chain ms |",
        "| ---: | :--- | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(rows, key=lambda r: r["batch"]):
        ratio = r["ms_per_step"] / plain[r["batch"]]
        r["ratio"] = ratio
        verify = f"{r['verify_ms']:.2f}" if "verify_ms" in r else ""
        finish = f"{r['finish_round_ms']:.2f}" if "finish_round_ms" in r else ""
        lines.append(
            f"| {r['batch']} | {r['variant']} | {r['ms_per_step']:.2f} | {ratio:.2f} "
            f"| {verify} | {finish} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.no_write:
        return
    device = torch.device(args.device).type
    where = device_description(args.device)
    command = "python bench/spec_round.py " + " ".join(sys.argv[1:])
    body = (
        f"Command: `{command.strip()}` ({where}; the default model's shapes with random "
        f"weights, a random {args.num_draft_steps}-depth draft with the whole vocabulary or "
        f"{args.draft_vocab_size} tokens; {len(prompts)} prompts of {low} to {high} tokens, in "
        f"groups of the batch size, {args.tokens} tokens decoded per request, EOS "
        "ignored).\n\n" + table + "\n\n"
        "A random draft accepts almost nothing, so a round emits about one token: "
        '"round / plain step" is the accept length a draft needs to break even. Verify and '
        "draft-extend times synchronise the device around each call, which the step times do "
        "not.\n"
    )
    write_section(
        f"Speculative round cost ({device.upper()})",
        body,
        {"rows": rows, "command": command, "where": where},
        f"spec_round_{device}.json",
    )


if __name__ == "__main__":
    main()
