"""More draft steps than a draft has depths: the steps after its depths run its last depth
again (as a one-layer EAGLE draft runs its layer step after step). The weights are shared, the
folder written back keeps each depth once, and an engine running such steps proposes exactly
what it proposes with a folder that holds copies of the last depth, without changing the
greedy output."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from devices import DEVICES
from safetensors.torch import load_file, save_file
from tiny_drafts import make_good_draft, make_predictable_llama, make_random_draft, target_config
from tiny_models import make_tiny_llama

from engine import LLM, ModelLoadError, SamplingParams
from spec import load_draft, save_draft
from spec.config import DraftConfig

SPEC = "multi-layer-eagle"
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3], [7, 7, 2, 30, 31, 8], [40, 41, 42], [100, 3, 3, 3, 9, 11, 12]]


def test_steps_beyond_the_depths_share_the_last_depth(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path / "target", seed=0)
    config = target_config(tmp_path / "target")
    make_random_draft(tmp_path / "draft", tmp_path / "target", 4)
    fewer = load_draft(tmp_path / "draft", config, 2, "cpu", torch.float32)
    assert fewer.num_draft_steps == 2 and fewer.num_stored_depths == 2
    draft = load_draft(tmp_path / "draft", config, 6, "cpu", torch.float32)
    assert draft.num_draft_steps == 6 and draft.num_stored_depths == 4
    assert draft.depths[4] is draft.depths[3] and draft.depths[5] is draft.depths[3]
    assert len(set(draft.depths[:4])) == 4
    alone = load_draft(tmp_path / "draft", config, None, "cpu", torch.float32)
    assert sum(p.numel() for p in draft.parameters()) == sum(p.numel() for p in alone.parameters())
    # Written back, each depth is there once, and the folder runs its four steps by default.
    save_draft(tmp_path / "again", draft)
    assert DraftConfig.load(tmp_path / "again").num_draft_steps == 4
    names = {
        name.split(".")[1] for name in load_file(str(tmp_path / "again" / "model.safetensors"))
    }
    assert names == {"0", "1", "2", "3"}
    for steps in (0, 17):
        with pytest.raises(ModelLoadError, match=f"num_draft_steps={steps}: must be 1 to 16"):
            load_draft(tmp_path / "draft", config, steps, "cpu", torch.float32)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(a predictable target, a two-depth draft whose depths differ, the same draft with
    depth 1 copied into depths 2 and 3)."""
    root = tmp_path_factory.mktemp("reused_depth")
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "draft", root / "target", 2, noise=0.03, seed=1)
    tensors = load_file(str(root / "draft" / "model.safetensors"))
    assert not torch.equal(tensors["depths.0.fc.weight"], tensors["depths.1.fc.weight"])
    for d in (2, 3):
        for name in [n for n in tensors if n.startswith("depths.1.")]:
            tensors[name.replace("depths.1.", f"depths.{d}.", 1)] = tensors[name].clone()
    copied = root / "copied"
    copied.mkdir()
    save_file(tensors, str(copied / "model.safetensors"))
    config = dataclasses.replace(DraftConfig.load(root / "draft"), num_draft_steps=4)
    (copied / "config.json").write_text(json.dumps(config.to_json()))
    assert DraftConfig.load(copied).num_draft_steps == 4
    return root / "target", root / "draft", copied


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [{}, {"speculative_topk": 2, "num_draft_tokens": 12}])
def test_an_engine_runs_the_last_depth_again(
    models: tuple[Path, Path, Path], shape: dict, device: str
) -> None:
    """Where the engine runs graphs (CUDA), each step replays its own, over shared weights."""
    target, draft, copied = models
    plain = LLM(str(target), device=device).generate(PROMPTS, GREEDY)
    runs = {}
    for name, folder, steps in (("reused", draft, 4), ("copied", copied, None)):
        llm = LLM(
            str(target),
            device=device,
            speculative_algorithm=SPEC,
            draft_model=str(folder),
            num_draft_steps=steps,
            **shape,
        )
        assert llm.engine.speculator.num_draft_steps == 4
        runs[name] = llm.generate(PROMPTS, GREEDY)
    for reused, copied_out, expected in zip(runs["reused"], runs["copied"], plain):
        assert reused.token_ids == expected.token_ids
        assert copied_out.token_ids == expected.token_ids
        assert reused.usage == copied_out.usage
    accepted = [sum(x) for x in zip(*(o.usage.spec_accepted_per_position for o in runs["reused"]))]
    # The reused depth's own drafts are accepted at the third and fourth positions.
    assert len(accepted) == 4 and accepted[2] > 0 and accepted[3] > 0
