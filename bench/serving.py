"""Serving under load, side by side: the disaggregated cluster against the aggregated mode on the
same hardware, each loaded by `pdcluster bench serving` over HTTP.

    python bench/serving.py --setups aggregated 1p1d 2p1d [--gpus-per-node 0.5]
        [--speculative off on] [--prefix-cache on off] [--prefill-policies cache_aware round_robin]
        [--decode-reuse on off]
        [--datasets random chat shared-prefix multiturn] [--input-len 1024] [--output-len 128]
        [--num-prompts 200] [--prefix-groups 8 --prompts-per-group 16 --system-prompt-len 1500
        --question-len 128] [--num-conversations N --concurrent-conversations 16]
        [--request-rates 4 16 inf] [--max-concurrency N] [--slo-ttft-ms 1000 --slo-tpot-ms 50]
        [--model PATH] [--device cpu|cuda] [--section TITLE]

Each setup (and speculation on or off) is launched in this process (Ray, the router behind the
HTTP API on a free port), loaded with every dataset and rate, then checked: every node's KV pools
must be empty once the load is over (read from the nodes); the KV the decode nodes received per
transfer, and the share of prompt positions they reused instead (decode_node.reuse), come from
their counters. Prints one table and rewrites the
section TITLE of docs/BENCHMARKS.md (raw figures in docs/bench/<slug>.json). A soak is the same
script with one setup, one rate and many short requests."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from bench.report import write_section  # noqa: E402
from cluster.bench_serving.dataset_args import FLAG_DATASETS  # noqa: E402
from cluster.control.cache_aware import DEFAULT_LOAD_THRESHOLD  # noqa: E402
from cluster.control.policies import POLICIES  # noqa: E402
from cluster.deploy.config import ClusterConfig  # noqa: E402
from cluster.deploy.launcher import Cluster, describe_nodes, init_ray  # noqa: E402
from cluster.frontend.openai_api import BackgroundServer, create_app  # noqa: E402
from engine.loading.loader import EngineArgs  # noqa: E402
from engine.loading.weights import resolve_model  # noqa: E402
from spec.default_draft import resolve_draft_model  # noqa: E402

# A setup's name and its prefill nodes (none: aggregated); one decode node or replica each.
SETUPS = {"aggregated": 0, "1p1d": 1, "2p1d": 2}
DATASETS = ["random", "chat", "shared-prefix", "multiturn"]  # file: needs a path of its own
POOLS_DRAIN_S = 60.0


@dataclass(frozen=True)
class Setup:
    name: str  # a key of SETUPS
    speculative: bool
    prefix_cache: bool = True
    prefill_policy: str = "round_robin"  # named in the label where it chooses (2 prefill nodes)
    decode_reuse: bool = True  # decode nodes reuse the KV they hold (named in the label off)

    @property
    def label(self) -> str:
        spec = " + spec" if self.speculative else ""
        policy = f", {self.prefill_policy}" if SETUPS[self.name] > 1 else ""
        cache = "" if self.prefix_cache else ", no prefix cache"
        reuse = "" if self.decode_reuse or not SETUPS[self.name] else ", no decode reuse"
        return f"{self.name}{spec}{policy}{cache}{reuse}"


def setups_of(args: argparse.Namespace) -> list[Setup]:
    """One setup per (prefix cache, decode reuse, speculation, setup name, prefill policy) asked
    for; the policies only for setups of more than one prefill node, where there is a choice,
    and decode reuse only for disaggregated ones."""
    return [
        Setup(name, spec == "on", cache == "on", policy, reuse == "on")
        for cache in args.prefix_cache
        for reuse in args.decode_reuse
        for spec in args.speculative
        for name in args.setups
        for policy in (args.prefill_policies if SETUPS[name] > 1 else ["round_robin"])
        if SETUPS[name] or reuse == args.decode_reuse[0]
    ]


def cluster_config(setup: Setup, args: argparse.Namespace) -> ClusterConfig:
    engine = EngineArgs(
        model=args.model,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        kv_cache_tokens=args.kv_cache_tokens,
        speculative_algorithm="multi-layer-eagle" if setup.speculative else None,
        draft_model=args.draft_model if setup.speculative else None,
        overlap_schedule=False if args.disable_overlap_schedule else None,
        mixed_prefill=not args.disable_mixed_prefill,
        cuda_graph_max_prefill_tokens=args.cuda_graph_max_prefill_tokens,
        enable_prefix_cache=setup.prefix_cache,
    )
    common = dict(
        engine=engine,
        cpu_threads_per_node=args.cpu_threads_per_node,
        stats_log_interval_s=0.0,
        log_level="warning",
    )
    if setup.name == "aggregated":
        return ClusterConfig(aggregated=True, replicas=args.replicas, **common)
    return ClusterConfig(
        prefill_nodes=SETUPS[setup.name],
        decode_nodes=1,
        gpus_per_node=args.gpus_per_node,
        prefill_policy=setup.prefill_policy,
        cache_aware_load_threshold=args.cache_aware_load_threshold,
        decode_reuse=setup.decode_reuse,
        **common,
    )


def bench_flags(args: argparse.Namespace, url: str, dataset: str, out: Path) -> list[str]:
    """The load generator's flags for `dataset`: each dataset's own, where given, and
    --num-prompts and --max-concurrency only where the dataset takes them."""
    flags = ["--url", url, "--endpoint", args.endpoint, "--dataset", dataset]
    flags += ["--seed", str(args.seed)]
    flags += ["--request-rate", *[str(rate) for rate in args.request_rates]]
    flags += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    flags += ["--range-ratio", str(args.range_ratio), "--output-dir", str(out)]
    flags += ["--tokenizer", str(args.model), "--timeout", str(args.timeout)]
    for dest, datasets in FLAG_DATASETS.items():
        value = args.num_prompts if dest == "num_prompts" else getattr(args, dest, None)
        if value and dataset in datasets:
            flags += ["--" + dest.replace("_", "-"), str(value)]
    if args.slo_ttft_ms is not None:
        flags += ["--slo-ttft-ms", str(args.slo_ttft_ms)]
    if args.slo_tpot_ms is not None:
        flags += ["--slo-tpot-ms", str(args.slo_tpot_ms)]
    if not args.progress:
        flags.append("--disable-tqdm")
    return flags


def run_setup(setup: Setup, args: argparse.Namespace, workdir: Path) -> list[dict]:
    """Launch the setup, load it with every dataset, check its pools; one row per run."""
    config = cluster_config(setup, args)
    print(f"\n=== {setup.label}: {describe_nodes(config)} ===", flush=True)
    started = time.perf_counter()
    cluster = Cluster.launch(config)
    launch_s = time.perf_counter() - started
    server = BackgroundServer(create_app(cluster.router)).start()
    rows = []
    try:
        for dataset in args.datasets:
            out = workdir / re.sub(r"\W+", "-", f"{setup.label}-{dataset}")
            # The load generator runs in a process of its own, as a user's would: sharing this
            # process's interpreter with the router would delay both and bunch the tokens.
            command = [sys.executable, "-m", "cluster.commands.cli", "bench", "serving"]
            before = received(cluster)
            code = subprocess.run(command + bench_flags(args, server.url, dataset, out)).returncode
            if code != 0:
                raise SystemExit(f"the load generator stopped with code {code} on {setup.label}")
            runs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
            # The run's own "dataset" (name, lengths, path) gives way to the name; the transfer
            # figures cover all the dataset's runs (one per rate).
            transfers = transfer_figures(before, received(cluster))
            rows += [{**run, "setup": setup.label, "dataset": dataset, **transfers} for run in runs]
        pools_empty = _pools_drain(cluster)
        for row in rows:
            row["pools_empty"] = pools_empty
            row["launch_s"] = round(launch_s, 1)
    finally:
        server.stop()
        cluster.shutdown()
    return rows


RECEIVED = ("count", "bytes", "kv_tokens", "reused_tokens")


def received(cluster: Cluster) -> dict[str, int] | None:
    """The decode nodes' receive totals, summed (None for an aggregated setup)."""
    totals = [s["transfers"] for s in cluster.node_stats() if "transfers" in s]
    totals = [t for t in totals if t["direction"] == "receive"]
    if not totals:
        return None
    return {key: sum(t.get(key, 0) for t in totals) for key in RECEIVED}


