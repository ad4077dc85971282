"""KV-transfer throughput, prefill GPU -> decode GPU, against raw NCCL send/recv, in one run.

1. Data plane, two processes (rank 0 = prefill on GPU0, rank 1 = decode on GPU1), each seeing only
   its own GPU as Ray gives it to a node:
   a. raw: `dist.send`/`dist.recv` of one contiguous tensor of a prompt's KV size;
   b. the nodes' code: `KVSender.send` -> `KVReceiver.expect` of the same prompt's KV from a real
      `KVPool`, timed from the sender's handle (`elapsed_s`: from the `send()` call, which
      posts, to SUCCESS) and by the caller's clock; the received KV is checked against the sent
      values. Run with the slots a fresh pool hands a prompt (`--slots contiguous`: one
      ascending run on each side, sent from and received into the pool in place) and with
      randomly scattered ones (`--slots scattered`: gather, send, scatter), side by side by
      default (`both`). Each side's handle also gives the time to each phase of its worker's job
      (`TransferHandle.phases`: host clock; with `--phase-events` also `gpu_phases`: CUDA events
      on the worker's stream), printed as a per-phase median breakdown: where a transfer's
      fixed cost goes.
   Then (c) raw again with both GPUs visible to both processes, for reference.
2. The real cluster (1 prefill + 1 decode node on Ray, the real model): long prompts, each node's
   transfer handles recorded (bench/gpu_disagg_cluster.py).

Every figure is a median over `--iters` timed runs after warm-ups (NCCL creates its p2p
communicator on first use). GB/s = bytes / 1e9 / s.

    python3 -m bench.gpu_disagg --model PATH [--device cuda] [--tokens 1024,4096,8000] [--write]
        [--phase-events] [--slots contiguous|scattered|both]

`--write` puts the JSON in docs/bench/gpu_transfer.json. `--device cpu` runs the same code over
gloo (for checking the script, not for figures)."""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.gpu_disagg_cluster import run_cluster
from bench.host_probe import host_probe
from engine.scheduling.kv_pool import KVPool
from metadata.buffers import MetadataBuffers
from metadata.process_group import create_store_server, destroy_transfer_group, init_transfer_group
from metadata.transfer import KVReceiver, KVSender, TransferState
from metadata.wire import gather_kv

OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "bench" / "gpu_transfer.json"
WAIT_S = 120.0


@dataclass(frozen=True)
class Shape:
    num_layers: int = 30  # SmolLM2-135M-Instruct
    num_kv_heads: int = 3
    head_dim: int = 64
    spec_hidden_size: int = 576
    dtype: str = "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def kv_bytes(self, tokens: int) -> int:
        return (
            self.num_layers
            * 2
            * tokens
            * self.num_kv_heads
            * self.head_dim
            * self.torch_dtype.itemsize
        )


# --- 1. the data plane in two processes ---------------------------------------------------------


def _pattern(slots: torch.Tensor, shape: Shape, layer: int, dtype: torch.dtype) -> torch.Tensor:
    """[2, n, heads, dim] values that depend on the slot: small integers, exact in bf16."""
    h = torch.arange(shape.num_kv_heads, device=slots.device).view(1, 1, -1, 1)
    d = torch.arange(shape.head_dim, device=slots.device).view(1, 1, 1, -1)
    kv = torch.arange(2, device=slots.device).view(-1, 1, 1, 1)
    s = slots.view(1, -1, 1, 1)
    return ((s * 3 + layer * 5 + kv * 11 + h * 13 + d) % 251).to(dtype)


SLOT_MODES = ("contiguous", "scattered")


def _slots(n: int, capacity: int, seed: int) -> list[int]:
    perm = torch.randperm(capacity, generator=torch.Generator().manual_seed(seed)) + 1
    return perm[:n].tolist()


def _slot_lists(mode: str, n: int, capacity: int) -> tuple[list[int], list[int]]:
    """The sender's and the receiver's slots of an `n`-token prompt: one ascending run each
    (what a fresh pool hands out), at other slot numbers on each side, or random ones."""
    if mode == "contiguous":
        return list(range(1, n + 1)), list(range(33, 33 + n))
    return _slots(n, capacity, seed=n), _slots(n, capacity, seed=n + 1)


def _dataplane_worker(rank: int, port: int, cfg: dict, results: mp.Queue) -> None:
    try:
        results.put((rank, _dataplane(rank, port, cfg)))
    except BaseException as err:  # noqa: BLE001 - the parent reports it
        results.put((rank, {"error": f"{type(err).__name__}: {err}", "tb": traceback.format_exc()}))
    finally:
        destroy_transfer_group()


