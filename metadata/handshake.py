"""What a prefill node and a decode node must agree on before any KV moves between them.

The KV and metadata travel as raw tensors whose shapes each side derives from its own config, so
a difference in any field below would not fail loudly: it would deliver bytes of the wrong
meaning. `check_compatible` refuses the pairing instead, naming every field that differs.

`tp_size` is each side's tensor parallel layout: the ranks over which it holds the model's
`num_kv_heads` KV heads (engine/tensor_parallel/kv_routes.py). The two sides may differ, since
each decode rank takes its own heads from a prefill rank that holds them; a side whose size
cannot hold the heads that way (neither divides them nor is a multiple of them) is refused,
naming it, as no route could tell its ranks' heads apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.tensor_parallel.kv_routes import KVHeads

DraftKVShape = tuple[int, int, int]  # (num_layers, num_kv_heads, head_dim) of one draft depth


class PairingError(ValueError):
    """A prefill node and a decode node whose transfer specs differ."""


@dataclass(frozen=True)
class TransferSpec:
    model: str
    kv_dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_layout: str
    spec_hidden_size: int
    num_draft_steps: int
    topk: int
    draft_kv: tuple[DraftKVShape, ...] = ()
    tp_size: int = 1

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (msgpack has no tuples: draft_kv becomes a list of lists)."""
        data = dataclasses.asdict(self)
        data["draft_kv"] = [list(shape) for shape in self.draft_kv]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransferSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"TransferSpec has no field(s) {sorted(unknown)}")
        missing = names - set(data) - {"draft_kv"}
        if missing:
            raise ValueError(f"TransferSpec lacks field(s) {sorted(missing)}")
        for f in dataclasses.fields(cls):
            value = data.get(f.name, ())
            if f.type == "int" and not _is_int(value):
                raise ValueError(f"TransferSpec.{f.name}: expected int, got {value!r}")
            if f.type == "str" and not isinstance(value, str):
                raise ValueError(f"TransferSpec.{f.name}: expected str, got {value!r}")
        draft_kv = data.get("draft_kv", ())
        if not isinstance(draft_kv, list | tuple) or not all(
            isinstance(shape, list | tuple) and len(shape) == 3 and all(_is_int(d) for d in shape)
            for shape in draft_kv
        ):
            raise ValueError(
                f"TransferSpec.draft_kv: expected [[layers, heads, dim], ...], got {draft_kv!r}"
            )
        return cls(**{**data, "draft_kv": tuple(tuple(shape) for shape in draft_kv)})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Fields the two sides need not share (each one's own layout, checked by `layout_problems`).
_PER_SIDE = ("tp_size",)


def spec_mismatches(prefill: TransferSpec, decode: TransferSpec) -> list[str]:
    """One 'field prefill_value != decode_value' entry per differing field, in field order,
    then what either side's tensor parallel layout cannot serve."""
    problems = []
    for f in dataclasses.fields(TransferSpec):
        ours, theirs = getattr(prefill, f.name), getattr(decode, f.name)
        if f.name not in _PER_SIDE and ours != theirs:
            problems.append(f"{f.name} {ours} != {theirs}")
    return problems + layout_problems(prefill, decode)


def layout_problems(prefill: TransferSpec, decode: TransferSpec) -> list[str]:
    """Why the routes between the two sides' ranks cannot be made, one entry per side."""
    problems = []
    for side, spec in (("prefill", prefill), ("decode", decode)):
        why = KVHeads(spec.tp_size, spec.num_kv_heads).splits()
        if why is not None:
            problems.append(f"{side} {why}")
    return problems


def check_compatible(prefill: TransferSpec, decode: TransferSpec) -> None:
    problems = spec_mismatches(prefill, decode)
    if problems:
        raise PairingError("prefill node and decode node cannot pair: " + "; ".join(problems))
