"""Where one decode step's time goes on a GPU: kernels per step and per layer, GPU time per step
against wall time per step, and the count and time per step of the `--kernels N` costliest
kernels, from a torch.profiler trace of greedy decode steps.

    python bench/gpu_profile.py [--model PATH | --shape llama8b] [--batch-size 1] [--steps 20]
        [--disable-cuda-graph] [--spec [--draft-model PATH] [--num-draft-steps K]]
        [--kernels N] [--host-profile N]

Without --model it builds random weights of SmolLM2-135M's shapes, or of another shape of
bench/random_models.py (`--shape llama8b`). Per-step figures are the difference of two runs
`--steps` steps apart over the same prompts: kernels launched from a replayed CUDA graph are
counted as they run. With --spec each step is a speculative round (verify, acceptance, draft
extend) with the shipped draft (made for SmolLM2's shapes) or --draft-model; random weights
accept almost no draft, so each round emits about one token. Prints tables only; writes
nothing. `--host-profile N` adds the N host functions that take the most time of their own per
step (cProfile over the longer run; the profiler slows the host, so compare its figures with
each other, not with the wall time above)."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.random_models import random_model  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument(
        "--shape", default="smollm2", help="random weights of this shape without --model"
    )
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--spec", action="store_true", help="speculative rounds, not plain steps")
    parser.add_argument("--draft-model", default=None, help="with --spec (default: shipped)")
    parser.add_argument(
        "--num-draft-steps", type=int, default=None, help="with --spec: draft depths used"
    )
    parser.add_argument(
        "--speculative-topk", type=int, default=1, help="with --spec: a top-k draft tree"
    )
    parser.add_argument(
        "--num-draft-tokens", type=int, default=None, help="with --spec: the tree's nodes"
    )
    parser.add_argument("--kernels", type=int, default=25, help="kernel names listed")
    parser.add_argument(
        "--host-profile", type=int, default=0, metavar="N", help="the N costliest host functions"
    )
    args = parser.parse_args()
    spec_kw = {}
    if args.spec:
        from spec.default_draft import default_draft_path

        draft = args.draft_model or default_draft_path()
        if draft is None:
            parser.error("--spec needs --draft-model: no shipped draft is installed")
        # The rounds are what it profiles: one at every step.
        spec_kw = dict(
            speculative_algorithm="multi-layer-eagle",
            draft_model=str(draft),
            speculative_plan="always",
        )
        if args.num_draft_steps is not None:
            spec_kw["num_draft_steps"] = args.num_draft_steps
        if args.speculative_topk > 1:
            spec_kw["speculative_topk"] = args.speculative_topk
            spec_kw["num_draft_tokens"] = args.num_draft_tokens
    path = args.model
    if path is None:
        path = tempfile.mkdtemp(prefix="gpu_profile_")
        random_model(args.shape, Path(path), "cuda")  # saved; the returned copy is dropped
        torch.cuda.empty_cache()
    llm = LLM(
        path,
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=max(args.batch_size, 1),
        max_model_len=1024,
        kv_cache_tokens=args.batch_size * 1024,
        disable_cuda_graph=args.disable_cuda_graph,
        **spec_kw,
    )
    prompts = [
        [(11 * i + j) % 200 + 3 for j in range(args.prompt_len)] for i in range(args.batch_size)
    ]

    def generate(new_tokens: int) -> tuple[float, int]:
        """Seconds taken, and the decode steps run (speculative rounds with --spec)."""
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        torch.cuda.synchronize()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        if not args.spec:
            return elapsed, new_tokens
        return elapsed, max(o.usage.spec_verify_steps for o in outputs)

    # Two answers whose difference is `--steps` steps or more: the prompt, its first token and
    # the draft's extend over the prompt cancel out.
    lengths = (args.steps // 4 + 1, args.steps + args.steps // 4 + 1)
    generate(lengths[1])  # warm-up
    (short_s, short_steps), (long_s, long_steps) = (generate(n) for n in lengths)
    steps = long_steps - short_steps
    counts = []
    for new_tokens in lengths:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate(new_tokens)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        counts.append((len(kernels), sum(e.device_time for e in kernels), kernels))
    (short_n, short_us, short_kernels), (long_n, long_us, kernels) = counts
    per_step = (long_n - short_n) / steps
    layers = llm.model_config.num_layers
    gpu_ms = (long_us - short_us) / steps / 1000
    wall_ms = (long_s - short_s) / steps * 1000
    graphs = "off" if args.disable_cuda_graph else "on"
    what = "speculative round" if args.spec else "decode step"
    print(f"model {path}, batch {args.batch_size}, graphs {graphs}, {steps} {what}s")
    per_layer = per_step / layers
    print(f"kernels per {what}: {per_step:.1f} ({per_layer:.1f} a target layer of {layers})")
    print(f"GPU time per {what}: {gpu_ms:.3f} ms; wall time: {wall_ms:.3f} ms")
    # Per step: the longer run's kernels less the shorter run's, by name.
    by_name: Counter[str] = Counter()
    time_by_name: Counter[str] = Counter()
    for sign, run_kernels in ((1, kernels), (-1, short_kernels)):
        for e in run_kernels:
            by_name[e.name[:70]] += sign
            time_by_name[e.name[:70]] += sign * e.device_time
    print(f"{'kernel (per ' + what + ')':72} {'count':>6} {'us':>8}")
    listed = [(n, us) for n, us in time_by_name.most_common() if by_name[n] or abs(us) > 0.5]
    for name, us in listed[: args.kernels]:
        print(f"{name:72} {by_name[name] / steps:6.1f} {us / steps:8.1f}")
    if args.host_profile:
        print_host_profile(lambda: generate(lengths[1]), long_steps, args.host_profile)


def print_host_profile(run, steps: int, top: int) -> None:
    """The `top` functions by time of their own, per step, over one call of `run`."""
    profiler = cProfile.Profile()
    profiler.runcall(run)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, _, own s, cumulative s, _)}
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    print(f"{'host function (own time)':72} {'calls/step':>10} {'us/step':>8}")
    for (file, line, name), (_, calls, own, _, _) in rows:
        where = f"{Path(file).name}:{line} {name}"[:72]
        print(f"{where:72} {calls / steps:10.1f} {own / steps * 1e6:8.1f}")


if __name__ == "__main__":
    main()
