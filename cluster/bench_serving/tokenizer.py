"""The tokenizer that measures a benchmark's prompts and reference answers. It only sizes the
requests: the server counts with its own, and its usage counts are what throughput uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tokenizer_source(tokenizer: str | None, model: str) -> str | None:
    """What to load: --tokenizer, else the served model when it names a local path, else None
    (pdcluster's default model, whose tokenizer is always at hand)."""
    if tokenizer is not None:
        return tokenizer
    return model if Path(model).expanduser().exists() else None


def load_bench_tokenizer(source: str | None) -> Any:
    """A Hugging Face tokenizer from a model folder, a GGUF file (converted once, as the engine
    does), a hub name already in the local cache, or None: the default model's."""
    # Imported here: the engine package imports torch, which the flags and --help never need.
    from engine.errors import ModelLoadError
    from engine.loading.weights import load_tokenizer, resolve_model

    if source is None:
        return load_tokenizer(resolve_model(None))
    path = Path(source).expanduser()
    if path.is_dir():
        return load_tokenizer(path)
    if path.is_file():
        return load_tokenizer(resolve_model(path))
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    # Hub lookups fail through many exception types (missing repo, no network, bad files).
    except Exception as err:
        raise ModelLoadError(
            f"could not load the tokenizer {source!r}: {err} (pass --tokenizer with a local "
            "model folder)"
        ) from err
