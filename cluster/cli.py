"""`pdcluster` command line: `demo` and `generate` run the offline engine."""

from __future__ import annotations

import argparse
import sys
import time

from engine.errors import PdclusterError

DEMO_CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Give three tips for staying focused while studying.",
    "Explain in two sentences what a GPU is.",
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="Hugging Face model folder or GGUF file (default: embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV dtype (default: float32 on CPU, bfloat16 on GPU)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64, help="requests batched at once")
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's)"
    )


def build_llm(args: argparse.Namespace):
    from engine import LLM

    return LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
    )


def run_demo(args: argparse.Namespace) -> None:
    from engine import SamplingParams

    print("loading the model ...", flush=True)
    started = time.perf_counter()
    llm = build_llm(args)
    print(f"loaded {llm.model_path} in {time.perf_counter() - started:.1f} s", flush=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    chats = [[{"role": "user", "content": c}] for c in DEMO_CHATS]
    started = time.perf_counter()
    outputs = llm.chat(chats, params)
    elapsed = time.perf_counter() - started
    for chat, out in zip(DEMO_CHATS, outputs):
        print(
            f"\n> {chat}\n{out.text.strip()}\n  [{out.usage.completion_tokens} tokens, "
            f"finish: {out.finish_reason}]"
        )
    generated = sum(o.usage.completion_tokens for o in outputs)
    print(
        f"\n{len(outputs)} requests batched: {generated} tokens in {elapsed:.2f} s = "
        f"{generated / elapsed:.1f} tokens/s"
    )


def run_generate(args: argparse.Namespace) -> None:
    from engine import SamplingParams

    llm = build_llm(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    if args.chat:
        [out] = llm.chat([[{"role": "user", "content": args.prompt}]], params)
    else:
        [out] = llm.generate([args.prompt], params)
    print(out.text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="answer a few chat prompts and print tokens/s")
    add_engine_args(demo)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.set_defaults(func=run_demo)

    generate = commands.add_parser("generate", help="complete one prompt with the offline engine")
    add_engine_args(generate)
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="apply the chat template")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.set_defaults(func=run_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (PdclusterError, ValueError) as err:
        print(f"pdcluster: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
