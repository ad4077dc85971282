"""Speculative decoding on the offline engine: accept length and tokens/s with and without it,
side by side in one run.

    python bench/spec.py [--device cpu|cuda] [--model PATH] [--draft-model PATH|shipped|random ...]
        [--num-draft-steps 3 5] [--num-draft-chains 1 3] [--trees 4:8 4:12]
        [--draft-vocab draft full] [--speculative-plan always adaptive]
        [--temperature 0.7] [--repeats 3]
        [--requests N] [--continuous]

Plain decoding and one speculative engine per --num-draft-chains value and per --trees
TOPK:NODES draft tree (spec/runtime/tree.py) answer the held-out chat prompts
(spec.train.prompts.heldout_prompts, never used to train the shipped draft), stopping at EOS or
--max-tokens; greedy ones must produce identical tokens (with --temperature, every request is
sampled with a seed of its own, and the output is not compared). With N chains, each step
verifies N draft chains that start with the first depth's N most likely tokens; a TOPK:NODES
tree expands TOPK nodes per level, each proposing its TOPK likeliest children, and verifies
the NODES likeliest. The draft is the shipped default draft for the default model unless
--draft-model names one; `--draft-model random` makes an untrained one, which shows the cost of
speculating and nothing else. Several --draft-model values (`shipped` names the shipped draft)
each get those engines, and the table gains a draft column: drafts compared side by side in one
run, each with its own number of depths unless --num-draft-steps sets one for all. So do several
--num-draft-steps values (steps beyond a draft's depths run its last depth again) and several
--draft-vocab values: a draft proposing from its folder's vocabulary, then from the whole one;
and several --speculative-plan values: a round at every step ("always", the default here), or
rounds only where they are measured to pay (spec/runtime/round_plan.py; the `rounds` column gives
the share of decode steps that speculated).
Each engine runs --repeats passes, alternating with the others; the table shows median tokens/s
and the range of pass-against-pass speedups. A pass runs its requests (`--requests`, the held-out
prompts in turn) in waves of BATCH, each wave finished before the next, so the request that
accepts least sets a wave's length; with --continuous it submits them all at once to engines
built with max_num_seqs=BATCH, which admit a request whenever one finishes, as a server under
steady load does. Prints a table and rewrites the "Speculative decoding (DEVICE)" section of
docs/BENCHMARKS.md (raw figures in docs/bench/spec_DEVICE.json), or with a plan other than
"always" the "Speculative round plans (DEVICE)" section (docs/bench/spec_plans_DEVICE.json)."""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import device_description, write_section  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.cpu_tuning import keep_large_allocations_in_heap  # noqa: E402
from engine.request import spec_totals  # noqa: E402
from spec.default_draft import default_draft_path  # noqa: E402
from spec.draft_model import MultiLayerEagleDraft, save_draft  # noqa: E402
from spec.runtime.round_costs import StepCosts  # noqa: E402
from spec.runtime.round_plan import PlanPolicy  # noqa: E402
from spec.train.prompts import heldout_prompts  # noqa: E402


def random_draft(llm: LLM, num_draft_steps: int, folder: Path) -> Path:
    torch.manual_seed(0)
    save_draft(folder, MultiLayerEagleDraft(llm.model_config, num_draft_steps), llm.model_path.name)
    return folder


