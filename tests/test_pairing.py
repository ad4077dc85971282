"""A decode node refuses, at connect time, a prefill node whose transfer layout differs."""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_llama

from decode_node import DecodeNode
from engine.loading.loader import EngineArgs
from metadata.control_auth import new_control_key
from metadata.handshake import PairingError, TransferSpec
from metadata.node_common import NodeOptions


@pytest.fixture(scope="module")
def decode_node(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairing")
    make_tiny_llama(path)
    node = DecodeNode(
        EngineArgs(model=str(path), device="cpu", kv_cache_tokens=256, max_model_len=128),
        NodeOptions("decode", 0, control_key=new_control_key()),
    )
    yield node
    node.inbox.close()


def _spec(node: DecodeNode, **changes) -> dict:
    return {**node.describe()["spec"], **changes}


def test_identical_prefill_pairs(decode_node):
    decode_node.connect({0: "tcp://127.0.0.1:1"}, {0: _spec(decode_node)}, {0: 0})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kv_dtype", "torch.bfloat16"),
        ("spec_hidden_size", 128),
        ("num_layers", 3),
        ("page_size", 16),
        ("kv_layout", "layer-major HND"),
        ("model", "another-model:0000"),
    ],
)
def test_mismatch_is_refused_naming_it(decode_node, field, value):
    mine = decode_node.describe()["spec"][field]
    with pytest.raises(PairingError) as err:
        decode_node.connect(
            {0: "tcp://127.0.0.1:1", 1: "tcp://127.0.0.1:3"},
            {0: _spec(decode_node), 1: _spec(decode_node, **{field: value})},
            {0: 0, 1: 1},
        )
    message = str(err.value)
    assert "prefill-1" in message and field in message
    assert str(value) in message and str(mine) in message


def test_spec_round_trips_through_a_dict(decode_node):
    spec = decode_node.describe()["spec"]
    assert TransferSpec.from_dict(spec).to_dict() == spec
