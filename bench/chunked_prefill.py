"""What chunked prefill does to the requests around a long prompt, on the offline engine.

    python bench/chunked_prefill.py [--device cpu] [--prompt-tokens 8000] [--chunks 0 2048]

One request is decoding (`--running-tokens` to go) when a long prompt (`--prompt-tokens`) and,
right behind it, a short one (16 tokens) arrive. For each chunk size (0: no chunks), on the
default model (or `--model`): the short request's time to first token, the long one's, and the
longest gap between two tokens of the running request while the long prompt is prefilled.
Greedy, one engine per chunk size, a warm-up prefill of the same long prompt first.

Prints a table and rewrites the "Chunked prefill (CPU)" or "(CUDA)" section of
docs/BENCHMARKS.md (raw figures in docs/bench/chunked_prefill_<cpu|cuda>.json)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import device_description, write_section  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

SHORT_TOKENS = 16


def _prompt(length: int, offset: int) -> list[int]:
    return [100 + (offset + 7 * i) % 20000 for i in range(length)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def measure(args: argparse.Namespace, chunk: int) -> dict:
    llm = LLM(
        args.model,
        device=args.device,
        chunked_prefill_size=chunk,
        max_model_len=args.prompt_tokens + 64,
        max_prefill_tokens=args.prompt_tokens + SHORT_TOKENS,
        kv_cache_tokens=args.prompt_tokens * 2 + 1024,
    )
    engine = llm.engine
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate([_prompt(args.prompt_tokens, 1), _prompt(SHORT_TOKENS, 2)], one)  # warm-up
    running_params = SamplingParams(max_tokens=args.running_tokens, temperature=0, ignore_eos=True)
    running = engine.make_request("running", _prompt(32, 3), running_params)
    engine.add_request(running)
    while len(running.output_token_ids) < 4:
        engine.step()
    long = engine.make_request("long", _prompt(args.prompt_tokens, 4), one)
    short = engine.make_request("short", _prompt(SHORT_TOKENS, 5), one)
    _sync(args.device)
    start = last_token = time.perf_counter()
    engine.add_request(long)
    engine.add_request(short)
    ttft: dict[str, float] = {}
    longest_gap = 0.0
    while "long" not in ttft or "short" not in ttft:
        before = len(running.output_token_ids)
        engine.step()
        _sync(args.device)
        now = time.perf_counter()
        for req in (long, short):
            if req.output_token_ids and req.request_id not in ttft:
                ttft[req.request_id] = now - start
        if len(running.output_token_ids) > before:
            longest_gap = max(longest_gap, now - last_token)
            last_token = now
    # The gap still open when the long prompt's first token came counts too.
    longest_gap = max(longest_gap, time.perf_counter() - last_token)
    if running.finished:
        raise SystemExit("--running-tokens too small: the running request ended during the test")
    return {
        "chunk": chunk,
        "short_ttft_s": ttft["short"],
        "long_ttft_s": ttft["long"],
        "running_longest_gap_s": longest_gap,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--running-tokens", type=int, default=4096)
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 1024, 2048, 4096])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    rows = [measure(args, chunk) for chunk in args.chunks]
    lines = [
        "| chunk size | short request TTFT (s) | long prompt TTFT (s) | running request's "
        "longest gap (s) |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['chunk'] or 'off'} | {row['short_ttft_s']:.3f} | {row['long_ttft_s']:.3f} "
            f"| {row['running_longest_gap_s']:.3f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.no_write:
        return
    command = "python bench/chunked_prefill.py " + " ".join(sys.argv[1:])
    body = (
        f"Command: `{command.strip()}` ({device_description(args.device)}).\n\n"
        f"A request is decoding when a {args.prompt_tokens}-token prompt and, right behind it, "
        f"a {SHORT_TOKENS}-token one arrive at the offline engine (default model unless "
        "--model, greedy). Times from their arrival; the gap is the longest wait between two "
        "tokens of the decoding request while the long prompt is prefilled.\n\n" + table
    )
    kind = "CPU" if args.device == "cpu" else "CUDA"
    write_section(
        f"Chunked prefill ({kind})", body, {"rows": rows}, f"chunked_prefill_{kind.lower()}.json"
    )


if __name__ == "__main__":
    main()
