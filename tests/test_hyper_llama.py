"""The minimal hyper-connection Llama (engine.models.hyper_llama). No one else wrote it, so there
is no transformers reference: with one copy and unit mixing weights it is the plain Llama bit for
bit, and with two copies and random mixes its batched and cached forwards equal one-by-one and
from-scratch ones. Its checkpoint loads from safetensors with typed refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from family_checks import every_token_outputs
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_hyper_llama, make_tiny_llama, widen_to_hyper_llama

from engine import LLM, ModelLoadError, SamplingParams, UnsupportedModelError
from engine.loading.weights import SUPPORTED_ARCHITECTURES

PROMPTS = [[1, 17, 99, 4, 250, 31, 8], [1, 200], list(range(3, 40)), [5] * 13]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hyper_llama")
    make_tiny_llama(root / "llama", seed=0, num_hidden_layers=3)
    shutil.copytree(root / "llama", root / "hc1")
    widen_to_hyper_llama(root / "hc1", hc_mult=1, mix_noise=0.0)
    make_tiny_hyper_llama(root / "hc2", seed=1, hc_mult=2, mix_noise=0.3)
    return {"llama": root / "llama", "hc1": root / "hc1", "hc2": root / "hc2"}


def _llm(path: Path) -> LLM:
    return LLM(str(path), device="cpu", kv_cache_tokens=1024, max_num_seqs=8)


def test_one_copy_with_unit_mixing_is_the_plain_llama_exactly(folders) -> None:
    plain, hyper = _llm(folders["llama"]), _llm(folders["hc1"])
    assert type(hyper.engine.runner.model).__name__ == "HyperLlamaForCausalLM"
    assert hyper.model_config.hc_mult == 1
    for (ours, ours_hidden), (theirs, theirs_hidden) in zip(
        every_token_outputs(hyper, PROMPTS), every_token_outputs(plain, PROMPTS)
    ):
        assert torch.equal(ours, theirs)
        assert torch.equal(ours_hidden, theirs_hidden)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in hyper.generate(PROMPTS, params)] == [
        o.token_ids for o in plain.generate(PROMPTS, params)
    ]


def test_the_stream_is_hc_mult_copies_wide(folders) -> None:
    llm = _llm(folders["hc2"])
    config = llm.model_config
    assert config.hc_mult == 2 and config.spec_hidden_size == 2 * config.hidden_size
    (logits, hidden), *_ = every_token_outputs(llm, PROMPTS[:1])
    assert logits.shape == (len(PROMPTS[0]), config.vocab_size)
    assert hidden.shape == (len(PROMPTS[0]), 2 * config.hidden_size)
    # Random mixes make the copies differ: the draft sees more than one copy's worth.
    copies = hidden.unflatten(-1, (2, config.hidden_size))
    assert not torch.allclose(copies[:, 0], copies[:, 1])


def test_batched_equals_one_by_one(folders) -> None:
    llm = _llm(folders["hc2"])
    batched = every_token_outputs(llm, PROMPTS)
    for prompt, (logits, hidden) in zip(PROMPTS, batched):
        ((alone_logits, alone_hidden),) = every_token_outputs(llm, [prompt])
        torch.testing.assert_close(logits, alone_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hidden, alone_hidden, atol=1e-5, rtol=1e-5)


def test_decode_with_cache_equals_full_recompute(folders) -> None:
    llm = _llm(folders["hc2"])
    core, runner = llm.engine, llm.engine.runner
    prompt = PROMPTS[2]
    ((full_logits, full_hidden),) = every_token_outputs(llm, [prompt])
    split = len(prompt) - 5
    req = core.make_request("0", prompt[:split], SamplingParams(max_tokens=8))
    core.kv_cache.grow(req, split)
    runner.forward(runner.build_batch([req]))
    req.kv_len = split
    for position in range(split, len(prompt)):
        # One token at a time over the cached prefix: a decode step, teacher-forced.
        req.output_token_ids.append(prompt[position])
        core.kv_cache.grow(req, 1)
        out = runner.forward(runner.build_batch([req]))
        req.kv_len = position + 1
        torch.testing.assert_close(out.logits[0], full_logits[position], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.last_hidden[0], full_hidden[position], atol=1e-4, rtol=1e-4)
    core.kv_cache.release(req)
    assert core.kv_cache.is_empty()


def test_checkpoint_is_checked(folders, tmp_path: Path) -> None:
    assert "HyperLlamaForCausalLM" in SUPPORTED_ARCHITECTURES
    broken = tmp_path / "broken"
    shutil.copytree(folders["hc2"], broken)
    weights = broken / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.hc_write"}, str(weights))
    with pytest.raises(ModelLoadError, match=r"lacks 1 weights.*model\.layers\.1\.hc_write"):
        _llm(broken)
    save_file({**tensors, "model.hc_head": torch.ones(3)}, str(weights))
    with pytest.raises(ModelLoadError, match=r"model\.hc_head.*\(3,\).*\(2,\)"):
        _llm(broken)

    # A widened stream needs the architecture that has one.
    save_file(tensors, str(weights))
    config_file = broken / "config.json"
    raw = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**raw, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="hc_mult=2 needs .*HyperLlamaForCausalLM"):
        _llm(broken)
