"""The front end under load: `pdcluster serve` (one or several API processes) streamed to by
`pdcluster bench serving`, with the CPU time of the serving processes read from /proc per
streamed token, and on a GPU the offline engine's tokens/s beside the served ones, in one run.

    python bench/front_end.py [--device cpu|cuda] [--model PATH | --random-model smollm2|llama8b]
        [--setups aggregated 1p1d] [--api-servers 1 2 4] [--concurrency 32 64]
        [--input-len 16] [--output-len 128] [--prompts-per-stream 3] [--stream-interval 1]
        [--gpus-per-node 0.5] [--offline] [--client-processes 1] [--serve-root DIR]
        [--before-root DIR]
        [--section TITLE | --no-write]

Each (setup, API processes) is one `pdcluster serve`, started from --serve-root (default: this
checkout; another checkout measures another version of the code with the same load); each
concurrency is one closed-loop run of concurrency x prompts-per-stream requests of input-len
random tokens answering output-len tokens (EOS ignored), after a warm-up. CPU per token:

- front end: utime + stime of the API processes (the serve process itself when it serves the
  port alone) over the run, divided by the output tokens;
- controller: the serve process when API processes serve the port (Ray's driver, the nodes'
  probes, the status it sends every second);

the nodes (Ray actors) and the load generator are not counted. Since a process also spends
CPU every second whatever the load (Ray's driver threads, the nodes' probes), the front end's
idle rate is measured too (ms a second, over --idle-seconds with no request, after the warm-up),
and "above idle": the run's CPU less that rate over the run's wall time, per token. On a host
shared with other work the tokens/s vary from run to run, and with them the share of the idle
rate in the per-token figure, which the above-idle figure leaves out.

With --offline the same prompts go through `engine.LLM` at batch = concurrency first (the
engine alone: no HTTP, no Ray; on a CPU with a node's torch threads). A second table says where
each generating node's time went over each run, from the cluster's /metrics (bench.node_loop):
its engine's steps by kind, tokens a step, time a step, and its serving thread's time by part,
the offline engine's steps beside them. Prints one table and rewrites the section TITLE of
docs/BENCHMARKS.md (raw figures in docs/bench/<slug>.json)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.node_loop import loop_table, node_counters, node_figures  # noqa: E402
from bench.report import write_section  # noqa: E402

SETUPS = ("aggregated", "1p1d")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process, in seconds (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def api_process_pids(serve_pid: int) -> list[int]:
    """The serve process's API processes (cluster.frontend.api_process), by their command line."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = int(stat.rpartition(")")[2].split()[1])
        if parent == serve_pid and b"cluster.frontend.api_process" in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


