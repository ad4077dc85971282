"""`pdcluster` command line: `serve` runs the cluster, `demo` shows it off, `generate` runs
the offline engine, `train-draft` trains a speculative-decoding draft for a model."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Mapping

from cluster.bench_serving.cli import DESCRIPTION as BENCH_SERVING_DESCRIPTION
from cluster.bench_serving.cli import add_bench_serving_args, run_bench_serving
from cluster.cli_args import add_model_args, layer_list
from cluster.train_draft_cli import add_train_draft_args, run_train_draft
from engine.errors import PdclusterError


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(
        parser,
        "Hugging Face model folder or GGUF file (default: embedded SmolLM2-135M-Instruct)",
        "weights and KV dtype",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64, help="requests batched at once")
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's)"
    )
    parser.add_argument(
        "--max-tokens-cap",
        type=int,
        default=None,
        metavar="N",
        help="refuse a request asking for more than N max_tokens with a 400; a chat request "
        "without max_tokens gets N, as far as the context allows (default: no cap)",
    )
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="KV slots per node (default: 2 GiB worth on CPU, 80%% of free memory on GPU)",
    )
    parser.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=8192,
        help="prompt tokens one prefill step may run (default 8192)",
    )
    parser.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="prefill prompts longer than this many tokens in chunks of it, between other work; "
        "an abort takes effect at the next chunk; 0: no chunks (default 2048 on a CPU, 4096 on "
        "a GPU)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="FRACTION",
        help="fraction of the GPU's total memory one engine may take (weights, KV, activations), "
        "for engines sharing a GPU (default: the KV pool takes 80%% of the memory free at "
        "start-up; --gpus-per-node below 1 sets it to the node's share)",
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="attention kernels: triton (paged, CUDA graph capturable; needs CUDA) or torch "
        "(the reference; runs anywhere); auto: triton on a GPU, torch on a CPU",
    )
    parser.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="run decode steps eagerly on a GPU instead of replaying captured CUDA graphs",
    )
    parser.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help="largest decode batch captured in a CUDA graph; larger batches run eagerly "
        "(default: --max-num-seqs)",
    )
    parser.add_argument(
        "--cuda-graph-max-prefill-tokens",
        type=int,
        default=None,
        help="prefill steps of up to this many tokens replay CUDA graphs too (default 512; "
        "0: prefill runs eagerly)",
    )
    parser.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="on a GPU, wait for each plain decode step's tokens before preparing the next "
        "(by default the host prepares a step while the device runs the one before)",
    )
    parser.add_argument(
        "--speculative-algorithm",
        default=None,
        choices=["multi-layer-eagle"],
        help="speculative decoding on decode nodes (and the offline engine); needs --draft-model "
        "except on the default model, which has a shipped draft",
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        help="draft folder (docs/draft-format.md); default model: the shipped draft",
    )
    parser.add_argument(
        "--num-draft-steps",
        type=int,
        default=None,
        help="draft depths K to use (default: every depth the draft has)",
    )
    parser.add_argument(
        "--num-draft-chains",
        type=int,
        default=None,
        help="draft chains per greedy request, started with the first depth's most likely "
        "tokens; each step keeps the one accepted furthest (default: 4 on a GPU, 1 on a CPU)",
    )
    parser.add_argument(
        "--debug-tensor-dump-dir",
        type=os.path.abspath,
        default=None,
        metavar="DIR",
        help="debugging, slow: save every module's output of each forward pass; files go to "
        "DIR/<node>/<target|draft-N>/rank0/forward_NNNNNN.pt, <node> being prefill-0, "
        "decode-0, ... (offline for generate); runs eagerly: no CUDA graph is captured",
    )
    parser.add_argument(
        "--debug-tensor-dump-layers",
        type=layer_list,
        default=None,
        metavar="L1,L2,...",
        help="with --debug-tensor-dump-dir: dump only these target decoder layers "
        "(embeddings, final norm, LM head and draft depths always)",
    )


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    from cluster.policies import POLICIES

    parser.add_argument("--prefill-nodes", type=int, default=1, help="prefill actors (default 1)")
    parser.add_argument("--decode-nodes", type=int, default=1, help="decode actors (default 1)")
    parser.add_argument(
        "--aggregated",
        action="store_true",
        help="no disaggregation: --replicas engines, each prefilling and decoding its own "
        "requests, behind the same router and API (the baseline to compare with)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="with --aggregated: engine actors, one GPU each (default 1)",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=float,
        default=1.0,
        metavar="SHARE",
        help="share of a GPU each node takes; 0.5 puts a prefill and a decode node on one GPU "
        "(KV pools sized to the share, transfers through host memory) (default 1)",
    )
    parser.add_argument("--prefill-policy", default="round_robin", choices=sorted(POLICIES))
    parser.add_argument("--decode-policy", default="least_load", choices=sorted(POLICIES))
    parser.add_argument(
        "--ray-address",
        default=None,
        help="join an existing Ray cluster (auto or HOST:PORT); default: start a local one",
    )
    parser.add_argument(
        "--prefill-resource",
        default="prefill",
        help="custom Ray resource that marks prefill hosts; used where the cluster declares it, "
        "else prefill nodes go to any free GPU (default: prefill)",
    )
    parser.add_argument(
        "--decode-resource",
        default="decode",
        help="custom Ray resource that marks decode hosts, as --prefill-resource (default: decode)",
    )
    parser.add_argument(
        "--wait-for-nodes",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait this long for the Ray cluster to hold the GPUs and resources asked for "
        "(workers still joining) before failing (default: 0, fail at once)",
    )
    parser.add_argument(
        "--cpu-threads-per-node",
        type=int,
        default=1,
        help="torch threads per node when running on CPU (nodes share the host's cores)",
    )
    parser.add_argument(
        "--transfer-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="how long one KV transfer may take once posted (default 120): past it the request "
        "fails, the slots the transfer may still touch are held until its prefill node is "
        "replaced, and /health reports the node degraded",
    )
    parser.add_argument(
        "--max-node-restarts",
        type=int,
        default=5,
        help="replace a node that dies at most this many times in a row (each replacement dying "
        "within a minute of starting); then it is left down and reported failed. 0: never "
        "replace (default 5)",
    )
    parser.add_argument(
        "--node-restart-backoff",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="wait before replacing a dead node, doubled for each death in a row up to 60 s "
        "(default 1)",
    )
    parser.add_argument(
        "--kv-audit-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how often each node checks its KV pools against its live requests, logging and "
        "counting any difference (default 10; 0: never)",
    )
    parser.add_argument(
        "--enable-tracing",
        action="store_true",
        help="record each request's timeline on the router and every node: served as Chrome "
        "trace JSON at GET /v1/traces/{id}, summarized in usage.trace_summary",
    )
    parser.add_argument(
        "--trace-dir",
        type=os.path.abspath,
        default=None,
        metavar="DIR",
        help="with --enable-tracing: also write each request's trace to DIR/<request id>.json "
        "(opens in ui.perfetto.dev)",
    )


def engine_args(args: argparse.Namespace):
    from engine.loader import EngineArgs

    return EngineArgs(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_tokens_cap=args.max_tokens_cap,
        kv_cache_tokens=args.kv_cache_tokens,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_backend=args.attention_backend,
        disable_cuda_graph=args.disable_cuda_graph,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        cuda_graph_max_prefill_tokens=args.cuda_graph_max_prefill_tokens,
        overlap_schedule=False if args.disable_overlap_schedule else None,
        speculative_algorithm=args.speculative_algorithm,
        draft_model=args.draft_model,
        num_draft_steps=args.num_draft_steps,
        num_draft_chains=args.num_draft_chains,
        debug_tensor_dump_dir=args.debug_tensor_dump_dir,
        debug_tensor_dump_layers=args.debug_tensor_dump_layers,
    )


def build_llm(args: argparse.Namespace):
    from engine import LLM

    # LLM takes every EngineArgs field as a keyword of the same name.
    return LLM(**dataclasses.asdict(engine_args(args)))


def run_demo(args: argparse.Namespace) -> None:
    from cluster.demo import run_cluster_demo

    run_cluster_demo(args)


API_KEY_VARIABLE = "PDCLUSTER_API_KEY"


def serve_api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The bearer token from --api-key, --api-key-file or $PDCLUSTER_API_KEY, one of them at
    most; the file and the variable keep it out of `ps`. An empty key would let anyone in."""
    sources: dict[str, str] = {}
    if args.api_key is not None:
        sources["--api-key"] = args.api_key
    if args.api_key_file is not None:
        sources["--api-key-file"] = _first_line(args.api_key_file)
    if API_KEY_VARIABLE in environ:
        sources[f"${API_KEY_VARIABLE}"] = environ[API_KEY_VARIABLE]
    if len(sources) > 1:
        raise ValueError(f"give the API key one way, not {' and '.join(sources)}")
    if not sources:
        return None
    [(source, key)] = sources.items()
    if not key.strip():
        raise ValueError(f"the API key from {source} is empty")
    return key.strip()