def run(
    llm: LLM,
    prompts: list[list[int]],
    batch: int,
    max_tokens: int,
    temperature: float,
    continuous: bool,
) -> dict:
    """One pass over `prompts`: in waves of `batch`, each finished before the next starts, or
    (`continuous`) all at once through an engine that keeps at most `batch` running."""
    params = [
        SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=i if temperature else None
        )
        for i in range(len(prompts))
    ]
    llm.generate(prompts[:batch], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    plans_before = llm.engine.plan_counts()
    wave = len(prompts) if continuous else batch
    outputs, started = [], time.perf_counter()
    for start in range(0, len(prompts), wave):
        outputs += llm.generate(prompts[start : start + wave], params[start : start + wave])
    elapsed = time.perf_counter() - started
    emitted = sum(o.usage.completion_tokens for o in outputs)
    totals = spec_totals(o.usage for o in outputs)
    steps = totals.verify_steps
    plans = {
        plan: n - plans_before.get(plan, 0)
        for plan, n in llm.engine.plan_counts().items()
        if n > plans_before.get(plan, 0)
    }
    costs = getattr(llm.engine.speculator, "costs", None)
    plain_s, round_s = costs.measured(batch) if costs is not None else (None, None)
    return {
        "tokens": [o.token_ids for o in outputs],
        # What the adaptive plan measured at this batch size's bucket after the pass.
        "measured_plain_ms": None if plain_s is None else 1e3 * plain_s,
        "measured_round_ms": None if round_s is None else 1e3 * round_s,
        "completion_tokens": emitted,
        "tok_s": emitted / elapsed,
        "verify_steps": steps,
        # Tokens per verify step, bonus included (1.0: no draft token was ever accepted).
        "accept_length": totals.accept_length if steps else None,
        "acceptance": [c / steps for c in totals.accepted_per_position] if steps else [],
        # The pass's decode steps by round plan.
        "plans": plans,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None)
    parser.add_argument(
        "--draft-model",
        nargs="+",
        default=None,
        help="draft folders, 'shipped' or 'random' (an untrained one); several are compared "
        "side by side (default: the shipped draft)",
    )
    parser.add_argument(
        "--num-draft-steps",
        type=int,
        nargs="+",
        default=[None],
        help="one speculative engine per value: draft steps a round (default: one per depth "
        "each draft has, 3 for a random draft; steps beyond a draft's depths run its last "
        "depth again)",
    )
    parser.add_argument(
        "--num-draft-chains",
        type=int,
        nargs="+",
        default=[None],
        help="one speculative engine per value (default: the engine's default for the device)",
    )
    parser.add_argument(
        "--trees",
        nargs="+",
        default=[],
        metavar="TOPK:NODES",
        help="one speculative engine per draft tree shape, e.g. 4:8",
    )
    parser.add_argument(
        "--draft-vocab",
        nargs="+",
        choices=("draft", "full"),
        default=[None],
        help="one speculative engine per value: proposals from the draft folder's vocabulary "
        "or the target's whole one (default: the engine's default for the device)",
    )
    parser.add_argument(
        "--speculative-plan",
        nargs="+",
        choices=("always", "adaptive"),
        default=["always"],
        help="one speculative engine per value: a round at every step, or where it pays",
    )
    parser.add_argument(
        "--given-costs",
        type=float,
        nargs=2,
        metavar=("PLAIN_MS", "ROUND_MS"),
        help="adaptive engines weigh these costs of a plain step and a round (at every batch "
        "size) instead of measuring them: another device's, to see what the plan decides "
        "with them and the accept length this host's rounds learn",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompts", type=int, default=16, help="held-out conversations used")
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests a pass, the held-out conversations in turn (default: --prompts)",
    )
    parser.add_argument(
        "--continuous",
        action="store_true",
        help="each pass submits all its requests at once to engines that keep at most BATCH "
        "running (max_num_seqs=BATCH), as a server does; default: waves of BATCH requests, "
        "each wave finished before the next",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="passes per engine, alternating; medians shown"
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.given_costs is not None and min(args.given_costs) <= 0:
        parser.error("--given-costs must be positive")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.requests is not None and args.requests < 1:
        parser.error("--requests must be at least 1")
    if any(k is not None and k < 1 for k in args.num_draft_steps):
        parser.error("--num-draft-steps must be at least 1")
    args.num_draft_steps = list(dict.fromkeys(args.num_draft_steps))
    if args.draft_model is None:
        if args.model is not None:
            parser.error("--draft-model is needed for a model other than the default one")
        args.draft_model = ["shipped"]
    if "shipped" in args.draft_model and default_draft_path() is None:
        parser.error("--draft-model shipped: no shipped draft is installed")
    args.draft_model = list(dict.fromkeys(args.draft_model))

    keep_large_allocations_in_heap()
    chain_counts = list(dict.fromkeys(args.num_draft_chains))
    trees = [tuple(int(v) for v in shape.split(":")) for shape in args.trees]
    shapes = [{"num_draft_chains": chains} for chains in chain_counts] + [
        {"speculative_topk": topk, "num_draft_tokens": nodes} for topk, nodes in trees
    ]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        # Waves share one set of engines; continuous batching needs max_num_seqs = the batch.
        sizes = [[b] for b in args.batch_sizes] if args.continuous else [args.batch_sizes]
        for group in sizes:
            plain, speculative, names = build_engines(args, shapes, max(group), Path(scratch))
            texts = [plain.apply_chat_template(c) for c in heldout_prompts()[: args.prompts]]
            prompts = [texts[i % len(texts)] for i in range(args.requests or len(texts))]
            for batch in group:
                rows += measure(args, plain, speculative, names, prompts, batch)
            del plain, speculative
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    several = len({r["draft"] for r in rows}) > 1
    lines = [
        "| batch | " + ("draft | " if several else "") + "drafts | plain tokens/s | "
        "speculative tokens/s | speedup | speedup range | rounds | plain / round ms "
        "| accept length | acceptance per draft position | identical output |",
        "| ---: | " + (":--- | " if several else "") + ":--- | ---: | ---: | ---: | :--- | ---: "
        "| ---: | ---: | :--- | :---: |",
    ]
    for r in rows:
        acceptance = ", ".join(f"{a:.2f}" for a in r["acceptance"])
        same = {None: "sampled", True: "yes", False: "NO"}[r["identical"]]
        draft = f"{r['draft']} | " if several else ""
        lines.append(
            f"| {r['batch']} | {draft}{r['drafts']} | {r['plain_tok_s']:.1f} | "
            f"{r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | {_range(r)} | "
            f"{r['round_share']:.0%} | {_measured(r)} | {_accept(r)} | "
            f"{acceptance} | {same} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.no_write:
        return
    command = "python bench/spec.py " + " ".join(sys.argv[1:] if argv is None else argv)
    sampling = f"temperature {args.temperature}, seeded" if args.temperature else "greedy"
    device = torch.device(args.device).type
    where = device_description(args.device)
    model = "default model" if args.model is None else f"model {args.model}"
    body = (
        f"Command: `{command.strip()}` ({model}, {where}, {_drafts(rows)}, "
        f"{_workload(args, len(prompts))}, "
        f"{sampling}, at most {args.max_tokens} new tokens, stopping at EOS; tokens/s: the median "
        f"of {args.repeats} passes per engine, the engines alternating).\n\n" + table + "\n\n"
        "Rounds: the share of decode steps that verified drafts (the others were plain steps "
        "that the round plan chose). Plain / round ms: a plain step's and a round's cost as the "
        "engine measured them at the batch size's bucket after its first pass (the adaptive "
        "plan weighs these; a round at every step measures no plain step). "
        "Accept length: tokens per verify step, bonus token included. Acceptance per draft "
        "position: the share of verify steps that accepted draft token 1, 2 and so on. Drafts: N "
        "chains start with the first depth's N most likely tokens; a top-k tree of N nodes "
        "expands k nodes per level, each proposing its k likeliest children, and verifies the "
        "N likeliest nodes under the draft.\n"
    )
    plans = args.speculative_plan != ["always"]
    write_section(
        f"Speculative {'round plans' if plans else 'decoding'} ({device.upper()})",
        body,
        {"rows": rows, "command": command, "where": where},
        f"spec_{'plans_' if plans else ''}{device}.json",
    )


def build_engines(
    args: argparse.Namespace, shapes: list[dict], max_num_seqs: int, scratch: Path
) -> tuple[LLM, list[LLM], list[str]]:
    """The plain engine, one speculative engine per draft and draft shape (draft by draft), and
    each speculative engine's draft name."""
    common = {"device": args.device, "max_num_seqs": max_num_seqs}
    plain = LLM(args.model, **common)
    speculative, names = [], []
    vocabs = list(dict.fromkeys(args.draft_vocab))
    steps = args.num_draft_steps
    plans = list(dict.fromkeys(args.speculative_plan))
    for draft, name in _drafts_of(args, plain, scratch):
        for vocab, k, shape, plan in itertools.product(vocabs, steps, shapes, plans):
            llm = LLM(
                args.model,
                **common,
                speculative_algorithm="multi-layer-eagle",
                draft_model=draft,
                num_draft_steps=k,
                draft_vocab=vocab,
                speculative_plan=plan,
                **shape,
            )
            if plan == "adaptive" and args.given_costs is not None:
                plain_ms, round_ms = args.given_costs
                llm.engine.speculator.set_plan_policy(
                    PlanPolicy("adaptive"), StepCosts.fixed(plain_ms / 1e3, round_ms / 1e3)
                )
            speculative.append(llm)
            label = name + _vocab_name(llm, vocab) if len(vocabs) > 1 else name
            if len(steps) > 1:
                label += f", {llm.engine.speculator.num_draft_steps} steps"
            if len(plans) > 1:
                label += f", {plan} plan"
            if plan == "adaptive" and args.given_costs is not None:
                label += ", given costs {:g} / {:g} ms".format(*args.given_costs)
            names.append(label)
    return plain, speculative, names


def _vocab_name(llm: LLM, asked: str | None) -> str:
    head = llm.engine.speculator.head
    if head.vocab is not None:
        return f", {head.vocab.numel():,}-token vocabulary"
    if asked == "draft":
        return ", whole vocabulary (it ships none)"
    return ", whole vocabulary"


def _drafts_of(args: argparse.Namespace, plain: LLM, scratch: Path) -> list[tuple[Path, str]]:
    """Each --draft-model value's folder and name: a random draft is made once in `scratch`."""
    drafts = []
    for value in args.draft_model:
        if value == "random":
            folder = scratch / "draft"
            if not folder.exists():
                random_draft(plain, 3, folder)  # more steps reuse depth 2
            drafts.append((folder, "a random (untrained) draft"))
        elif value == "shipped":
            # Made for the default model; the engine refuses it for a target of other shapes.
            drafts.append((default_draft_path(), "the shipped default draft"))
        else:
            drafts.append((Path(value), value))
    return drafts


def measure(
    args: argparse.Namespace,
    plain: LLM,
    speculative: list[LLM],
    names: list[str],
    prompts: list[list[int]],
    batch: int,
) -> list[dict]:
    """A table row per speculative engine at `batch`, the engines alternating pass by pass so
    that a slow spell of the machine hits all of them."""
    passes: list[list[dict]] = [[] for _ in range(1 + len(speculative))]
    for _ in range(args.repeats):
        for runs, llm in zip(passes, [plain, *speculative]):
            runs.append(
                run(llm, prompts, batch, args.max_tokens, args.temperature, args.continuous)
            )
    base, plain_tok_s = passes[0][0], median(r["tok_s"] for r in passes[0])
    rows = []
    for llm, name, runs in zip(speculative, names, passes[1:]):
        spec, spec_tok_s = runs[0], median(r["tok_s"] for r in runs)
        rows.append(
            {
                "batch": batch,
                "draft": name,
                "num_draft_steps": llm.engine.speculator.num_draft_steps,
                "drafts": _shape_name(llm),
                "plain_tok_s": plain_tok_s,
                "spec_tok_s": spec_tok_s,
                "speedup": spec_tok_s / plain_tok_s,
                "plain_passes": [r["tok_s"] for r in passes[0]],
                "spec_passes": [r["tok_s"] for r in runs],
                "accept_length": spec["accept_length"],
                "acceptance": spec["acceptance"],
                "plan": llm.config.speculative_plan,
                "plans": spec["plans"],
                "round_share": _round_share(spec["plans"]),
                "measured_ms": (spec["measured_plain_ms"], spec["measured_round_ms"]),
                "completion_tokens": spec["completion_tokens"],
                "identical": None if args.temperature else base["tokens"] == spec["tokens"],
            }
        )
    return rows


def _drafts(rows: list[dict]) -> str:
    """The drafts the rows ran, with their steps, for the section's opening line."""
    drafts = dict.fromkeys((r["draft"], r["num_draft_steps"]) for r in rows)
    return "; ".join(f"K = {k} draft steps from {name}" for name, k in drafts)


def _workload(args: argparse.Namespace, requests: int) -> str:
    conversations = min(args.prompts, len(heldout_prompts()))
    what = f"the first {conversations} held-out chat prompts"
    if requests != conversations:
        what = f"{requests} requests cycling through {what}"
    if args.continuous:
        return what + ", all submitted at once, at most BATCH running (continuous batching)"
    return what + ", in waves of BATCH requests"


def _round_share(plans: dict[str, int]) -> float:
    steps = sum(plans.values())
    rounds = sum(n for plan, n in plans.items() if not plan.startswith("plain"))
    return rounds / steps if steps else 0.0


def _measured(row: dict) -> str:
    """The plain step's and the round's cost that the engine measured at the batch's bucket
    (what the adaptive plan weighs), or dashes where it measured none."""
    return " / ".join("-" if ms is None else f"{ms:.2f}" for ms in row["measured_ms"])


def _accept(row: dict) -> str:
    """The accept length, or a dash where no round ran."""
    return "-" if row["accept_length"] is None else f"{row['accept_length']:.2f}"


def _range(row: dict) -> str:
    """The lowest and highest speedup of a pass against a pass of plain decoding."""
    ratios = [s / p for s in row["spec_passes"] for p in row["plain_passes"]]
    return f"{min(ratios):.2f}-{max(ratios):.2f}x"


def _shape_name(llm: LLM) -> str:
    config, shape = llm.config, llm.engine.speculator.shape
    if config.speculative_topk > 1:
        return f"top-{config.speculative_topk} tree of {shape.budget}"
    chains = config.num_draft_chains
    return f"{chains} chain{'s' if chains > 1 else ''}"


if __name__ == "__main__":
    main()