class Serve:
    """One `pdcluster serve` in a process of its own."""

    def __init__(
        self, args: argparse.Namespace, setup: str, api_servers: int, log: Path, root: Path
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "cluster.commands.cli", "serve", "--port", str(self.port)]
        command += ["--device", args.device, "--max-num-seqs", str(max(args.concurrency))]
        # Given only where they differ from the default, so that a checkout from before these
        # flags (--serve-root) serves too.
        if api_servers != 1:
            command += ["--api-servers", str(api_servers)]
        if args.stream_interval != 1:
            command += ["--stream-interval", str(args.stream_interval)]
        command += ["--log-level", "warning", "--log-stats-interval", "0"]
        if args.model:
            command += ["--model", args.model]
        if args.kv_cache_tokens:
            command += ["--kv-cache-tokens", str(args.kv_cache_tokens)]
        if args.cpu_threads_per_node != 1:
            command += ["--cpu-threads-per-node", str(args.cpu_threads_per_node)]
        if setup == "aggregated":
            command += ["--aggregated", "--replicas", "1"]
        elif args.gpus_per_node is not None:
            command += ["--gpus-per-node", str(args.gpus_per_node)]
        command += args.serve_flags
        self.log = log
        with log.open("w") as output:
            self.process = subprocess.Popen(
                command,
                cwd=root,
                stdout=output,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def wait_until_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"pdcluster serve exited:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"pdcluster serve did not serve in {timeout_s:.0f} s")

    def front_end_pids(self) -> list[int]:
        return api_process_pids(self.process.pid) or [self.process.pid]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def load(args: argparse.Namespace, url: str, concurrency: int, prompts: int, out: Path) -> dict:
    """One closed-loop run of `prompts` requests, `concurrency` at a time, spread over
    --client-processes load generators; their figures summed (throughput) or combined."""
    clients = max(1, min(args.client_processes, concurrency))
    runs = []
    processes = []
    for client in range(clients):
        share = concurrency // clients + (client < concurrency % clients)
        directory = out / f"client-{client}"
        command = [sys.executable, "-m", "cluster.commands.cli", "bench", "serving", "--url", url]
        command += ["--endpoint", args.endpoint, "--dataset", "random", "--ignore-eos"]
        command += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
        command += ["--num-prompts", str(max(1, prompts * share // concurrency))]
        command += ["--max-concurrency", str(share), "--seed", str(client)]
        command += ["--output-dir", str(directory), "--disable-tqdm"]
        if args.tokenizer:
            command += ["--tokenizer", args.tokenizer]
        processes.append(
            (subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL), directory)
        )
    for process, directory in processes:
        if process.wait() != 0:
            raise SystemExit(f"the load generator stopped with code {process.returncode}")
        run = json.loads((directory / "results.jsonl").read_text().splitlines()[-1])
        if not run["completed"]:
            raise SystemExit(f"no request completed ({run['failed']} failed): {run['errors']}")
        runs.append(run)
    duration = max(run["duration_s"] for run in runs)
    return {
        "completed": sum(run["completed"] for run in runs),
        "failed": sum(run["failed"] + run["lost"] for run in runs),
        "output_tokens": sum(run["total_output_tokens"] for run in runs),
        "duration_s": duration,
        "output_tokens_per_s": sum(run["total_output_tokens"] for run in runs) / duration,
        # Each client's percentiles: the mean of the medians, the worst of the tails.
        "ttft_p50_ms": sum(run["ttft_ms"]["p50"] for run in runs) / len(runs),
        "ttft_p99_ms": max(run["ttft_ms"]["p99"] for run in runs),
        "itl_p50_ms": sum(run["itl_ms"]["p50"] for run in runs) / len(runs),
        "itl_p99_ms": max(run["itl_ms"]["p99"] for run in runs),
    }


def measure(
    args: argparse.Namespace, setup: str, api_servers: int, work: Path, before: bool = False
) -> list[dict]:
    """`before`: served from --before-root."""
    label = f"{setup}, {api_servers} API process{'es' if api_servers > 1 else ''}"
    print(f"\n=== {label}{' (before)' if before else ''} ===", flush=True)
    root = args.before_root if before else args.serve_root
    tag = f"{setup}-{api_servers}{'-before' if before else ''}"
    serve = Serve(args, setup, api_servers, work / f"serve-{tag}.log", root)
    rows = []
    try:
        serve.wait_until_serving(args.startup_timeout)
        front_ends = serve.front_end_pids()
        controller = serve.process.pid if api_servers > 1 else None
        # One prompt per stream at the largest concurrency first: the first requests at a
        # batch size pay for what runs once (allocations, the first replays), which a short
        # measured run would count.
        warm = work / f"warm-{tag}"
        load(args, serve.url, max(args.concurrency), max(args.concurrency), warm)
        idle_rate = idle_cpu_rate(front_ends, args.idle_seconds)
        for concurrency in args.concurrency:
            cpu_before = [cpu_seconds(pid) for pid in front_ends]
            controller_before = cpu_seconds(controller) if controller else 0.0
            out = work / f"run-{tag}-{concurrency}"
            counters = node_counters(serve.url)
            started = time.monotonic()
            figures = load(args, serve.url, concurrency, concurrency * args.prompts_per_stream, out)
            wall_s = time.monotonic() - started
            nodes = node_figures(counters, node_counters(serve.url), figures["duration_s"])
            front_end_s = sum(cpu_seconds(pid) for pid in front_ends) - sum(cpu_before)
            controller_s = (cpu_seconds(controller) - controller_before) if controller else 0.0
            tokens = max(1, figures["output_tokens"])
            row = {
                "setup": f"{setup} (before)" if before else setup,
                "api_servers": api_servers,
                "concurrency": concurrency,
                **figures,
                "front_end_cpu_s": round(front_end_s, 3),
                "front_end_us_per_token": round(front_end_s / tokens * 1e6, 1),
                "front_end_idle_ms_per_s": round(idle_rate * 1e3, 2),
                "front_end_above_idle_us_per_token": round(
                    (front_end_s - idle_rate * wall_s) / tokens * 1e6, 1
                ),
                "controller_us_per_token": round(controller_s / tokens * 1e6, 1),
                "nodes": nodes,
            }
            rows.append(row)
            print(
                f"{concurrency} streams: {figures['output_tokens_per_s']:.0f} tok/s, front end "
                f"{row['front_end_us_per_token']} us/token "
                f"({row['front_end_above_idle_us_per_token']} above its idle "
                f"{row['front_end_idle_ms_per_s']} ms/s)",
                flush=True,
            )
    finally:
        serve.stop()
    return rows


def idle_cpu_rate(pids: list[int], seconds: float) -> float:
    """CPU seconds a second the processes spend with no request in flight."""
    if seconds <= 0:
        return 0.0
    time.sleep(1.0)  # the warm-up's last responses settle
    before, started = sum(cpu_seconds(pid) for pid in pids), time.monotonic()
    time.sleep(seconds)
    return (sum(cpu_seconds(pid) for pid in pids) - before) / (time.monotonic() - started)


def offline_rows(args: argparse.Namespace) -> list[dict]:
    """The engine alone at batch = concurrency: the same random prompts, in a process of its
    own (so that its memory is gone before the served setups start)."""
    rows = []
    for concurrency in args.concurrency:
        code = OFFLINE.format(
            root=str(ROOT),
            model=repr(args.model),
            device=repr(args.device),
            batch=concurrency,
            prompts=concurrency * args.prompts_per_stream,
            input_len=args.input_len,
            output_len=args.output_len,
            kv_cache_tokens=repr(args.kv_cache_tokens),
            cpu_threads=args.cpu_threads_per_node,
        )
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True
        )
        if result.returncode != 0:
            raise SystemExit(f"the offline engine failed:\n{result.stderr[-4000:]}")
        figures = json.loads(result.stdout.strip().splitlines()[-1])
        rows.append({"setup": "offline engine", "api_servers": 0, "concurrency": concurrency,
                     **figures})  # fmt: skip
        print(f"offline, batch {concurrency}: {figures['output_tokens_per_s']:.0f} tok/s")
    return rows


OFFLINE = """
import json, random, sys, time
sys.path.insert(0, {root!r})
from engine import LLM, SamplingParams
import torch
from bench.node_loop import offline_figures
if {device} == "cpu":
    torch.set_num_threads({cpu_threads})  # as many as a served node has
llm = LLM({model}, device={device}, max_num_seqs={batch}, kv_cache_tokens={kv_cache_tokens})
rng = random.Random(0)
vocab = llm.engine.runner.model_config.vocab_size
prompts = [[rng.randrange(3, vocab) for _ in range({input_len})] for _ in range({prompts})]
params = SamplingParams(max_tokens={output_len}, temperature=0, ignore_eos=True)
llm.generate(prompts[: min(8, len(prompts))], SamplingParams(max_tokens=8, ignore_eos=True))
before = llm.engine.step_counts()
start = time.perf_counter()
outputs = llm.generate(prompts, params)
elapsed = time.perf_counter() - start
after = llm.engine.step_counts().as_dict()
steps = {{kind: after[kind] - n for kind, n in before.as_dict().items()}}
tokens = sum(len(o.token_ids) for o in outputs)
print(json.dumps({{"output_tokens": tokens, "duration_s": elapsed,
                   "output_tokens_per_s": tokens / elapsed,
                   "nodes": [offline_figures(tokens, elapsed, steps)]}}))
"""


def table(rows: list[dict]) -> str:
    offline = {row["concurrency"]: row for row in rows if row["setup"] == "offline engine"}
    lines = [
        "| setup | API processes | streams | out tok/s | of offline | TTFT p50 / p99 ms "
        "| ITL p50 / p99 ms | front end us/token | above idle us/token | idle ms/s "
        "| controller us/token |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        if row["setup"] == "offline engine":
            lines.append(
                f"| offline engine | - | {row['concurrency']} (batch) "
                f"| {row['output_tokens_per_s']:,.0f} | 100 % | - | - | - | - | - | - |"
            )
            continue
        reference = offline.get(row["concurrency"])
        share = (
            f"{100 * row['output_tokens_per_s'] / reference['output_tokens_per_s']:.0f} %"
            if reference
            else "-"
        )
        controller = row["controller_us_per_token"] if row["api_servers"] > 1 else "-"
        lines.append(
            f"| {row['setup']} | {row['api_servers']} | {row['concurrency']} "
            f"| {row['output_tokens_per_s']:,.0f} | {share} "
            f"| {row['ttft_p50_ms']:,.0f} / {row['ttft_p99_ms']:,.0f} "
            f"| {row['itl_p50_ms']:.1f} / {row['itl_p99_ms']:.1f} "
            f"| {row['front_end_us_per_token']} "
            f"| {row.get('front_end_above_idle_us_per_token', '-')} "
            f"| {row.get('front_end_idle_ms_per_s', '-')} | {controller} |"
        )
    return "\n".join(lines)


def random_model_folder(args: argparse.Namespace, work: Path) -> None:
    from bench.random_models import random_model

    folder = work / args.random_model
    random_model(args.random_model, folder, args.device if args.device != "cpu" else "cpu")
    args.model = str(folder)
    args.tokenizer = args.tokenizer or str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--random-model", default=None, help="random weights of this shape")
    parser.add_argument("--tokenizer", default=None, help="the load generator's (default: model)")
    parser.add_argument("--setups", nargs="+", default=["aggregated"], choices=SETUPS)
    parser.add_argument("--api-servers", nargs="+", type=int, default=[1])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[32, 64])
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompts-per-stream", type=int, default=3)
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--gpus-per-node", type=float, default=None)
    parser.add_argument("--endpoint", default="chat", choices=["chat", "completions"])
    parser.add_argument("--client-processes", type=int, default=1)
    parser.add_argument("--offline", action="store_true", help="the engine alone first")
    parser.add_argument("--serve-root", type=Path, default=ROOT, help="checkout that serves")
    parser.add_argument(
        "--before-root",
        type=Path,
        default=None,
        help="another checkout (an earlier version) served first, with one API process, for "
        "a before/after table",
    )
    parser.add_argument("--serve-flags", nargs=argparse.REMAINDER, default=[],
                        help="more flags for pdcluster serve (last)")  # fmt: skip
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument(
        "--cpu-threads-per-node",
        type=int,
        default=1,
        help="torch threads of each node on a CPU (pdcluster serve's default), which the "
        "offline engine then runs with too",
    )
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=20.0,
        help="how long the front end's idle CPU rate is measured (0: not measured)",
    )
    parser.add_argument("--section", default="Front end under load")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="measure nothing: write the section from rows a run saved (--json-out), e.g. on "
        "another machine",
    )
    args = parser.parse_args()
    args.tokenizer = args.tokenizer or args.model
    command = "python bench/front_end.py " + shlex.join(sys.argv[1:])
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        command, rows = saved["command"], saved["rows"]
    else:
        with tempfile.TemporaryDirectory(prefix="pdcluster-front-end-") as scratch:
            work = Path(scratch)
            if args.random_model:
                random_model_folder(args, work)
            rows = offline_rows(args) if args.offline else []
            if args.before_root is not None:
                for setup in args.setups:
                    rows += measure(args, setup, 1, work, before=True)
            for setup in args.setups:
                for api_servers in args.api_servers:
                    rows += measure(args, setup, api_servers, work)
                    if args.json_out is not None:  # kept as it goes: a run cut short keeps some
                        args.json_out.write_text(json.dumps({"command": command, "rows": rows}))
    text = table(rows) + "\n\nWhere the generating nodes' time went:\n\n" + loop_table(rows)
    print("\n" + text)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"command": command, "rows": rows}, indent=2))
    if args.no_write:
        return
    body = f"`{command}`\n\n{text}\n"
    slug = re.sub(r"\W+", "-", args.section.lower()).strip("-")
    write_section(args.section, body, {"command": command, "rows": rows}, f"{slug}.json")


if __name__ == "__main__":
    main()
