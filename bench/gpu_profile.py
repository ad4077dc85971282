"""Where one decode step's time goes on a GPU: kernels per step and per layer, GPU time per step,
and the kernels that take it, from a torch.profiler trace of plain greedy decode steps.

    python bench/gpu_profile.py [--model PATH | --shape llama8b] [--batch-size 1] [--steps 20]
        [--disable-cuda-graph]

Without --model it builds random weights of SmolLM2-135M's shapes, or of another shape of
bench/random_models.py (`--shape llama8b`). The
trace covers `--steps` decode steps after the prompt: kernels launched from a replayed CUDA
graph are counted as they run. Prints tables only; writes nothing."""

from __future__ import annotations

import argparse
import sys
import tempfile
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
    args = parser.parse_args()
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
    )
    prompts = [
        [(11 * i + j) % 200 + 3 for j in range(args.prompt_len)] for i in range(args.batch_size)
    ]

    def generate(new_tokens: int) -> None:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts, params)

    generate(args.steps + 1)  # warm-up
    counts = []
    for new_tokens in (1, args.steps + 1):  # the prompt alone, then the prompt and the steps
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate(new_tokens)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        counts.append((len(kernels), sum(e.device_time for e in kernels), kernels))
    (prompt_n, prompt_us, _), (all_n, all_us, kernels) = counts
    per_step = (all_n - prompt_n) / args.steps
    layers = llm.model_config.num_layers
    gpu_ms = (all_us - prompt_us) / args.steps / 1000
    graphs = "off" if args.disable_cuda_graph else "on"
    print(f"model {path}, batch {args.batch_size}, graphs {graphs}")
    per_layer = per_step / layers
    print(f"kernels per decode step: {per_step:.1f} ({per_layer:.1f} a layer of {layers})")
    print(f"GPU time per decode step: {gpu_ms:.3f} ms")
    by_name: Counter[str] = Counter()
    time_by_name: Counter[str] = Counter()
    for e in kernels:
        by_name[e.name[:70]] += 1
        time_by_name[e.name[:70]] += e.device_time
    print(f"{'kernel':72} {'count':>6} {'total us':>10}")
    for name, us in time_by_name.most_common(15):
        print(f"{name:72} {by_name[name]:6d} {us:10.0f}")


if __name__ == "__main__":
    main()
