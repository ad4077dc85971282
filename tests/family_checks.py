"""What the model-family tests compare against: transformers' own greedy output, the engine's
logits at every prompt position, and a copy of a model folder with edited config fields."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from engine import LLM, SamplingParams


def hf_greedy(
    hf: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_at_eos: bool = False,
    **generate_options: object,
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one prompt at a time (no padding to
    get wrong); without `stop_at_eos`, exactly `max_new_tokens` tokens each.
    `generate_options`: more of `generate`'s arguments (a repetition penalty, say)."""
    eos = {} if stop_at_eos else {"eos_token_id": None}
    outputs = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                **eos,
                **generate_options,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def every_token_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The engine's logits at every prompt position, all prompts prefilled in one batch."""
    return [logits for logits, _ in every_token_outputs(llm, prompts)]


def every_token_outputs(
    llm: LLM, prompts: list[list[int]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The engine's (logits, draft hidden states) at every prompt position, all prompts
    prefilled in one batch."""
    core = llm.engine
    requests = [
        core.make_request(str(i), p, SamplingParams(max_tokens=1)) for i, p in enumerate(prompts)
    ]
    for req in requests:
        core.kv_cache.grow(req, req.num_tokens)
    batch = core.runner.build_batch(requests)
    outputs = core.runner.forward_every_token(batch)
    for req in requests:
        core.kv_cache.release(req)
    lens = batch.extend_lens
    return list(zip(outputs.logits.split(lens), outputs.hidden.split(lens)))


def edit_config(source: Path, dest: Path, **fields) -> Path:
    """A copy of the model folder `source` at `dest` whose config.json has `fields` set."""
    shutil.copytree(source, dest)
    config_file = dest / "config.json"
    raw = json.loads(config_file.read_text())
    raw.update(fields)
    config_file.write_text(json.dumps(raw, indent=2))
    return dest
