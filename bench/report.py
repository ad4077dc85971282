"""Write one benchmark's results into its own section of docs/BENCHMARKS.md and a JSON file."""

from __future__ import annotations

import json
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
BENCHMARKS = DOCS / "BENCHMARKS.md"


def device_description(device: str) -> str:
    """How the offline engine runs on `device` by default, for a benchmark's command line."""
    import torch

    if torch.device(device).type == "cpu":
        return f"CPU float32, {torch.get_num_threads()} threads"
    return f"{torch.cuda.get_device_name()}, bfloat16"


def write_section(
    title: str, body: str, raw: dict, json_name: str, document: Path = BENCHMARKS
) -> None:
    """Replace (or append) the section `## title` of `document` (BENCHMARKS.md unless given);
    keep the other sections."""
    (DOCS / "bench").mkdir(parents=True, exist_ok=True)
    (DOCS / "bench" / json_name).write_text(json.dumps(raw, indent=2) + "\n")
    text = document.read_text() if document.exists() else "# Benchmarks\n"
    section = f"## {title}\n\n{body.rstrip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    document.write_text(text)
    print(f"wrote {document.relative_to(DOCS.parent)} and docs/bench/{json_name}")
