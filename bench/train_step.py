"""How long a draft-training step takes: `pdcluster train-draft`'s trainer on random weights
of a target's shapes and random token sequences, timed as the difference of two runs
`--steps` steps apart (model building, kernel compilation and the first steps cancel).

    python bench/train_step.py [--device cuda] [--shape smollm2] [--num-draft-steps 3]
        [--draft-intermediate-size N] [--tokens-per-batch 8192] [--steps 150]

Speed does not depend on weight values, so no model is read. Sequences are 20 to 80 prompt
tokens and 30 to 256 answer tokens, as the self-distilled data's; the same seed gives the same
batches. Prints one line; writes nothing."""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.random_models import SHAPES, random_model  # noqa: E402
from engine.executor.model_runner import build_model  # noqa: E402
from engine.loading.loader import EngineArgs, resolve  # noqa: E402
from engine.loading.weights import iter_safetensors  # noqa: E402
from engine.models.rope import RotaryEmbedding  # noqa: E402
from spec.draft_model import MultiLayerEagleDraft  # noqa: E402
from spec.train.batches import make_batches  # noqa: E402
from spec.train.data import Sequences  # noqa: E402
from spec.train.trainer import DraftTrainer, Schedule  # noqa: E402


def random_sequences(count: int, vocab_size: int, seed: int) -> Sequences:
    rng = random.Random(seed)
    tokens, prompt_lens = [], []
    for _ in range(count):
        prompt, answer = rng.randint(20, 80), rng.randint(30, 256)
        tokens.append([rng.randrange(3, vocab_size) for _ in range(prompt + answer)])
        prompt_lens.append(prompt)
    return Sequences(tokens, prompt_lens, {"max_tokens": 256})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--num-draft-steps", type=int, default=3)
    parser.add_argument("--draft-intermediate-size", type=int, default=None)
    parser.add_argument("--tokens-per-batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=150, help="steps between the two runs")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.num_draft_steps < 1:
        parser.error("--steps and --num-draft-steps must be at least 1")
    device = torch.device(args.device)
    folder = Path(tempfile.mkdtemp(prefix="train_step_"))
    random_model(args.shape, folder, args.device)  # saved; the returned copy is dropped
    spec = resolve(EngineArgs(model=str(folder), device=args.device))
    # As train-draft builds the target: plain weights, which a backward pass goes through.
    engine_config = dataclasses.replace(spec.engine_config, cpu_packed_linear=False)
    target = build_model(spec.model_config, engine_config, iter_safetensors(spec.path))
    config = spec.model_config
    rotary = RotaryEmbedding(config.rope, config.head_dim, 1024, device)
    short = max(1, args.steps // 5)
    # Enough sequences that an epoch holds both runs' steps.
    data = random_sequences(
        (short + args.steps) * max(1, args.tokens_per_batch // 150), config.vocab_size, 0
    )

    def run(steps: int) -> tuple[float, int]:
        """Seconds for a fresh draft's first `steps` steps through the trainer's own loop, and the
        steps it took (its batches regrouped, about `steps`)."""
        torch.manual_seed(0)
        draft = MultiLayerEagleDraft(
            config, args.num_draft_steps, intermediate_size=args.draft_intermediate_size
        ).to(device)
        schedule = Schedule(
            epochs=1, tokens_per_batch=args.tokens_per_batch, lr=1e-3, checkpoint_every=10**9
        )
        # The run's epoch: the sequences of the first `steps` batches of the whole set (as
        # drawn for seed 0, epoch 0), which the trainer groups again into about as many.
        batches = make_batches([len(t) for t in data.tokens], args.tokens_per_batch, 0, 0)
        if len(batches) < steps:
            raise SystemExit(f"only {len(batches)} batches for {steps} steps")
        chosen = [i for batch in batches[:steps] for i in batch]
        part = Sequences([data.tokens[i] for i in chosen], [data.prompt_lens[i] for i in chosen])
        out = Path(tempfile.mkdtemp(prefix="train_step_run_"))
        trainer = DraftTrainer(draft, target, rotary, part, None, schedule, out, {}, False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        progress = trainer.run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started, progress.step

    (short_s, short_steps), (long_s, long_steps) = run(short), run(short + args.steps)
    per_step = (long_s - short_s) / (long_steps - short_steps)
    print(
        f"{args.shape}, {args.device}, {args.num_draft_steps} depths, "
        f"MLP {args.draft_intermediate_size or config.intermediate_size}, "
        f"{args.tokens_per_batch} tokens a step: {per_step * 1000:.1f} ms a step "
        f"({long_steps - short_steps} steps between runs of {short_steps} and {long_steps})"
    )


if __name__ == "__main__":
    main()
