"""The draft folder's config.json (see docs/draft-format.md), read once and checked against the
target model it is meant to run with."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.model_config import ModelConfig

DRAFT_ARCHITECTURE = "pdcluster-multi-layer-eagle"
# The target's shapes a draft is built for: each must equal the target's own value.
TARGET_FIELDS = (
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
)


class DraftMismatchError(ModelLoadError):
    """The draft was made for a target of other shapes than the one it is loaded with."""


@dataclass(frozen=True)
class DraftConfig:
    num_draft_steps: int
    spec_hidden_size: int  # width of the target hidden state depth 0 reads
    hidden_size: int  # width of every depth's output (the target's hidden_size)
    target: dict[str, Any]  # the target's shapes (TARGET_FIELDS) and a "model" name
    # The target layers whose outputs depth 0 reads side by side (EAGLE3 style); () for the
    # last layer's output alone.
    aux_layers: tuple[int, ...] = ()
    # Tokens the draft may propose (the `draft_vocab` tensor); None: the target's whole vocabulary.
    draft_vocab_size: int | None = None
    # Width of every depth's MLP; None: the target's `intermediate_size`. A narrower MLP buys
    # more depths within the same bytes.
    intermediate_size: int | None = None
    # The draft steps an engine runs when not told (`num_draft_steps=None`): more than the depths
    # for a draft trained to run its last depth again; None: `num_draft_steps`.
    default_draft_steps: int | None = None

    @property
    def default_steps(self) -> int:
        return self.default_draft_steps or self.num_draft_steps

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        num_draft_steps: int,
        name: str,
        draft_vocab_size: int | None = None,
        intermediate_size: int | None = None,
        default_draft_steps: int | None = None,
    ) -> DraftConfig:
        if intermediate_size == target.intermediate_size:
            intermediate_size = None
        if default_draft_steps == num_draft_steps:
            default_draft_steps = None
        return cls(
            num_draft_steps=num_draft_steps,
            spec_hidden_size=target.spec_hidden_size,
            hidden_size=target.hidden_size,
            target={"model": name, **target_shapes(target)},
            aux_layers=target.draft_aux_layers,
            draft_vocab_size=draft_vocab_size,
            intermediate_size=intermediate_size,
            default_draft_steps=default_draft_steps,
        )

    def to_json(self) -> dict[str, Any]:
        raw = {
            "architecture": DRAFT_ARCHITECTURE,
            "num_draft_steps": self.num_draft_steps,
            "spec_hidden_size": self.spec_hidden_size,
            "hidden_size": self.hidden_size,
            "target": dict(self.target),
        }
        if self.aux_layers:
            raw["aux_layers"] = list(self.aux_layers)
        if self.draft_vocab_size is not None:
            raw["draft_vocab_size"] = self.draft_vocab_size
        if self.intermediate_size is not None:
            raw["intermediate_size"] = self.intermediate_size
        if self.default_draft_steps is not None:
            raw["default_draft_steps"] = self.default_draft_steps
        return raw

    @classmethod
    def load(cls, folder: Path) -> DraftConfig:
        file = Path(folder) / "config.json"
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"could not read the draft config {file}: {err}") from err
        if not isinstance(raw, dict) or raw.get("architecture") != DRAFT_ARCHITECTURE:
            found = raw.get("architecture") if isinstance(raw, dict) else None
            raise ModelLoadError(
                f"{file}: architecture {found!r} is not a draft model "
                f"(expected {DRAFT_ARCHITECTURE!r})"
            )
        missing = [
            k
            for k in ("num_draft_steps", "spec_hidden_size", "hidden_size", "target")
            if k not in raw
        ]
        target = raw.get("target")
        if not isinstance(target, dict):
            missing.append("target (an object)")
        else:
            missing += [f"target.{k}" for k in TARGET_FIELDS if k not in target]
        if missing:
            raise ModelLoadError(f"{file} lacks {', '.join(missing)}")
        if not isinstance(raw["num_draft_steps"], int) or raw["num_draft_steps"] < 1:
            raise ModelLoadError(f"{file}: num_draft_steps must be >= 1")
        aux_layers = raw.get("aux_layers", [])
        if (
            not isinstance(aux_layers, list)
            or not all(type(i) is int and i >= 0 for i in aux_layers)
            or len(set(aux_layers)) != len(aux_layers)
        ):
            raise ModelLoadError(
                f"{file}: aux_layers must be a list of distinct target layer indices, "
                f"got {aux_layers!r}"
            )
        default_steps = _optional_positive_int(raw, "default_draft_steps", file)
        if default_steps is not None and default_steps < raw["num_draft_steps"]:
            raise ModelLoadError(
                f"{file}: default_draft_steps ({default_steps}) is fewer than num_draft_steps "
                f"({raw['num_draft_steps']})"
            )
        return cls(
            int(raw["num_draft_steps"]),
            int(raw["spec_hidden_size"]),
            int(raw["hidden_size"]),
            dict(target),
            tuple(aux_layers),
            _optional_positive_int(raw, "draft_vocab_size", file),
            _optional_positive_int(raw, "intermediate_size", file),
            default_steps,
        )

    def check_target(self, target: ModelConfig, folder: Path) -> None:
        """Refuse a target this draft was not made for, naming the draft's and the target's
        value of every field that differs."""
        ours = {k: self.target[k] for k in TARGET_FIELDS}
        ours["aux_layers"] = list(self.aux_layers)
        ours["spec_hidden_size"] = self.spec_hidden_size
        ours["draft hidden_size"] = self.hidden_size
        theirs = {
            **target_shapes(target),
            "aux_layers": list(target.draft_aux_layers),
            "spec_hidden_size": target.spec_hidden_size,
            "draft hidden_size": target.hidden_size,
        }
        differ = [
            f"{name}: draft {ours[name]}, target {theirs[name]}"
            for name in ours
            if ours[name] != theirs[name]
        ]
        if differ:
            raise DraftMismatchError(
                f"draft {folder} does not fit the target model ({'; '.join(differ)})"
            )


def _optional_positive_int(raw: dict[str, Any], key: str, file: Path) -> int | None:
    value = raw.get(key)
    if value is not None and (type(value) is not int or value < 1):
        raise ModelLoadError(f"{file}: {key} must be a positive integer, got {value!r}")
    return value


def draft_target_config(target: ModelConfig, draft_model: str | os.PathLike | None) -> ModelConfig:
    """`target` as an engine must build it to run the draft in `draft_model`: with the target
    layers the draft reads (`aux_layers`) as `draft_aux_layers`, from which `spec_hidden_size`
    follows. Unchanged without a draft folder (build_speculator then says it is missing)."""
    if draft_model is None:
        return target
    folder = Path(draft_model)
    config = DraftConfig.load(folder)
    outside = [i for i in config.aux_layers if i >= target.num_layers]
    if outside:
        raise DraftMismatchError(
            f"draft {folder} reads target layers {list(config.aux_layers)}, but the target has "
            f"{target.num_layers} layers (0..{target.num_layers - 1})"
        )
    return dataclasses.replace(target, draft_aux_layers=config.aux_layers)


def target_shapes(config: ModelConfig) -> dict[str, int]:
    return {
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
    }
