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

from cluster.bench_serving.client import (
    ENDPOINT_PATHS,
    Target,
    api_root,
    first_served_model,
    open_http_client,
    send_request,
)
from cluster.bench_serving.datasets import (
    DATASETS,
    BenchRequest,
    DatasetSpec,
    DatasetStats,
    load_requests,
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
        type=_positive_float,
        default=3600.0,
        metavar="SECONDS",
        help="a request with no end this long after it was sent counts as lost (default 3600)",
    )

    load = parser.add_argument_group("load")
    load.add_argument("--num-prompts", type=_positive_int, default=200, help="default 200")
    load.add_argument(
        "--request-rate",
        type=_positive_float,
        nargs="+",
        default=[math.inf],
        metavar="RATE",
        help="requests per second, Poisson arrivals; inf sends every request at once (the "
        "default); several values make a sweep, one run per rate over the same prompts",
    )
    load.add_argument(
        "--max-concurrency",
        type=_positive_int,
        default=None,
        help="at most this many requests in flight; later arrivals wait (default: no limit)",
    )
    load.add_argument(
        "--seed", type=int, default=0, help="seeds the prompts and the arrivals (default 0)"
    )

    data = parser.add_argument_group("dataset")
    data.add_argument(
        "--dataset",
        default=None,
        choices=list(DATASETS),
        help="random: random tokens of --input-len; chat: built-in multi-turn conversations; "
        "file: --dataset-path (default: file with --dataset-path, else random)",
    )
    data.add_argument(
        "--dataset-path",
        default=None,
        metavar="FILE",
        help='ShareGPT JSON (a list of {"conversations": [{"from": "human" | "gpt", "value": '
        "...}]}: the first human turn, and the length of the gpt turn after it as the output "
        'length) or JSONL (one {"prompt": ..., "output_len": N (optional)} per line)',
    )
    data.add_argument(
        "--input-len", type=_positive_int, default=1024, help="random: prompt tokens (1024)"
    )
    data.add_argument(
        "--output-len",
        type=_positive_int,
        default=128,
        help="max_tokens for random prompts, and for file prompts that give none (128)",
    )
    data.add_argument(
        "--range-ratio",
        type=_range_ratio,
        default=0.0,
        help="random: draw each prompt's and output's length uniformly in "
        "[len * (1 - r), len * (1 + r)], with 0 <= r < 1 (vLLM's convention; SGLang's "
        "--random-range-ratio means [len * r, len] instead); 0 gives exact lengths (default)",
    )
    data.add_argument(
        "--tokenizer",
        default=None,
        help="model folder, GGUF file or cached hub name whose tokenizer sizes the prompts "
        "(default: --model when it is a local path, else pdcluster's default model)",
    )

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
        type=_positive_float,
        default=None,
        help="goodput counts only requests with TTFT at most this",
    )
    report.add_argument(
        "--slo-tpot-ms",
        type=_positive_float,
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
    dataset = _dataset_name(args)
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
    spec = DatasetSpec(
        name=dataset,
        num_prompts=args.num_prompts,
        seed=args.seed,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        path=args.dataset_path,
    )
    requests = load_requests(spec, load_bench_tokenizer(source))
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else dataset == "random"
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
    print(
        f"{PROG}: {model} at {base_url}{target.path}: {len(requests)} {dataset} prompts, "
        f"mean {stats.mean_prompt_len:g} prompt tokens, mean max_tokens "
        f"{stats.mean_output_len:g}",
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
    )
    setup = BenchSetup(
        url=base_url,
        model=model,
        endpoint=args.endpoint,
        max_concurrency=args.max_concurrency,
        ignore_eos=ignore_eos,
        temperature=args.temperature,
        dataset=spec,
        dataset_stats=stats,
    )
    return plan, setup


def _dataset_name(args: argparse.Namespace) -> str:
    if args.dataset is None:
        return "file" if args.dataset_path else "random"
    if args.dataset == "file" and args.dataset_path is None:
        raise ValueError("--dataset file needs --dataset-path")
    if args.dataset != "file" and args.dataset_path is not None:
        raise ValueError(
            f"--dataset-path reads a file: it does not go with --dataset {args.dataset}"
        )
    return args.dataset


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


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _range_ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    add_bench_serving_args(parser)
    return run_bench_serving(parser.parse_args(argv))
