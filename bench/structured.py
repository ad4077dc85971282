"""Structured output's cost per token: engine.LLM tokens/s with a JSON schema against without.

    python bench/structured.py [--device cpu] [--max-tokens 64] [--batch-sizes 1 16]

Prints a table and rewrites the "Structured output (CPU)" (or "(CUDA)") section of
docs/BENCHMARKS.md (raw figures in docs/bench/structured[_cuda].json). Both runs generate
exactly --max-tokens tokens per request, greedy, from the same chat prompts: without a grammar
EOS is ignored, and the schema (an array of at least 500 integers) cannot end sooner, so every
step of both runs samples a token and the difference is the grammar's: the host filling each
row's bitmask (llguidance), the copy, and the mask applied on the device. Each run is warmed up
once (the grammar then comes from the compile cache), then timed --repeats times, alternating;
medians reported.
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

from bench.offline import CHATS  # noqa: E402
from bench.report import device_description, write_section  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.cpu_tuning import keep_large_allocations_in_heap  # noqa: E402
from engine.sampling.grammar import json_schema_grammar  # noqa: E402

SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 999},
    "minItems": 500,
}


def time_run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == params.max_tokens for o in outputs)
    return elapsed


def time_masks(llm: LLM, grammar: str, batch: int, steps: int) -> float:
    """Seconds per step of the grammar's own work alone (fill every row's bitmask, copy, mask
    the logits), the rows advancing along a valid answer: the figure the end-to-end difference
    measures, without the forward's noise on a shared CPU."""
    from engine.request import Request
    from engine.sampling.grammar import GrammarCompiler
    from engine.sampling.grammar_mask import mask_request_logits

    config = llm.engine.runner.model_config
    compiler = GrammarCompiler(llm.tokenizer, config.vocab_size, config.eos_token_ids)
    answer = llm.tokenizer.encode("[" + ",".join(str(i % 1000) for i in range(400)))[:steps]
    requests = []
    for i in range(batch):
        req = Request(str(i), [0], SamplingParams(max_tokens=steps))
        req.grammar = compiler.start(grammar)
        req.grammar.wait(60)
        requests.append(req)
    logits = torch.randn(batch, config.vocab_size)
    elapsed = 0.0
    for token in answer:
        start = time.perf_counter()
        mask_request_logits(logits, requests)
        elapsed += time.perf_counter() - start
        for req in requests:
            req.commit(token)
    return elapsed / len(answer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    keep_large_allocations_in_heap()
    llm = LLM(args.model, device=args.device, max_num_seqs=max(args.batch_sizes))
    chats = [[{"role": "user", "content": c + " Answer as JSON."}] for c in CHATS]
    grammar = json_schema_grammar(SCHEMA, "response_format")
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    schema = SamplingParams(max_tokens=args.max_tokens, temperature=0, grammar=grammar)
    rows, raw = [], {"max_tokens": args.max_tokens, "device": args.device, "results": []}
    for batch in args.batch_sizes:
        prompts = [llm.apply_chat_template(chats[i % len(chats)]) for i in range(batch)]
        times: dict[str, list[float]] = {"plain": [], "schema": []}
        for params in (plain, schema):
            time_run(llm, prompts, params)  # warm-up
        for _ in range(args.repeats):
            times["plain"].append(time_run(llm, prompts, plain))
            times["schema"].append(time_run(llm, prompts, schema))
        tokens = batch * args.max_tokens
        plain_s, schema_s = statistics.median(times["plain"]), statistics.median(times["schema"])
        # Per step (one token per request): what the grammar adds to each decode step.
        per_step_ms = (schema_s - plain_s) / args.max_tokens * 1000
        mask_ms = time_masks(llm, grammar, batch, args.max_tokens) * 1000
        result = {
            "mask_ms_per_step": mask_ms,
            "batch": batch,
            "plain_tokens_per_s": tokens / plain_s,
            "schema_tokens_per_s": tokens / schema_s,
            "grammar_ms_per_step": per_step_ms,
            "grammar_ms_per_token": per_step_ms / batch,
            "plain_s": times["plain"],
            "schema_s": times["schema"],
        }
        raw["results"].append(result)
        rows.append(
            f"| {batch} | {result['plain_tokens_per_s']:.1f} | {result['schema_tokens_per_s']:.1f}"
            f" | {100 * (schema_s / plain_s - 1):+.1f}% | {per_step_ms:.2f}"
            f" | {mask_ms:.3f} | {mask_ms / batch:.4f} |"
        )
    table = "\n".join(
        [
            "| batch | tokens/s, no schema | tokens/s, JSON schema | time | difference ms/step"
            " | mask ms/step | mask ms/token |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *rows,
        ]
    )
    print(table)
    body = (
        f"Command: `python bench/structured.py --device {args.device} --max-tokens "
        f"{args.max_tokens} --batch-sizes {' '.join(map(str, args.batch_sizes))}` "
        f"({device_description(args.device)}, "
        f"SmolLM2-135M-Instruct, vocabulary 49,152, greedy, {args.max_tokens} tokens per "
        f"request, median of {args.repeats}). The schema is an array of at least 500 integers, "
        "so neither run ends early; the difference between them is the grammar's cost. "
        "`mask ms/step` times the grammar's work alone (llguidance filling each row's bitmask "
        "on the host, the copy, the mask applied to the logits) for the batch, rows advancing "
        "along a valid answer; `mask ms/token` divides it by the batch. On a CPU shared with "
        "other work the end-to-end difference is within the run-to-run noise; the mask timing "
        "is the figure to read.\n\n" + table + "\n"
    )
    kind = "CPU" if args.device == "cpu" else "CUDA"
    name = "structured.json" if kind == "CPU" else "structured_cuda.json"
    write_section(f"Structured output ({kind})", body, raw, name)


if __name__ == "__main__":
    main()
