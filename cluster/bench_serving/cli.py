"""`pdcluster bench serving`: the flags, and one sweep over the request rates.

Each rate is a separate run over the same prompts. After each run its numbers are appended to
--output-dir, so an interrupted sweep (Ctrl-C) keeps every finished run and the measured part of
the one it stopped; the tables printed at the end cover the same.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cluster.bench_serving.client import (
    ENDPOINT_PATHS,
    Target,
    api_root,
    first_served_model,
    open_http_client,
    send_request,
)
from cluster.bench_serving.conversation_runner import run_conversations
from cluster.bench_serving.dataset_args import (
    DEFAULT_CONCURRENT_CONVERSATIONS,
    DEFAULT_NUM_PROMPTS,
    RANDOM_TEXT,
    add_dataset_args,
    dataset_spec,
    positive_float,
    positive_int,
)
from cluster.bench_serving.datasets import (
    BenchRequest,
    ConversationScript,
    DatasetStats,
    load_requests,
    multiturn_scripts,
)
from cluster.bench_serving.metrics import RunSummary, Slo, summarize
from cluster.bench_serving.report import (
    PLOT_FILE,
    BenchSetup,
    ResultsWriter,
    format_summaries,
    plot_latency_vs_rate,
)
from cluster.bench_serving.results import RequestResult
from cluster.bench_serving.runner import run_at_rate
from cluster.bench_serving.tokenizer import load_bench_tokenizer, tokenizer_source

PROG = "pdcluster bench serving"
DESCRIPTION = (
    "Load an OpenAI-compatible server (pdcluster, vLLM, SGLang) with streaming requests at one "
    "or more request rates; report throughput, TTFT/ITL/TPOT/E2E percentiles and goodput."
)
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # the shell's code for a process stopped by SIGINT


@dataclass(frozen=True)
class SweepPlan:
    target: Target
    requests: list[BenchRequest]
    request_rates: list[float]
    max_concurrency: int | None
    seed: int
    slo: Slo
    show_progress: bool
    # multiturn: the conversations, replayed with the server's answers (requests: their turns
    # with the built-in answers, which size the report's dataset lengths)
    conversations: list[ConversationScript] | None = None
    concurrent_conversations: int = DEFAULT_CONCURRENT_CONVERSATIONS
    tokenizer: Any = None  # sizes each turn's prompt where the server reports none


def add_bench_serving_args(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument(
        "--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000 (/v1 optional)"
    )
    server.add_argument(
        "--model", default=None, help="model to ask for (default: the first GET /v1/models lists)"
    )
    server.add_argument("--api-key", default=None, help="sent as Authorization: Bearer <key>")
    server.add_argument(
        "--endpoint",
        default="chat",
        choices=sorted(ENDPOINT_PATHS),
        help="stream from /v1/chat/completions (chat, the default) or /v1/completions",
    )
    server.add_argument(
        "--timeout",
        type=positive_float,
        default=3600.0,
        metavar="SECONDS",
        help="a request with no end this long after it was sent counts as lost (default 3600)",
    )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--num-prompts",
        type=positive_int,
        default=None,
        help=f"random, chat and file prompts to send (default {DEFAULT_NUM_PROMPTS})",
    )
    load.add_argument(
        "--request-rate",
        type=positive_float,
        nargs="+",
        default=[math.inf],
        metavar="RATE",
        help="requests per second, Poisson arrivals; inf sends every request at once (the "
        "default); several values make a sweep, one run per rate over the same prompts",
    )
    load.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=None,
        help="at most this many requests in flight; later arrivals wait (default: no limit)",
    )
    load.add_argument(
        "--seed", type=int, default=0, help="seeds the prompts and the arrivals (default 0)"
    )

    add_dataset_args(parser)

    requests = parser.add_argument_group("requests")
    requests.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send ignore_eos: true (a vLLM, SGLang and pdcluster extension) so that every "
        "output has exactly max_tokens (default: on for random, off otherwise)",
    )
    requests.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default 0)"
    )

    report = parser.add_argument_group("report")
    report.add_argument(
        "--slo-ttft-ms",
        type=positive_float,
        default=None,
        help="goodput counts only requests with TTFT at most this",
    )
    report.add_argument(
        "--slo-tpot-ms",
        type=positive_float,
        default=None,
        help="goodput counts only requests with TPOT (time per output token after the "
        "first) at most this",
    )
    report.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help=f"write results.jsonl (a line per rate) and {PLOT_FILE} (needs matplotlib: "
        "pip install 'pdcluster[bench]') here",
    )
    report.add_argument(
        "--save-requests",
        action="store_true",
        help="with --output-dir: also write requests.jsonl, a line per request",
    )
    report.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def run_bench_serving(args: argparse.Namespace) -> int:
    """Run the sweep; 0 when it ran to the end, 130 when interrupted, 2 for a setup error."""
    from engine.errors import PdclusterError  # see tokenizer.py: the engine package loads torch

    try:
        plan, setup = _prepare(args)
        writer = None
        if args.output_dir is not None:
            writer = ResultsWriter(args.output_dir, setup, args.save_requests)
    except (PdclusterError, ValueError, ConnectionError, OSError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    try:
        summaries = asyncio.run(run_sweep(plan, writer))
    except KeyboardInterrupt:
        # A second Ctrl-C: the runs already written stay in --output-dir.
        return EXIT_INTERRUPTED
    print("\n" + format_summaries(summaries))
    if writer is not None:
        _plot(summaries, args.output_dir / PLOT_FILE)
    return EXIT_INTERRUPTED if any(summary.interrupted for summary in summaries) else 0


async def run_sweep(plan: SweepPlan, writer: ResultsWriter | None) -> list[RunSummary]:
    """One run per rate, in order; stops after a run that was interrupted."""
    summaries = []
    async with open_http_client(plan.target) as http:

        async def send(request: BenchRequest, index: int) -> RequestResult:
            return await send_request(http, plan.target, request, index)

        for rate in plan.request_rates:
            if plan.conversations is not None:
                run = await run_conversations(
                    plan.conversations,
                    rate,
                    send,
                    plan.tokenizer,
                    concurrency=plan.concurrent_conversations,
                    seed=plan.seed,
                    show_progress=plan.show_progress,
                )
            else:
                run = await run_at_rate(
                    plan.requests,
                    rate,
                    send,
                    max_concurrency=plan.max_concurrency,
                    seed=plan.seed,
                    show_progress=plan.show_progress,
                )
            summary = summarize(run, plan.slo)
            summaries.append(summary)
            if writer is not None:
                writer.write_run(summary, run)
            print(_run_line(summary), flush=True)
            if run.interrupted:
                break
    return summaries


def _prepare(args: argparse.Namespace) -> tuple[SweepPlan, BenchSetup]:
    spec = dataset_spec(args)
    if args.save_requests and args.output_dir is None:
        raise ValueError("--save-requests needs --output-dir")
    base_url = api_root(args.url)
    model = args.model or first_served_model(base_url, args.api_key)
    source = tokenizer_source(args.tokenizer, model)
    if source is None:
        print(
            f"{PROG}: sizing prompts with pdcluster's default model tokenizer; pass --tokenizer "
            "to use the served model's own",
            file=sys.stderr,
        )
    tokenizer = load_bench_tokenizer(source)
    requests = load_requests(spec, tokenizer)
    conversations, concurrency = None, args.max_concurrency
    if spec.name == "multiturn":
        conversations = multiturn_scripts(spec, tokenizer, np.random.default_rng(spec.seed))
        concurrency = args.concurrent_conversations or DEFAULT_CONCURRENT_CONVERSATIONS
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else spec.name in RANDOM_TEXT
    target = Target(
        base_url=base_url,
        model=model,
        endpoint=args.endpoint,
        api_key=args.api_key,
        ignore_eos=ignore_eos,
        temperature=args.temperature,
        timeout_s=args.timeout,
    )
    stats = DatasetStats.of(requests)
    what = f"{len(requests)} {spec.name} prompts"
    if conversations is not None:
        what = (
            f"{len(conversations)} conversations of {len(requests)} turns, {concurrency} at a "
            "time (prompt tokens with the built-in answers in the history)"
        )
    print(
        f"{PROG}: {model} at {base_url}{target.path}: {what}, mean {stats.mean_prompt_len:g} "
        f"prompt tokens, mean max_tokens {stats.mean_output_len:g}",
        flush=True,
    )
    plan = SweepPlan(
        target=target,
        requests=requests,
        request_rates=list(args.request_rate),
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        slo=Slo(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms),
        show_progress=not args.disable_tqdm,
        conversations=conversations,
        concurrent_conversations=concurrency or DEFAULT_CONCURRENT_CONVERSATIONS,
        tokenizer=tokenizer,
    )
    setup = BenchSetup(
        url=base_url,
        model=model,
        endpoint=args.endpoint,
        max_concurrency=concurrency,
        ignore_eos=ignore_eos,
        temperature=args.temperature,
        dataset=spec,
        dataset_stats=stats,
    )
    return plan, setup


def _run_line(summary: RunSummary) -> str:
    state = " (interrupted)" if summary.interrupted else ""
    return (
        f"rate {summary.request_rate:g}/s{state}: {summary.completed} completed, "
        f"{summary.failed} failed, {summary.lost} lost of {summary.sent} sent in "
        f"{summary.duration_s:.2f} s; {summary.output_token_throughput:.1f} output tok/s"
    )


def _plot(summaries: list[RunSummary], path: Path) -> None:
    if plot_latency_vs_rate(summaries, path):
        print(f"wrote {path}")
    else:
        print(f"matplotlib is not installed: no {path.name} (pip install 'pdcluster[bench]')")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    add_bench_serving_args(parser)
    return run_bench_serving(parser.parse_args(argv))