def _dataplane(rank: int, port: int, cfg: dict) -> dict:
    shape = Shape(**cfg["shape"])
    on_cuda = cfg["device"] == "cuda"
    if on_cuda and cfg["visible"] == "own":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)  # as Ray does for a node: one GPU, cuda:0
        device = "cuda:0"
    elif on_cuda:
        device = f"cuda:{rank}"
    else:
        device = "cpu"
    init_transfer_group("127.0.0.1", port, rank, 2, device)
    dev = torch.device(device)
    dtype = shape.torch_dtype
    peer = 1 - rank

    def sync() -> None:
        if on_cuda:
            dist.all_reduce(torch.zeros(1, device=dev))
            torch.cuda.synchronize(dev)
        else:
            dist.barrier()

    def finish() -> None:
        if on_cuda:
            torch.cuda.synchronize(dev)

    out: dict = {"device": device, "raw": {}, "kv": {}}
    if on_cuda:
        out["gpu"] = torch.cuda.get_device_name(dev)
    tokens_list = cfg["tokens"]
    iters, warmup = cfg["iters"], cfg["warmup"]
    # raw send/recv of one contiguous tensor of the KV's size
    for n in tokens_list:
        buf = torch.ones(shape.kv_bytes(n) // dtype.itemsize, dtype=dtype, device=dev)
        times = []
        for i in range(warmup + iters):
            sync()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, peer)
            else:
                dist.recv(buf, peer)
            finish()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        out["raw"][n] = {"bytes": buf.numel() * buf.element_size(), "times_s": times}
        del buf
    if cfg["raw_only"]:
        return out
    # the nodes' KVSender/KVReceiver over a real KVPool
    capacity = max(tokens_list) + 64
    pool = KVPool(capacity, shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype, device)
    if rank == 0:
        every = torch.arange(capacity + 1, device=dev)
        for layer in range(shape.num_layers):
            values = _pattern(every, shape, layer, dtype)
            pool.k_buffers[layer].copy_(values[0])
            pool.v_buffers[layer].copy_(values[1])
    metadata = MetadataBuffers(4, shape.spec_hidden_size, 0, 1, dtype, device)
    row = metadata.allocate()
    timeout = cfg["transfer_timeout_s"]
    events = cfg["phase_events"]
    sender = KVSender(device, timeout_s=timeout, phase_events=events) if rank == 0 else None
    receiver = KVReceiver(device, timeout_s=timeout, phase_events=events) if rank == 1 else None
    room = 1000
    for mode in cfg["slot_modes"]:
        out["kv"][mode] = {}
        for n in tokens_list:
            send_slots, recv_slots = _slot_lists(mode, n, capacity)
            elapsed, wall, nbytes, staged, verified = [], [], 0, None, None
            phases: list[dict[str, float]] = []
            gpu_phases: list[dict[str, float]] = []
            for i in range(warmup + iters):
                room += 1
                if rank == 0:
                    metadata.write_row(
                        row,
                        room=room,
                        output_id=room % 1000,
                        output_logprob=-0.5,
                        hidden_state=torch.full((shape.spec_hidden_size,), 0.25, dtype=dtype),
                    )
                sync()
                t0 = time.perf_counter()
                if rank == 0:
                    handle = sender.send(peer, room, [(pool, send_slots)], metadata, row)
                else:
                    handle = receiver.expect(peer, room, [(pool, recv_slots)], metadata, row)
                state = handle.wait(timeout + 10)
                wall_s = time.perf_counter() - t0
                if state != TransferState.SUCCESS:
                    raise RuntimeError(
                        f"{mode} slots, {n} tokens, try {i}: {state.name}: {handle.error}"
                    )
                if i >= warmup:
                    elapsed.append(handle.elapsed_s)
                    wall.append(wall_s)
                    phases.append({**handle.phases, "end": handle.elapsed_s})
                    gpu_phases.append(handle.gpu_phases)
                nbytes, staged = handle.nbytes, handle.staged
            if rank == 1:
                got = gather_kv(pool, recv_slots)
                index = torch.tensor(send_slots, device=dev)
                # [layers, 2, n, heads, dim] -> the wire's [n, layers, 2, heads, dim]
                want = torch.stack(
                    [_pattern(index, shape, layer, dtype) for layer in range(shape.num_layers)]
                ).permute(2, 0, 1, 3, 4)
                verified = bool(torch.equal(got, want)) and metadata.row_landed(row, room)
                cleared = torch.tensor(recv_slots, device=dev)
                for buf in pool.k_buffers + pool.v_buffers:
                    buf.index_fill_(0, cleared, 0)
            out["kv"][mode][n] = {
                "bytes": nbytes,
                "kv_bytes": shape.kv_bytes(n),
                "staged_pools": staged,
                "elapsed_s": elapsed,
                "wall_s": wall,
                "phases": phases,
                "gpu_phases": gpu_phases,
                "verified": verified,
            }
            sync()
    for workers in (sender, receiver):
        if workers is not None:
            workers.close()
    out["host"] = host_probe(device)
    return out