def transfer_figures(before: dict | None, after: dict | None) -> dict:
    """KV bytes received per transfer, and the share of prompt positions that the decode
    nodes reused instead of receiving, between two `received` readings."""
    if before is None or after is None or after["count"] == before["count"]:
        return {}
    delta = {key: after[key] - before[key] for key in RECEIVED}
    positions = delta["kv_tokens"] + delta["reused_tokens"]
    return {
        "transfers": delta["count"],
        "kv_bytes_per_transfer": delta["bytes"] / delta["count"],
        "kv_tokens_per_transfer": delta["kv_tokens"] / delta["count"],
        "reused_share": delta["reused_tokens"] / positions if positions else 0.0,
    }


def _pools_drain(cluster: Cluster) -> bool:
    """Whether every node's pools are empty, allowing a moment for the last frees."""
    deadline = time.monotonic() + POOLS_DRAIN_S
    while not cluster.kv_pools_empty():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def table(rows: list[dict]) -> str:
    header = (
        "| setup | dataset | rate/s | done/failed/lost | req/s | out tok/s | TTFT p50 / p99 ms "
    )
    header += "| first / later turns TTFT p50 ms "
    header += "| ITL p50 / p99 ms | TPOT p50 ms | goodput/s | accept len | cached % "
    header += "| KV KB / transfer | reused % | pools empty |"
    lines = [header, "| " + " | ".join(["---"] * 16) + " |"]
    for row in rows:
        ttft, itl, tpot = row["ttft_ms"], row["itl_ms"], row["tpot_ms"]
        accept = row.get("spec_accept_length")
        cells = [
            row["setup"],
            row["dataset"],
            str(row["request_rate"]),
            f"{row['completed']}/{row['failed']}/{row['lost']}",
            _fmt(row["request_throughput"], 2),
            _fmt(row["output_token_throughput"], 0),
            f"{_fmt(ttft['p50'], 0)} / {_fmt(ttft['p99'], 0)}",
            _by_turn(row),
            f"{_fmt(itl['p50'], 1)} / {_fmt(itl['p99'], 1)}",
            _fmt(tpot["p50"], 1),
            _fmt(row.get("goodput"), 2),
            _fmt(accept, 2),
            _fmt(None if row.get("cached_share") is None else 100 * row["cached_share"], 1),
            _fmt(_scaled(row.get("kv_bytes_per_transfer"), 1e-3), 0),
            _fmt(_scaled(row.get("reused_share"), 100), 1),
            "yes" if row["pools_empty"] else "**no**",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _by_turn(row: dict) -> str:
    """A multi-turn run's TTFT p50 over first turns and over the later ones; "-" otherwise."""
    first, later = row.get("first_turns_ttft_ms"), row.get("later_turns_ttft_ms")
    if first is None or later is None:
        return "-"
    return f"{_fmt(first['p50'], 0)} / {_fmt(later['p50'], 0)}"


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=["aggregated", "1p1d"])
    parser.add_argument("--speculative", nargs="+", choices=["off", "on"], default=["off"])
    parser.add_argument(
        "--prefix-cache", nargs="+", choices=["on", "off"], default=["on"],
        help="each setup with the engines' prefix cache on (the default) and/or off",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-policies", nargs="+", choices=sorted(POLICIES), default=["round_robin"],
        help="setups of several prefill nodes (2p1d) once per policy named",
    )  # fmt: skip
    parser.add_argument(
        "--decode-reuse", nargs="+", choices=["on", "off"], default=["on"],
        help="disaggregated setups with decode nodes reusing the KV they hold (the default) "
        "and/or receiving every prompt whole (--disable-decode-reuse)",
    )  # fmt: skip
    parser.add_argument(
        "--cache-aware-load-threshold", type=int, default=DEFAULT_LOAD_THRESHOLD,
        help="as pdcluster's flag",
    )  # fmt: skip
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument(
        "--draft-model", default=None, help="with --speculative on (default: the shipped draft)"
    )
    parser.add_argument("--device", default=None, help="default: cuda when Ray sees a GPU")
    parser.add_argument("--replicas", type=int, default=1, help="aggregated replicas")
    parser.add_argument("--gpus-per-node", type=float, default=1.0, help="1p1d: GPU share")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--cpu-threads-per-node", type=int, default=1)
    parser.add_argument(
        "--disable-overlap-schedule", action="store_true", help="as pdcluster's flag, for A/B runs"
    )
    parser.add_argument(
        "--disable-mixed-prefill", action="store_true", help="as pdcluster's flag, for A/B runs"
    )
    parser.add_argument(
        "--cuda-graph-max-prefill-tokens", type=int, default=None, help="as pdcluster's flag"
    )
    parser.add_argument("--endpoint", default="completions", choices=["chat", "completions"])
    parser.add_argument("--datasets", nargs="+", default=["random"], choices=DATASETS)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--request-rates", nargs="+", default=["inf"])
    parser.add_argument("--max-concurrency", type=int, default=None)
    # shared-prefix and multiturn, as `pdcluster bench serving` takes them (its defaults if unset)
    for flag in ("--prefix-groups", "--prompts-per-group", "--system-prompt-len"):
        parser.add_argument(flag, type=int, default=None)
    for flag in ("--question-len", "--num-conversations", "--concurrent-conversations"):
        parser.add_argument(flag, type=int, default=None)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-tpot-ms", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--progress", action="store_true", help="show a progress bar per run")
    parser.add_argument("--section", default="Serving under load")
    args = parser.parse_args(argv)
    # The shipped draft goes with the default model, which the setups name by its path.
    args.draft_model = resolve_draft_model(args.model, args.draft_model)
    args.model = str(resolve_model(args.model))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    init_ray(None)
    setups = setups_of(args)
    rows: list[dict] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        for setup in setups:
            rows += run_setup(setup, args, Path(workdir))
            # Written after every setup: a later setup that fails keeps the earlier rows.
            report(rows, args, argv, time.perf_counter() - started, done=setup == setups[-1])
    ray.shutdown()
    print("\n" + table(rows))


def report(rows: list[dict], args: argparse.Namespace, argv, elapsed: float, done: bool) -> None:
    command = "python bench/serving.py " + " ".join(sys.argv[1:] if argv is None else argv)
    partial = "" if done else " (not every setup has run yet)"
    body = (
        f"`{command}`\n\n{_hardware(args)}; {args.num_prompts} prompts per run of random or "
        "chat, dataset lengths "
        f"{args.input_len} in / {args.output_len} out for `random`; SLO: TTFT "
        f"{args.slo_ttft_ms or '-'} ms, TPOT {args.slo_tpot_ms or '-'} ms; {elapsed:.0f} s"
        f"{partial}.\n\n"
        f"{table(rows)}\n"
    )
    slug = re.sub(r"\W+", "_", args.section.lower()).strip("_")
    raw = {"command": command, "elapsed_s": elapsed, "complete": done, "rows": rows}
    write_section(args.section, body, raw, f"{slug}.json")


def _hardware(args: argparse.Namespace) -> str:
    import os

    import torch

    if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"):
        return f"{torch.cuda.get_device_name()}, bfloat16"
    return f"CPU ({os.cpu_count()} cores), float32, {args.cpu_threads_per_node} thread(s) per node"


if __name__ == "__main__":
    main()
