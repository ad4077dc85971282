"""Serving nodes built through their constructors over a tiny model on the CPU, for tests of a
node's bookkeeping that drive its handlers directly: no Ray, no process group and no serving
thread. What a node would reach over the network (its peers' outboxes, the KV channel, the
front ends' streams) is replaced after construction by a recorder the test reads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from decode_node.node import DecodeNode
from engine.loading.loader import EngineArgs
from metadata.control_auth import new_control_key
from metadata.node_common import NodeOptions
from metadata.serving_node import ServingNode
from prefill_node.node import PrefillNode


def node_args(model: Path, kv_cache_tokens: int, **engine: object) -> EngineArgs:
    """A CPU engine over `model` whose pool holds `kv_cache_tokens` slots (by default, and no
    more than that many tokens a request)."""
    engine.setdefault("max_model_len", kv_cache_tokens)
    return EngineArgs(
        model=str(model), device="cpu", dtype="float32", kv_cache_tokens=kv_cache_tokens, **engine
    )


def node_options(role: str, metadata_rows: int, **options: object) -> NodeOptions:
    return NodeOptions(
        role, 0, metadata_rows=metadata_rows, control_key=new_control_key(), **options
    )


@contextmanager
def built(node: ServingNode) -> Iterator[ServingNode]:
    """`node`, its sockets closed afterwards (its serving loop, which would, never ran)."""
    try:
        yield node
    finally:
        node.shutdown()
        node.inbox.close()
        node.frontends.close()


def new_decode_node(model: Path, kv_cache_tokens: int, metadata_rows: int, **engine) -> DecodeNode:
    return DecodeNode(
        node_args(model, kv_cache_tokens, **engine), node_options("decode", metadata_rows)
    )


def new_prefill_node(
    model: Path, kv_cache_tokens: int, metadata_rows: int, **engine
) -> PrefillNode:
    return PrefillNode(
        node_args(model, kv_cache_tokens, **engine), node_options("prefill", metadata_rows)
    )
