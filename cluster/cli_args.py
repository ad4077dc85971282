"""Command-line arguments that several `pdcluster` commands take."""

from __future__ import annotations

import argparse


def add_model_args(parser: argparse.ArgumentParser, model_help: str, dtype_help: str) -> None:
    """--model, --device and --dtype, as every command that loads a model takes them."""
    parser.add_argument("--model", default=None, help=model_help)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help=f"{dtype_help} (default: float32 on CPU, bfloat16 on GPU)",
    )


def layer_list(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated layer numbers."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"expected layer numbers like 0,3,5, got {text!r}"
        ) from err
