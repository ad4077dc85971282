"""TransferSpec pairing: identical specs pair; any difference is refused with every differing
field named with both values, but each side's tensor parallel size, which may differ and is
refused only where it cannot hold the KV heads; the spec survives a msgpack round trip."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from metadata.handshake import PairingError, TransferSpec, check_compatible

SPEC = TransferSpec(
    model="SmolLM2-135M@abc123",
    kv_dtype="torch.bfloat16",
    page_size=1,
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
    kv_layout="slot-major NHD",
    spec_hidden_size=576,
    num_draft_steps=3,
    topk=1,
    draft_kv=((1, 3, 64), (1, 3, 64), (1, 3, 64)),
)

CHANGED = {
    "model": "SmolLM2-360M@def456",
    "kv_dtype": "torch.float32",
    "page_size": 16,
    "num_layers": 32,
    "num_kv_heads": 4,
    "head_dim": 128,
    "kv_layout": "layer-major HND",
    "spec_hidden_size": 1152,
    "num_draft_steps": 2,
    "topk": 4,
    "draft_kv": ((1, 3, 64),),
}


def test_identical_specs_pair() -> None:
    check_compatible(SPEC, dataclasses.replace(SPEC))


# Each side's own: the two may differ.
PER_SIDE = {"tp_size"}


def test_every_field_is_covered() -> None:
    assert set(CHANGED) | PER_SIDE == {f.name for f in dataclasses.fields(TransferSpec)}


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 3), (3, 1), (3, 6), (6, 3)])
def test_sides_of_different_tensor_parallel_sizes_pair(prefill_tp: int, decode_tp: int) -> None:
    check_compatible(
        dataclasses.replace(SPEC, tp_size=prefill_tp), dataclasses.replace(SPEC, tp_size=decode_tp)
    )


def test_a_size_that_cannot_hold_the_kv_heads_is_refused_naming_the_side() -> None:
    """3 KV heads over 2 ranks: no rank would hold a whole set of heads, so no route between
    the two sides' ranks can be drawn."""
    with pytest.raises(PairingError) as err:
        check_compatible(SPEC, dataclasses.replace(SPEC, tp_size=2))
    assert str(err.value) == (
        "prefill node and decode node cannot pair: decode tp_size 2 neither divides "
        "num_kv_heads 3 nor is a multiple of it"
    )
    with pytest.raises(PairingError, match="prefill tp_size 4 neither divides num_kv_heads 3"):
        check_compatible(dataclasses.replace(SPEC, tp_size=4), SPEC)


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_single_mismatch_names_the_field_and_both_values(field: str) -> None:
    decode = dataclasses.replace(SPEC, **{field: CHANGED[field]})
    with pytest.raises(PairingError) as err:
        check_compatible(SPEC, decode)
    message = str(err.value)
    assert message.startswith("prefill node and decode node cannot pair: ")
    assert f"{field} {getattr(SPEC, field)} != {CHANGED[field]}" in message
    assert message.count("!=") == 1


def test_all_mismatches_are_named() -> None:
    decode = dataclasses.replace(SPEC, spec_hidden_size=1152, kv_dtype="torch.float32")
    with pytest.raises(PairingError) as err:
        check_compatible(SPEC, decode)
    assert str(err.value) == (
        "prefill node and decode node cannot pair: kv_dtype torch.bfloat16 != torch.float32; "
        "spec_hidden_size 576 != 1152"
    )


def test_pairing_error_is_a_value_error() -> None:
    assert issubclass(PairingError, ValueError)


def test_round_trip_through_msgpack() -> None:
    wire = msgpack.packb(SPEC.to_dict())
    assert TransferSpec.from_dict(msgpack.unpackb(wire)) == SPEC
    assert TransferSpec.from_dict(SPEC.to_dict()) == SPEC


def test_from_dict_rejects_unknown_and_missing_fields() -> None:
    with pytest.raises(ValueError, match="no field"):
        TransferSpec.from_dict({**SPEC.to_dict(), "colour": "blue"})
    data = SPEC.to_dict()
    del data["topk"]
    with pytest.raises(ValueError, match="lacks field.*topk"):
        TransferSpec.from_dict(data)


def test_from_dict_rejects_wrong_types() -> None:
    with pytest.raises(ValueError, match="num_layers: expected int"):
        TransferSpec.from_dict({**SPEC.to_dict(), "num_layers": "30"})
    with pytest.raises(ValueError, match="draft_kv"):
        TransferSpec.from_dict({**SPEC.to_dict(), "draft_kv": [[1, 3]]})
