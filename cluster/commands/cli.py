"""`pdcluster` command line: `serve` runs the cluster, `demo` shows it off, `generate` runs
the offline engine, `train-draft` trains a speculative-decoding draft for a model."""

from __future__ import annotations

import argparse
import sys

from cluster.bench_serving.cli import DESCRIPTION as BENCH_SERVING_DESCRIPTION
from cluster.bench_serving.cli import add_bench_serving_args, run_bench_serving
from cluster.commands.cli_args import add_cluster_args, add_engine_args, positive_int
from cluster.commands.cli_commands import run_demo, run_generate, run_serve
from cluster.commands.train_draft_cli import add_train_draft_args, run_train_draft
from engine.errors import PdclusterError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the cluster behind an OpenAI-compatible API")
    add_engine_args(serve)
    add_cluster_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=None,
        help="require this bearer token on /v1 (shows in `ps`: --api-key-file or "
        "$PDCLUSTER_API_KEY do not)",
    )
    serve.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="require the bearer token on the first line of this file",
    )
    serve.add_argument(
        "--metrics-require-api-key",
        action="store_true",
        help="require the API key on /metrics too (open to scrapers by default)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="refuse a request body larger than this with a 413 (default 8 MiB)",
    )
    serve.add_argument("--served-model-name", default=None, help="model name in the API")
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM or a first Ctrl-C, refuse new requests (503, /health 503) and give "
        "those running this long to finish before stopping; a second Ctrl-C stops at once "
        "(default 30)",
    )
    serve.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        metavar="N",
        help="answer 429 (with Retry-After) to a request arriving while N are in flight, "
        "accepted and not finished (default: no limit)",
    )
    serve.add_argument(
        "--queue-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="end a request that has no first token this long after arriving, with a 503 "
        "naming the timeout, and free its KV (default: no timeout)",
    )
    serve.add_argument(
        "--api-servers",
        type=positive_int,
        default=None,
        metavar="N",
        help="HTTP front-end processes sharing the port, each tokenizing, routing and "
        "streaming the requests it accepted (default: 1 on a CPU; on a GPU up to 4, one per "
        "4 host cores: one process streams a few tens of thousands of tokens a second, a GPU "
        "engine makes more)",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="logging level of the router and every node (default info)",
    )
    serve.add_argument(
        "--log-stats-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="a busy node logs its load this often (default 5; 0 turns it off)",
    )
    serve.set_defaults(func=run_serve)

    demo = commands.add_parser(
        "demo", help="start a cluster, send a few chat requests through the SDK, print timings"
    )
    add_engine_args(demo)
    add_cluster_args(demo)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument(
        "--no-speculation",
        action="store_true",
        help="serve without speculative decoding (on by default where a draft is shipped)",
    )
    demo.set_defaults(func=run_demo)

    generate = commands.add_parser("generate", help="complete one prompt with the offline engine")
    add_engine_args(generate)
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="apply the chat template")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.set_defaults(func=run_generate)

    train = commands.add_parser(
        "train-draft",
        help="train a multi-layer EAGLE draft from the target's own answers (self-distillation)",
    )
    add_train_draft_args(train)
    train.set_defaults(func=run_train_draft)

    bench = commands.add_parser("bench", help="benchmark a running server")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True)
    serving = benchmarks.add_parser(
        "serving",
        help="load an OpenAI-compatible server (pdcluster, vLLM, SGLang) at request rates",
        description=BENCH_SERVING_DESCRIPTION,
    )
    add_bench_serving_args(serving)
    serving.set_defaults(func=run_bench_serving)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from engine.cpu_tuning import keep_large_allocations_in_heap

    keep_large_allocations_in_heap()
    try:
        status = args.func(args)
    except (PdclusterError, ValueError) as err:
        print(f"pdcluster: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    # Commands that report how they ended (bench: 130 after Ctrl-C) return their exit code.
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    sys.exit(main())
