"""Node load as the nodes report it (metadata.frontend_links.LoadReports, NodeLoad): each node
tells every front end the requests it holds when that changes (at most every 20 ms, at least
every 2 s), and `least_load` weighs the node's own count plus what this front end sent it
since, not this front end's share of the requests alone (with several API processes, each
sees only its own)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from cluster.control.node_state import NodeState
from cluster.control.policies import LeastLoad
from cluster.control.router import Router
from engine.sampling.sampling_params import SamplingParams
from metadata.control import Inbox, Outbox
from metadata.control_auth import new_control_key
from metadata.frontend_links import (
    LOAD_REPORT_MAX_INTERVAL_S,
    LOAD_REPORT_MIN_INTERVAL_S,
    FrontendLinks,
    LoadReports,
)
from metadata.messages import GenerateRequest, NodeLoad


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)

    def close(self) -> None:
        pass


def test_a_node_reports_a_change_at_once_then_at_most_every_20_ms_and_at_least_every_2_s():
    clock = Clock()
    boxes: dict[str, Recorder] = {}

    def outbox(endpoint: str, key: bytes) -> Recorder:
        return boxes.setdefault(endpoint, Recorder(endpoint))

    links = FrontendLinks(new_control_key(), make_outbox=outbox)
    links.open(1, "tcp://a:1")
    reports = LoadReports(links, "decode", 3, clock=clock)
    sent = boxes["tcp://a:1"].sent
    reports.tick(5, 100, 1000)
    assert sent == [NodeLoad("decode", 3, 5, 100, 1000)]
    reports.tick(6, 100, 1000)  # changed, but within the minimum interval
    assert len(sent) == 1
    clock.now += LOAD_REPORT_MIN_INTERVAL_S * 1.5
    reports.tick(6, 100, 1000)
    assert sent[-1].requests == 6 and len(sent) == 2
    clock.now += 1.0
    reports.tick(6, 100, 1000)  # unchanged: nothing yet
    assert len(sent) == 2
    clock.now += LOAD_REPORT_MAX_INTERVAL_S
    reports.tick(6, 100, 1000)  # unchanged, but due
    assert len(sent) == 3
    links.open(2, "tcp://b:1")  # a new front end hears the load at the next chance
    clock.now += LOAD_REPORT_MIN_INTERVAL_S * 1.5
    reports.tick(6, 100, 1000)
    assert boxes["tcp://b:1"].sent == [NodeLoad("decode", 3, 6, 100, 1000)]


def test_least_load_weighs_what_nodes_report_plus_what_was_sent_since():
    nodes = [NodeState("decode", i, None) for i in range(2)]
    policy = LeastLoad()
    # Before any report: this front end's own requests in flight.
    nodes[0].in_flight = 1
    assert policy.pick(nodes, []) is nodes[1]
    # Node 1 holds 5 requests of other front ends: this front end's count knows nothing of them.
    nodes[0].reported(2)
    nodes[1].reported(5)
    assert policy.pick(nodes, []) is nodes[0]
    nodes[0].routed_since_report = 4  # sent since its report
    assert policy.pick(nodes, []) is nodes[1]
    nodes[0].reported(1)  # its next report counts them itself
    assert nodes[0].load == 1 and policy.pick(nodes, []) is nodes[0]
    nodes[1].forget_load()  # a replacement: back to this front end's own count
    assert nodes[1].load == nodes[1].in_flight == 0


@pytest.mark.parametrize("loads, expected", [((9, 0), 1), ((0, 9), 0)])
def test_a_router_routes_by_the_load_the_nodes_reported(loads, expected):
    """Two fake replicas (inboxes) report their load to a router that sent them nothing: its
    next request goes to the one that reported less."""
    key = new_control_key()
    inboxes = [Inbox("127.0.0.1", key) for _ in range(2)]
    nodes = [NodeState("replica", i, None, box.endpoint) for i, box in enumerate(inboxes)]
    spec = SimpleNamespace(
        tokenizer=None,
        path=SimpleNamespace(name="model"),
        engine_config=SimpleNamespace(max_model_len=64, max_tokens_cap=None, max_num_seqs=8),
    )
    router = Router(spec, [], nodes, kv_cache_tokens=64, control_key=key, watch_health=False)

    async def scenario() -> list[int]:
        await router.start()
        try:
            reporter = Outbox(router.endpoint, key)  # kept: a closed socket drops its queue
            for index, requests in enumerate(loads):
                reporter.send(NodeLoad("replica", index, requests, 0, 64))
            for _ in range(500):
                if all(node.reported_requests is not None for node in nodes):
                    break
                await asyncio.sleep(0.01)
            stream = router.generate("r", [1, 2, 3], SamplingParams(max_tokens=4))
            first = asyncio.ensure_future(stream.__anext__())
            received: list[int] = []
            for _ in range(500):
                received += [
                    index
                    for index, box in enumerate(inboxes)
                    for msg in box.receive(0)
                    if isinstance(msg, GenerateRequest)
                ]
                if received:
                    break
                await asyncio.sleep(0.01)
            first.cancel()
            await stream.aclose()
            reporter.close()
            return received
        finally:
            await router.close()

    try:
        assert asyncio.run(scenario()) == [expected]
    finally:
        for box in inboxes:
            box.close()
