"""Reliability on the CPU: how fast a killed node's requests fail and its replacement serves,
per node kind, and a soak with injected transfer failures and a node killed in the middle.

    python bench/reliability.py kill [--model M] [--roles prefill decode replica]
    python bench/reliability.py mid-prefill [--model M]
    python bench/reliability.py soak [--model M] [--num-prompts 300] [--request-rate 2]
        [--max-concurrency N] [--fail-rate 0.05] [--kill decode-0] [--kill-after 60]

`kill`: for each role, a cluster (1 prefill + 1 decode node, or one aggregated replica) under a
stream of requests; the node is killed (ray.kill) while busy. kill-to-error: from the kill to
the last error of the requests in flight on it; kill-to-served: from the kill to the first
request served after it by the replacement. `mid-prefill`: eight 1,500-token prompts at once,
the prefill node killed while the decode node holds their slots with transfers in flight; how
long until the decode node holds nothing. `soak`: 1P1D with PDCLUSTER_FAULT_TRANSFER_FAIL_RATE
set (phases before, during and after the send) behind the HTTP API, loaded by
`pdcluster bench serving`; the node named by --kill is killed --kill-after seconds in. It
reports the bench's completed, failed and lost requests (lost must be 0), the restarts, and
whether every pool is empty at the end (it must be). Each prints a table and writes JSON to
bench/results/."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))  # the request stream the tests use

import ray  # noqa: E402
from healing_helpers import RequestStream, one_request, wait_for_node  # noqa: E402

from cluster.deploy.config import ClusterConfig  # noqa: E402
from cluster.deploy.launcher import Cluster, init_ray  # noqa: E402
from cluster.frontend.openai_api import BackgroundServer, create_app  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.loading.loader import EngineArgs  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PROMPT = list(range(100, 612))  # 512 tokens
MAX_TOKENS = 32


def launch(args: argparse.Namespace, aggregated: bool) -> Cluster:
    if not ray.is_initialized():
        init_ray(None)
    engine = EngineArgs(model=args.model, device="cpu", kv_cache_tokens=args.kv_cache_tokens)
    extra = dict(aggregated=True, replicas=1) if aggregated else {}
    return Cluster.launch(
        ClusterConfig(engine=engine, transfer_timeout_s=30.0, log_level="warning", **extra)
    )


async def time_kill(cluster: Cluster, victim: str) -> dict:
    router = cluster.router
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    stream = RequestStream(router, PROMPT, params, workers=4)
    stream.start()
    role, index = victim.split("-")
    slots = cluster.prefill_slots if role == "prefill" else cluster.decode_slots
    actor = slots[int(index)].actor
    while len(stream.outcomes) < 4:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # mid-request: the stream keeps the node busy
    killed_at = time.monotonic()
    ray.kill(actor)
    served_at = None
    while served_at is None:
        outcome = await one_request(router, "probe", PROMPT, params)
        if outcome.error is None and outcome.started > killed_at:
            served_at, served_took = outcome.ended, outcome.ended - outcome.started
        elif outcome.error is not None:
            await asyncio.sleep(0.25)
    await stream.stop()
    hit = stream.in_flight_at(killed_at)
    errors = [o for o in hit if o.error is not None]
    node = await wait_for_node(router, victim, "ok", 60, restarts=1)
    state = next(n for n in router.prefill_nodes + router.decode_nodes if n.name == victim)
    history = cluster.supervisor.history(state)
    down_at = next(at for at, what in history if what.startswith("down"))
    restarted = next(what for _, what in history if what.startswith("restarted"))
    return {
        "node": victim,
        "in_flight_at_kill": len(hit),
        "failed": len(errors),
        "failed_naming_node": sum(f"{victim} died" in o.error for o in errors),
        "kill_to_error_s": max((o.ended - killed_at for o in errors), default=None),
        "kill_to_detected_s": down_at - killed_at,
        "replacement": restarted,  # from its start to serving, backoff excluded
        "kill_to_served_s": served_at - killed_at,
        "served_request_s": served_took,  # the served request's own time, under the stream
        "restarts": node["restarts"],
    }


async def kill_and_close(cluster: Cluster, victim: str) -> dict:
    try:
        return await time_kill(cluster, victim)
    finally:
        await cluster.router.close()


def run_kill(args: argparse.Namespace) -> list[dict]:
    rows = []
    for role in args.roles:
        cluster = launch(args, aggregated=role == "replica")
        try:
            row = asyncio.run(kill_and_close(cluster, f"{role}-0"))
            deadline = time.monotonic() + 60
            while not cluster.kv_pools_empty() and time.monotonic() < deadline:
                time.sleep(0.5)
            row["pools_empty"] = cluster.kv_pools_empty()
        finally:
            cluster.shutdown()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def run_mid_prefill(args: argparse.Namespace) -> dict:
    """8 prompts of 1,500 tokens sent at once; the prefill node is killed once the decode node
    holds their preallocated slots with transfers in flight. How long until the decode node
    holds nothing."""
    cluster = launch(args, aggregated=False)
    decode = cluster.decode_slots[0].actor
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [[100 + (i * 31 + j) % 20000 for j in range(1500)] for i in range(8)]

    async def main() -> dict:
        router = cluster.router
        try:
            tasks = [
                asyncio.create_task(one_request(router, f"p{i}", prompt, params))
                for i, prompt in enumerate(prompts)
            ]
            while True:
                stats = await decode.stats.remote()
                if stats["transfers_in_flight"] > 0 and stats["kv_used"] > 0:
                    break
                await asyncio.sleep(0.05)
            killed_at = time.monotonic()
            ray.kill(cluster.prefill_slots[0].actor)
            outcomes = await asyncio.gather(*tasks)
            while True:
                now = await decode.stats.remote()
                if now["kv_used"] == 0 and now["transfers_in_flight"] == 0:
                    break
                await asyncio.sleep(0.05)
            emptied_s = time.monotonic() - killed_at
            await wait_for_node(router, "prefill-0", "ok", 120, restarts=1)
            return {
                "decode_kv_used_at_kill": stats["kv_used"],
                "transfers_in_flight_at_kill": stats["transfers_in_flight"],
                "failed": sum(o.error is not None for o in outcomes),
                "failed_naming_prefill": sum("prefill-0" in (o.error or "") for o in outcomes),
                "kill_to_last_error_s": max(o.ended for o in outcomes) - killed_at,
                "kill_to_decode_empty_s": emptied_s,
            }
        finally:
            await router.close()

    try:
        row = asyncio.run(main())
        row["pools_empty"] = cluster.kv_pools_empty()
    finally:
        cluster.shutdown()
    print(json.dumps(row), flush=True)
    return row


def run_soak(args: argparse.Namespace) -> dict:
    os.environ["PDCLUSTER_FAULT_TRANSFER_FAIL_RATE"] = str(args.fail_rate)
    os.environ["PDCLUSTER_FAULT_TRANSFER_FAIL_PHASE"] = "before,during,after"
    cluster = launch(args, aggregated=False)
    server = BackgroundServer(create_app(cluster.router)).start()
    out = Path(tempfile.mkdtemp(prefix="soak-"))
    killed: dict = {}

    def kill_later() -> None:
        time.sleep(args.kill_after)
        role, index = args.kill.split("-")
        slots = cluster.prefill_slots if role == "prefill" else cluster.decode_slots
        killed["at_s"] = args.kill_after
        ray.kill(slots[int(index)].actor)

    try:
        threading.Thread(target=kill_later, daemon=True).start()
        started = time.monotonic()
        bench = [sys.executable, "-m", "cluster.commands.cli", "bench", "serving"]
        bench += ["--url", server.url]
        bench += ["--dataset", "random", "--input-len", str(args.input_len)]
        bench += ["--output-len", str(args.output_len), "--range-ratio", "0.5"]
        bench += ["--num-prompts", str(args.num_prompts), "--seed", "0"]
        bench += ["--request-rate", str(args.request_rate), "--tokenizer", args.model]
        bench += ["--output-dir", str(out), "--disable-tqdm", "--timeout", "300"]
        if args.max_concurrency is not None:
            bench += ["--max-concurrency", str(args.max_concurrency)]
        subprocess.run(bench, check=True, cwd=ROOT)
        duration = time.monotonic() - started
        summary = json.loads((out / "results.jsonl").read_text().splitlines()[-1])
        deadline = time.monotonic() + 60
        while not cluster.kv_pools_empty() and time.monotonic() < deadline:
            time.sleep(0.5)
        stats = cluster.node_stats()
        row = {
            "num_prompts": args.num_prompts,
            "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency,
            "fail_rate": args.fail_rate,
            "killed": args.kill,
            "killed_at_s": killed.get("at_s"),
            "duration_s": round(duration, 1),
            "completed": summary["completed"],
            "failed": summary["failed"],
            "lost": summary["lost"],
            "errors": summary["errors"],
            "restarts": [
                n.restarts for n in cluster.router.prefill_nodes + cluster.router.decode_nodes
            ],
            "pools_empty": cluster.kv_pools_empty(),
            "kv_used": {s.get("node"): s.get("kv_used") for s in stats},
            "faults_injected": {s.get("node"): s.get("faults_injected") for s in stats},
            "kv_audit_mismatches": {s.get("node"): s.get("kv_audit_mismatches") for s in stats},
        }
    finally:
        server.stop()
        cluster.shutdown()
    print(json.dumps(row, indent=1), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["kill", "mid-prefill", "soak"])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--kv-cache-tokens", type=int, default=32768)
    parser.add_argument("--roles", nargs="+", default=["prefill", "decode", "replica"])
    parser.add_argument("--num-prompts", type=int, default=300)
    parser.add_argument("--request-rate", type=float, default=2.0)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--fail-rate", type=float, default=0.05)
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="soak: at most this many requests in flight (a closed loop, which a CPU can keep up "
        "with; with --request-rate inf it sends as fast as they finish)",
    )
    parser.add_argument("--kill", default="decode-0")
    parser.add_argument("--kill-after", type=float, default=60.0)
    args = parser.parse_args()
    if args.model is None:
        from engine.loading.default_model import default_model_path

        args.model = str(default_model_path())
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.mode == "kill":
        result = {"kill": run_kill(args)}
        path = RESULTS / "reliability_kill.json"
    elif args.mode == "mid-prefill":
        result = {"mid_prefill": run_mid_prefill(args)}
        path = RESULTS / "reliability_mid_prefill.json"
    else:
        result = {"soak": run_soak(args)}
        path = RESULTS / "reliability_soak.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