def _first_line(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            return file.readline()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read the API key file {path}: {err}") from err


def run_serve(args: argparse.Namespace) -> int:
    from cluster.config import DEFAULT_MAX_REQUEST_BYTES, ClusterConfig, ServeConfig
    from cluster.serve import serve
    from metadata.loopback import is_loopback

    config = ServeConfig(
        cluster=ClusterConfig(
            engine=engine_args(args),
            prefill_nodes=args.prefill_nodes,
            decode_nodes=args.decode_nodes,
            aggregated=args.aggregated,
            replicas=args.replicas,
            gpus_per_node=args.gpus_per_node,
            prefill_policy=args.prefill_policy,
            decode_policy=args.decode_policy,
            ray_address=args.ray_address,
            # Nothing of a local cluster behind a loopback-only API needs to be reachable
            # from elsewhere.
            loopback_only=args.ray_address is None and is_loopback(args.host),
            prefill_resource=args.prefill_resource,
            decode_resource=args.decode_resource,
            node_wait_s=args.wait_for_nodes,
            cpu_threads_per_node=args.cpu_threads_per_node,
            enable_tracing=args.enable_tracing,
            trace_dir=args.trace_dir,
            log_level=args.log_level,
            stats_log_interval_s=args.log_stats_interval,
            transfer_timeout_s=args.transfer_timeout,
            max_node_restarts=args.max_node_restarts,
            node_restart_backoff_s=args.node_restart_backoff,
            node_restart_backoff_max_s=max(60.0, args.node_restart_backoff),
            kv_audit_interval_s=args.kv_audit_interval,
        ),
        host=args.host,
        port=args.port,
        api_key=serve_api_key(args, os.environ),
        served_model_name=args.served_model_name,
        max_request_bytes=(
            DEFAULT_MAX_REQUEST_BYTES if args.max_request_bytes is None else args.max_request_bytes
        ),
        metrics_require_api_key=args.metrics_require_api_key,
        drain_timeout_s=args.drain_timeout,
        max_queued_requests=args.max_queued_requests,
        queue_timeout_s=args.queue_timeout,
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    return serve(config)


def run_generate(args: argparse.Namespace) -> None:
    from engine import SamplingParams

    llm = build_llm(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    if args.chat:
        [out] = llm.chat([[{"role": "user", "content": args.prompt}]], params)
    else:
        [out] = llm.generate([args.prompt], params)
    print(out.text)


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
