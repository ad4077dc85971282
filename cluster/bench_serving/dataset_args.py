"""`pdcluster bench serving`'s dataset flags, and the DatasetSpec they make.

A flag that belongs to some datasets only is refused with the others, rather than silently
ignored: --num-prompts sizes random, chat and file runs (shared-prefix sends groups x prompts per
group, multiturn --num-conversations), and multiturn's concurrency is --concurrent-conversations
(a conversation keeps its place between its turns) rather than --max-concurrency.
"""

from __future__ import annotations

import argparse

from cluster.bench_serving.chat_conversations import CONVERSATIONS
from cluster.bench_serving.datasets import DATASETS, DatasetSpec

DEFAULT_NUM_PROMPTS = 200
DEFAULT_CONCURRENT_CONVERSATIONS = 16
# The datasets each optional flag (by its argparse dest) goes with; left unset, it takes the
# default in DatasetSpec or below.
FLAG_DATASETS = {
    "num_prompts": ("random", "chat", "file"),
    "max_concurrency": ("random", "chat", "file", "shared-prefix"),
    "num_conversations": ("multiturn",),
    "concurrent_conversations": ("multiturn",),
    "prefix_groups": ("shared-prefix",),
    "prompts_per_group": ("shared-prefix",),
    "system_prompt_len": ("shared-prefix",),
    "question_len": ("shared-prefix",),
}
# The datasets of random text, whose answers are sent with ignore_eos by default.
RANDOM_TEXT = ("random", "shared-prefix")


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("dataset")
    data.add_argument(
        "--dataset",
        default=None,
        choices=list(DATASETS),
        help="random: random tokens of --input-len; chat: built-in multi-turn conversations; "
        "file: --dataset-path; shared-prefix: groups of random questions sharing a random "
        "system prompt; multiturn: the built-in conversations replayed turn by turn, each turn "
        "carrying the server's answers so far (default: file with --dataset-path, else random)",
    )
    data.add_argument(
        "--dataset-path",
        default=None,
        metavar="FILE",
        help='ShareGPT JSON (a list of {"conversations": [{"from": "human" | "gpt", "value": '
        "...}]}: the first human turn, and the length of the gpt turn after it as the output "
        'length) or JSONL (one {"prompt": ..., "output_len": N (optional)} per line)',
    )
    data.add_argument(
        "--input-len", type=positive_int, default=1024, help="random: prompt tokens (1024)"
    )
    data.add_argument(
        "--output-len",
        type=positive_int,
        default=128,
        help="max_tokens for random and shared-prefix prompts, and for file prompts that give "
        "none (128)",
    )
    data.add_argument(
        "--range-ratio",
        type=range_ratio,
        default=0.0,
        help="random: draw each prompt's and output's length uniformly in "
        "[len * (1 - r), len * (1 + r)], with 0 <= r < 1 (vLLM's convention; SGLang's "
        "--random-range-ratio means [len * r, len] instead); 0 gives exact lengths (default)",
    )
    shape = DatasetSpec("shared-prefix", 1)
    for flag, default, what in (
        ("--prefix-groups", shape.groups, "groups, each with its own system prompt"),
        ("--prompts-per-group", shape.prompts_per_group, "questions per group"),
        ("--system-prompt-len", shape.system_len, "tokens of each group's system prompt"),
        ("--question-len", shape.question_len, "tokens of each question"),
    ):
        data.add_argument(
            flag, type=positive_int, default=None, help=f"shared-prefix: {what} ({default})"
        )
    data.add_argument(
        "--num-conversations",
        type=positive_int,
        default=None,
        help=f"multiturn: conversations to replay (default: the {len(CONVERSATIONS)} built-in "
        "ones, each once)",
    )
    data.add_argument(
        "--concurrent-conversations",
        type=positive_int,
        default=None,
        help="multiturn: at most this many conversations under way at once "
        f"({DEFAULT_CONCURRENT_CONVERSATIONS}); --request-rate counts conversations started "
        "per second",
    )
    data.add_argument(
        "--tokenizer",
        default=None,
        help="model folder, GGUF file or cached hub name whose tokenizer sizes the prompts "
        "(default: --model when it is a local path, else pdcluster's default model)",
    )


def dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    """The dataset the flags ask for; ValueError for flags that do not go together."""
    name = dataset_name(args)
    for dest, datasets in FLAG_DATASETS.items():
        if getattr(args, dest, None) is not None and name not in datasets:
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{flag} does not go with --dataset {name}")
    shape = DatasetSpec(name, 1)
    groups = args.prefix_groups or shape.groups
    per_group = args.prompts_per_group or shape.prompts_per_group
    if name == "shared-prefix":
        num_prompts = groups * per_group
    elif name == "multiturn":
        num_prompts = args.num_conversations or len(CONVERSATIONS)
    else:
        num_prompts = args.num_prompts or DEFAULT_NUM_PROMPTS
    return DatasetSpec(
        name=name,
        num_prompts=num_prompts,
        seed=args.seed,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        path=args.dataset_path,
        groups=groups,
        prompts_per_group=per_group,
        system_len=args.system_prompt_len or shape.system_len,
        question_len=args.question_len or shape.question_len,
    )


def dataset_name(args: argparse.Namespace) -> str:
    if args.dataset is None:
        return "file" if args.dataset_path else "random"
    if args.dataset == "file" and args.dataset_path is None:
        raise ValueError("--dataset file needs --dataset-path")
    if args.dataset != "file" and args.dataset_path is not None:
        raise ValueError(
            f"--dataset-path reads a file: it does not go with --dataset {args.dataset}"
        )
    return args.dataset


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def range_ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value
