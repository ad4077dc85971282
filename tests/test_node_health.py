"""A decode node's health probe reports a channel that a timed-out receive broke only once the
serving loop has settled that receive, its slots held in the quarantine: the cluster replaces
the prefill end of a reported channel, and the replacement frees what the quarantine holds, so
a report that came first would free slots no one had yet held, and /health would never say
they were held. The transfer's thread marks its handle, then the channel, in that order."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from decode_node.node import DecodeNode
from engine import SamplingParams
from engine.request import Request
from metadata.control_auth import new_control_key
from metadata.node_common import NodeOptions
from metadata.serving_node import ServingNode


class _Channel:
    def __init__(self) -> None:
        self.broken: dict[int, str] = {}

    def broken_peers(self) -> dict[int, str]:
        return dict(self.broken)


def _decode_node() -> DecodeNode:
    """The parts of a decode node its health probe reads, without an engine."""
    node = DecodeNode.__new__(DecodeNode)
    ServingNode.__init__(node, NodeOptions("decode", 0, control_key=new_control_key()))
    node._thread = threading.current_thread()  # a running serving loop, for `ping`
    node._channel = _Channel()
    node.receiving = []
    node.streams = SimpleNamespace(error=lambda: None)  # streaming on the serving thread
    return node


def test_a_broken_channel_is_reported_once_its_stuck_receive_is_held():
    node = _decode_node()
    req = Request("stuck", [1] * 5, SamplingParams(max_tokens=4))
    req.slots = list(range(1, 7))
    stuck = SimpleNamespace(handle=SimpleNamespace(peer=3, left_posted=True), req=req)
    node.receiving = [stuck]
    assert node.health().broken_peers == ()  # nothing broken yet

    # The receive timed out on the transfer's thread: its handle, then the channel.
    node._channel.broken[3] = "room 9 timed out"
    health = node.health()
    assert health.broken_peers == ()
    assert "channel with rank 3" in health.degraded

    # The serving loop holds its slots, then forgets it.
    node.quarantine.hold(req, 9, 3, "a receive of its transfer is still posted")
    node.receiving = []
    health = node.health()
    assert health.broken_peers == (3,)
    assert "hold 6 KV slots" in health.degraded


def test_a_receive_that_did_not_time_out_holds_nothing_back():
    node = _decode_node()
    waiting = SimpleNamespace(handle=SimpleNamespace(peer=3, left_posted=False))
    node.receiving = [waiting, SimpleNamespace(handle=None)]
    node._channel.broken[3] = "room 2 timed out"
    assert node.health().broken_peers == (3,)
