"""How fast a process runs host code, for telling whether one process's host steps are slower
than another's for its own reasons."""

from __future__ import annotations

import os
import time

import torch


def host_probe(device: str) -> dict:
    """How fast this process runs host code, and what could slow it: a pure-Python loop and a
    small device op, timed (median us of 30), next to the thread count, the CPUs it may use,
    trace or profile hooks and the interpreter's switch interval. Run in a data-plane rank and
    in a node, it tells whether a node's host steps are slower for its own reasons."""
    import statistics
    import sys
    import threading

    def median_us(fn, reps: int = 30) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    def python_loop() -> None:
        total = 0
        for i in range(20000):
            total += i

    x = torch.zeros(16, device=device)

    def device_ops() -> None:
        for _ in range(50):
            x.add_(1)

    return {
        "python_loop_us": round(median_us(python_loop), 1),
        "50_small_ops_us": round(median_us(device_ops), 1),
        "threads": threading.active_count(),
        "cpus": len(os.sched_getaffinity(0)),
        "trace_hook": sys.gettrace() is not None or sys.getprofile() is not None,
        "switch_interval_s": sys.getswitchinterval(),
        "torch_threads": torch.get_num_threads(),
    }
