"""The kernels that turn a draft depth's logits into proposals, one program a row against each
row split across programs (engine/kernels/split_topk.py), by row length, rows and k, on a GPU.

    python bench/proposal_kernels.py [--sizes 8192 49152] [--rows 1 8 64] [--k 1 8]

Each case is captured in a CUDA graph of 20 calls, replayed until about 50 ms have passed; the
table gives microseconds a call, the graph's launch shared out, and whether the two kernels
gave the same tokens. Prints the table only: docs/BENCHMARKS.md, "The whole vocabulary on a
GPU", keeps the figures a run gave and the thresholds chosen from them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.kernels.topk import topk_with_probability  # noqa: E402

CALLS_PER_GRAPH = 20


def time_call(fn) -> float:
    """Microseconds a call of `fn`, from replays of a CUDA graph of CALLS_PER_GRAPH calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays, elapsed = 10, 0.0
    while elapsed < 50.0:
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        elapsed = start.elapsed_time(end)
        per_call = elapsed * 1000 / (replays * CALLS_PER_GRAPH)
        replays *= 4
    return per_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 49152])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a GPU")
    torch.manual_seed(0)
    print("| row length | rows | k | one program a row (us) | split rows (us) | same tokens |")
    print("| ---: | ---: | ---: | ---: | ---: | :---: |")
    for size in args.sizes:
        for rows in args.rows:
            logits = (4 * torch.randn(rows, size, device="cuda")).to(torch.bfloat16)
            for k in args.k:
                times = {}
                for split in (False, True):
                    times[split] = time_call(
                        lambda x=logits, n=k, s=split: topk_with_probability(x, n, None, s)
                    )
                same = torch.equal(
                    topk_with_probability(logits, k, None, False)[0],
                    topk_with_probability(logits, k, None, True)[0],
                )
                print(
                    f"| {size} | {rows} | {k} | {times[False]:.1f} | {times[True]:.1f} | "
                    f"{'yes' if same else 'NO'} |"
                )


if __name__ == "__main__":
    main()