def run_dataplane(cfg: dict) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    store, port = create_store_server("127.0.0.1")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_dataplane_worker, args=(rank, port, cfg, results), daemon=True)
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    deadline = time.monotonic() + cfg["phase_timeout_s"]
    try:
        while len(got) < 2:
            try:
                rank, value = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                raise TimeoutError(f"data-plane ranks {sorted({0, 1} - set(got))} hung") from None
            if "error" in value:
                raise RuntimeError(f"rank {rank}: {value['error']}\n{value['tb']}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        del store
    return got


# --- report -------------------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _gbps(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / 1e9 / seconds if seconds else None


def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        return format("-", ">" + spec.split(".")[0])
    return format(value, spec)


def phase_steps_ms(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per phase, the median over runs of the milliseconds from the previous phase (the first
    from the job's start) to it: a breakdown whose steps add up to about the median total."""
    steps: dict[str, list[float]] = {}
    for marks in runs:
        before = 0.0
        for phase, at in marks.items():
            steps.setdefault(phase, []).append((at - before) * 1e3)
            before = at
    return {phase: statistics.median(values) for phase, values in steps.items()}


def summarize(tokens_list, shape, dataplane, raw_all, cluster_result, reps_warm: int) -> list[dict]:
    """One row per prompt length: raw send/recv, then under "dataplane" the nodes' code per
    slot mode that ran ("contiguous", "scattered"), then the cluster."""
    rows = []
    for n in tokens_list:
        raw = dataplane[0]["raw"][n]
        raw_s = _median(raw["times_s"])
        raw_gbps = _gbps(raw["bytes"], raw_s)
        row = {
            "tokens": n,
            "kv_bytes": shape.kv_bytes(n),
            "raw_ms": raw_s * 1e3,
            "raw_gbps": raw_gbps,
            "raw_min_ms": min(raw["times_s"]) * 1e3,
        }
        if raw_all is not None:
            r = raw_all[0]["raw"][n]
            row["raw_all_visible_ms"] = _median(r["times_s"]) * 1e3
            row["raw_all_visible_gbps"] = _gbps(r["bytes"], _median(r["times_s"]))
        modes = {}
        for mode, by_tokens in dataplane[0]["kv"].items():
            kv, landed = by_tokens[n], dataplane[1]["kv"][mode][n]
            s = _median(kv["elapsed_s"])
            modes[mode] = {
                "transfer_bytes": kv["bytes"],
                "sender_staged_pools": kv["staged_pools"],
                "receiver_staged_pools": landed["staged_pools"],
                "kvsender_ms": s * 1e3,
                "kvsender_gbps": _gbps(kv["bytes"], s),
                "kvsender_pct_raw": 100 * _gbps(kv["bytes"], s) / raw_gbps,
                "kvsender_wall_ms": _median(kv["wall_s"]) * 1e3,
                "kvreceiver_ms": _median(landed["elapsed_s"]) * 1e3,
                "verified": landed["verified"],
                "sender_phase_ms": phase_steps_ms(kv["phases"]),
                "receiver_phase_ms": phase_steps_ms(landed["phases"]),
                "sender_gpu_phase_ms": phase_steps_ms(kv["gpu_phases"]),
                "receiver_gpu_phase_ms": phase_steps_ms(landed["gpu_phases"]),
            }
        if modes:
            row["dataplane"] = modes
        if cluster_result is not None:
            sent = [e for e in cluster_result["prefill"] if e["tokens"] == n and e["ok"]]
            got = [e for e in cluster_result["decode"] if e["tokens"] == n and e["ok"]]
            sent, got = sent[reps_warm:], got[reps_warm:]  # the first one builds NCCL's comm
            if sent:
                s = _median([e["elapsed_s"] for e in sent])
                nbytes = sent[0]["bytes"]
                # The KV alone (the row is under 1 % of it), from ready to sent on the GPU.
                kv_sent = [e["gpu_phases"]["kv_sent"] for e in sent if "kv_sent" in e["gpu_phases"]]
                if kv_sent:
                    kv_s = _median(kv_sent)
                    row.update(
                        {
                            "cluster_kv_ready_to_sent_ms": kv_s * 1e3,
                            "cluster_kv_gbps": _gbps(row["kv_bytes"], kv_s),
                            "cluster_kv_pct_raw": 100 * _gbps(row["kv_bytes"], kv_s) / raw_gbps,
                        }
                    )
                row.update(
                    {
                        "cluster_transfers": len(sent),
                        "cluster_bytes": nbytes,
                        "cluster_prefill_ms": s * 1e3,
                        "cluster_gbps": _gbps(nbytes, s),
                        "cluster_pct_raw": 100 * _gbps(nbytes, s) / raw_gbps,
                        "cluster_decode_ms": _median([e["elapsed_s"] for e in got]) * 1e3
                        if got
                        else None,
                        "cluster_prefill_phase_ms": phase_steps_ms([e["phases"] for e in sent]),
                        "cluster_prefill_gpu_phase_ms": phase_steps_ms(
                            [e["gpu_phases"] for e in sent]
                        ),
                        "cluster_decode_phase_ms": phase_steps_ms([e["phases"] for e in got]),
                        "cluster_e2e_ms": _median(
                            [r["e2e_s"] for r in cluster_result["requests"] if r["tokens"] == n][
                                reps_warm:
                            ]
                        )
                        * 1e3,
                    }
                )
        rows.append(row)
    return rows


def _modes(rows: list[dict]) -> list[str]:
    return [m for m in SLOT_MODES if any(m in r.get("dataplane", {}) for r in rows)]


def print_table(rows: list[dict]) -> None:
    """KVSend columns per slot mode: "contiguous" (sent from and received into the pool in
    place) and "scattered" (gathered and scattered)."""
    modes = _modes(rows)
    labels = {"contiguous": "contig ms", "scattered": "scatter ms"}
    cells = "".join(f"{labels[m]:>10} {'GB/s':>6} {'%raw':>5} {'ok':>3} | " for m in modes)
    head = (
        f"{'tokens':>6} {'KV bytes':>11} | {'raw ms':>7} {'raw GB/s':>8} | {cells}"
        f"{'cluster ms':>10} {'GB/s':>6} {'%raw':>5} | {'KV ready->sent ms':>17} {'%raw':>5} | "
        f"{'raw(all vis) GB/s':>17}"
    )
    print(f"KVSender per slot mode: {', '.join(modes) or 'none'}")
    print(head)
    print("-" * len(head))
    for r in rows:
        line = (
            f"{r['tokens']:>6} {r['kv_bytes']:>11} | {r['raw_ms']:>7.3f} {r['raw_gbps']:>8.1f} | "
        )
        for m in modes:
            d = r.get("dataplane", {}).get(m, {})
            line += (
                f"{_fmt(d.get('kvsender_ms'), '10.3f')} {_fmt(d.get('kvsender_gbps'), '6.1f')} "
                f"{_fmt(d.get('kvsender_pct_raw'), '5.1f')} {str(d.get('verified', '-'))[:3]:>3} | "
            )
        line += (
            f"{_fmt(r.get('cluster_prefill_ms'), '10.3f')} {_fmt(r.get('cluster_gbps'), '6.1f')} "
            f"{_fmt(r.get('cluster_pct_raw'), '5.1f')} | "
            f"{_fmt(r.get('cluster_kv_ready_to_sent_ms'), '17.3f')} "
            f"{_fmt(r.get('cluster_kv_pct_raw'), '5.1f')} | "
            f"{_fmt(r.get('raw_all_visible_gbps'), '17.1f')}"
        )
        print(line)


def print_phases(rows: list[dict]) -> None:
    """Per size and side, the median milliseconds each phase of the worker's job took."""
    print("\nphases (median ms from the previous phase; 'end': last phase to job end)")
    sides = ("sender", "receiver", "sender_gpu", "receiver_gpu")
    for r in rows:
        for mode, d in r.get("dataplane", {}).items():
            for side in sides:
                steps = d.get(f"{side}_phase_ms")
                if steps:
                    text = "  ".join(f"{phase} {ms:.3f}" for phase, ms in steps.items())
                    print(f"{r['tokens']:>6} {mode:<10} {side:<15} {text}")
        for side in ("cluster_prefill", "cluster_prefill_gpu", "cluster_decode"):
            steps = r.get(f"{side}_phase_ms")
            if steps:
                text = "  ".join(f"{phase} {ms:.3f}" for phase, ms in steps.items())
                print(f"{r['tokens']:>6} {'cluster':<10} {side:<15} {text}")


def machine_info(device: str) -> dict:
    info = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if device == "cuda":
        try:
            info["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError) as err:
            info["nvidia_smi"] = f"unavailable: {err}"
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def model_shape(model: str | None) -> Shape:
    from engine.loading.loader import EngineArgs, resolve

    config = resolve(EngineArgs(model=model, device="cpu", dtype="bfloat16")).model_config
    return Shape(config.num_layers, config.num_kv_heads, config.head_dim, config.spec_hidden_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--tokens",
        nargs="+",
        default=["1024,4096,8000"],
        help="prompt lengths, comma- or space-separated",
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cluster-reps", type=int, default=6, help="prompts per length")
    parser.add_argument("--skip-cluster", action="store_true")
    parser.add_argument("--write", action="store_true", help=f"write {OUTPUT}")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument(
        "--phase-events",
        action="store_true",
        help="also time each transfer's phases with CUDA events (waits for them after each)",
    )
    parser.add_argument(
        "--slots",
        default="both",
        choices=[*SLOT_MODES, "both"],
        help="the data plane's slots: one run on each side as a fresh pool hands out "
        "(contiguous), random ones (scattered), or both side by side",
    )
    args = parser.parse_args(argv)
    tokens_list = [int(t) for group in args.tokens for t in group.split(",") if t]
    shape = model_shape(args.model)
    if args.device == "cpu":
        shape = Shape(**{**shape.__dict__, "dtype": "float32"})
    print(f"shape {shape}; KV per token {shape.kv_bytes(1)} B", flush=True)
    cfg = {
        "shape": shape.__dict__,
        "device": args.device,
        "visible": "own",
        "tokens": tokens_list,
        "iters": args.iters,
        "warmup": args.warmup,
        "raw_only": False,
        "phase_events": args.phase_events,
        "slot_modes": list(SLOT_MODES) if args.slots == "both" else [args.slots],
        "transfer_timeout_s": 60.0,
        "phase_timeout_s": 240.0,
    }
    t0 = time.perf_counter()
    dataplane = run_dataplane(cfg)
    print(
        f"data plane (each rank sees its own GPU) done in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    raw_all = None
    if args.device == "cuda":
        t0 = time.perf_counter()
        raw_all = run_dataplane({**cfg, "visible": "all", "raw_only": True})
        print(f"raw, both GPUs visible, done in {time.perf_counter() - t0:.1f} s", flush=True)
    cluster_result = None
    if not args.skip_cluster:
        t0 = time.perf_counter()
        cluster_result = run_cluster(args.model, args.device, tokens_list, args.cluster_reps)
        print(
            f"cluster done in {time.perf_counter() - t0:.1f} s "
            f"(launch {cluster_result['launch_s']:.1f} s)",
            flush=True,
        )
    rows = summarize(tokens_list, shape, dataplane, raw_all, cluster_result, reps_warm=1)
    print_table(rows)
    print_phases(rows)
    host = {"data-plane rank 0": dataplane[0]["host"]}
    if cluster_result is not None:
        host["prefill node"] = cluster_result["prefill_host"]
    for where, probe in host.items():
        print(f"host, {where}: {probe}")
    report = {
        "what": "KV transfer prefill rank -> decode rank vs raw send/recv; medians",
        "machine": machine_info(args.device),
        "gpu": dataplane[0].get("gpu"),
        "device": args.device,
        "model": args.model,
        "shape": shape.__dict__,
        "iters": args.iters,
        "warmup": args.warmup,
        "cluster_reps": args.cluster_reps,
        "phase_events": args.phase_events,
        "slot_modes": cfg["slot_modes"],
        "rows": rows,
        "host": host,
        "cluster_kv_pools_empty": None
        if cluster_result is None
        else cluster_result["kv_pools_empty"],
        "raw_times_s": {n: dataplane[0]["raw"][n]["times_s"] for n in tokens_list},
        "cluster_log": None
        if cluster_result is None
        else {k: cluster_result[k] for k in ("prefill", "decode", "requests")},
    }
    text = json.dumps(report, indent=2)
    if args.write:
        OUTPUT.parent.mkdir(parents=True, exist_ok=True)
        OUTPUT.write_text(text + "\n")
        print(f"wrote {OUTPUT}")
    if args.out:
        Path(args.out).write_text(text + "\n")
    ok = all(d["verified"] for r in rows for d in r.get("dataplane", {}).values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
