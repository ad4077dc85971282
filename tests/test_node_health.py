"""A decode node's health probe reports a channel that a timed-out receive broke only once the
serving loop has settled that receive, its slots held in the quarantine: the cluster replaces
the prefill end of a reported channel, and the replacement frees what the quarantine holds, so
a report that came first would free slots no one had yet held, and /health would never say
they were held. The transfer's thread marks its handle, then the channel, in that order."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from node_builders import built, new_decode_node

from decode_node.node import DecodeNode
from engine import SamplingParams
from engine.request import Request


class _Channel:
    def __init__(self) -> None:
        self.broken: dict[int, str] = {}

    def broken_peers(self) -> dict[int, str]:
        return dict(self.broken)

    def close(self) -> None:
        pass


@pytest.fixture
def node(tiny_model_path: Path) -> Iterator[DecodeNode]:
    """A decode node over the tiny model whose probe finds a serving thread running (one that
    waits for the node to stop: the loop itself would settle the receives the test sets) and
    its channel the test's."""
    with built(new_decode_node(tiny_model_path, 64, 2)) as decode:
        decode._thread = threading.Thread(target=decode._stop.wait, daemon=True)
        decode._thread.start()
        decode._channel = _Channel()
        yield decode


def test_a_broken_channel_is_reported_once_its_stuck_receive_is_held(node: DecodeNode):
    req = Request("stuck", [1] * 5, SamplingParams(max_tokens=4))
    req.slots = list(range(1, 7))
    stuck = SimpleNamespace(handle=SimpleNamespace(peer=3, left_posted=True), req=req)
    node.incoming.requests = [stuck]
    assert node.health().broken_peers == ()  # nothing broken yet

    # The receive timed out on the transfer's thread: its handle, then the channel.
    node._channel.broken[3] = "room 9 timed out"
    health = node.health()
    assert health.broken_peers == ()
    assert "channel with rank 3" in health.degraded

    # The serving loop holds its slots, then forgets it.
    node.quarantine.hold(req, 9, 3, "a receive of its transfer is still posted")
    node.incoming.requests = []
    health = node.health()
    assert health.broken_peers == (3,)
    assert "hold 6 KV slots" in health.degraded


def test_a_receive_that_did_not_time_out_holds_nothing_back(node: DecodeNode):
    waiting = SimpleNamespace(handle=SimpleNamespace(peer=3, left_posted=False))
    node.incoming.requests = [waiting, SimpleNamespace(handle=None)]
    node._channel.broken[3] = "room 2 timed out"
    assert node.health().broken_peers == (3,)
