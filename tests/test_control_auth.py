"""The control plane is authenticated: every frame carries an HMAC-SHA256 under the cluster's key
over a per-sender counter, so a socket drops (and counts) what is unsigned, tampered with, signed
with another key, meant for another socket, or replayed. Past authentication, a decode node takes
a TransferAnnounce only from the prefill rank its request went to, for the prompt's token count
and draft depths it receives; anything else is received into scratch (the order of the pair's
transfers holds) and fails that request with a clear error, holding nothing. A forged
announcement sent to a live cluster's decode node is dropped, and the next request is served."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgpack
import pytest
import zmq
from cluster_helpers import launch, serve, wait_for
from prometheus_client.parser import text_string_to_metric_families
from test_early_announce import PREFILL_RANK, PROMPT, ROOM, ScratchReceiver, announced_decode_node
from tiny_models import make_tiny_llama

from cluster.client import Client
from cluster.control.metrics import ClusterMetrics
from engine import LLM, SamplingParams
from metadata.control import Inbox, Outbox
from metadata.control_auth import KEY_BYTES, FrameSigner, FrameVerifier, new_control_key
from metadata.messages import AbortRequest, TokenFrame, TransferAnnounce, decode, encode
from metadata.transfer import TransferHandle, TransferState
from metadata.wire import kv_nbytes

ENDPOINT = "tcp://127.0.0.1:5555"
MESSAGE = encode(AbortRequest(room=7))
REJECTED = "pdcluster_control_messages_rejected_total"
FRONTEND_REJECTED = "pdcluster_frontend_control_messages_rejected_total"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- frames ---
def test_a_frame_signed_with_the_key_opens_to_its_message():
    key = new_control_key()
    signer, verifier = FrameSigner(key, ENDPOINT), FrameVerifier(key, ENDPOINT)
    frames = [signer.sign(MESSAGE) for _ in range(3)]
    assert [verifier.open(frame) for frame in frames] == [MESSAGE] * 3
    assert decode(verifier.open(signer.sign(MESSAGE))) == AbortRequest(room=7)
    assert verifier.rejected == 0


def tampered(frame: bytes, at: int) -> bytes:
    at %= len(frame)
    return frame[:at] + bytes([frame[at] ^ 1]) + frame[at + 1 :]


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(lambda key: tampered(FrameSigner(key, ENDPOINT).sign(MESSAGE), 20), id="body"),
        pytest.param(lambda key: tampered(FrameSigner(key, ENDPOINT).sign(MESSAGE), 5), id="id"),
        pytest.param(lambda key: tampered(FrameSigner(key, ENDPOINT).sign(MESSAGE), 12), id="n"),
        pytest.param(lambda key: tampered(FrameSigner(key, ENDPOINT).sign(MESSAGE), -1), id="tag"),
        pytest.param(lambda key: FrameSigner(new_control_key(), ENDPOINT).sign(MESSAGE), id="key"),
        pytest.param(lambda key: FrameSigner(key, "tcp://127.0.0.1:1").sign(MESSAGE), id="dest"),
        pytest.param(lambda key: encode(TransferAnnounce(1, 0, 8)), id="unsigned"),
        pytest.param(lambda key: b"\x01" + encode(TransferAnnounce(1, 0, 8)), id="no-tag"),
        pytest.param(lambda key: msgpack.packb({"type": "TransferAnnounce"}), id="short"),
        pytest.param(lambda key: b"\x02" + FrameSigner(key, ENDPOINT).sign(MESSAGE)[1:], id="v2"),
    ],
)
def test_a_forged_frame_is_dropped_and_counted(forge):
    key = new_control_key()
    verifier = FrameVerifier(key, ENDPOINT)
    assert verifier.open(forge(key)) is None
    assert verifier.rejected == 1


def test_a_replayed_frame_is_dropped_and_counted_and_senders_count_apart():
    key = new_control_key()
    first, second = FrameSigner(key, ENDPOINT), FrameSigner(key, ENDPOINT)
    verifier = FrameVerifier(key, ENDPOINT)
    one, two = first.sign(MESSAGE), first.sign(MESSAGE)
    assert verifier.open(two) == MESSAGE
    assert verifier.open(two) is None  # the same frame again
    assert verifier.open(one) is None  # an older frame of that sender, seen late
    assert verifier.open(second.sign(MESSAGE)) == MESSAGE  # another sender has its own count
    assert verifier.open(first.sign(MESSAGE)) == MESSAGE
    assert verifier.rejected == 2


def test_rejections_are_logged_at_most_once_per_interval(caplog):
    clock = FakeClock()
    verifier = FrameVerifier(new_control_key(), ENDPOINT, log_interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="metadata.control_auth"):
        for _ in range(1000):
            verifier.open(MESSAGE)
        clock.now += 10.0
        verifier.open(MESSAGE)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and verifier.rejected == 1001
    assert "dropped 1 control message(s)" in lines[0]
    assert "dropped 1000 control message(s) since the last report (1001 in all)" in lines[1]


def test_a_key_is_required():
    with pytest.raises(ValueError, match=f"at least {KEY_BYTES} bytes"):
        FrameVerifier(b"short", ENDPOINT)
    with pytest.raises(ValueError, match=f"at least {KEY_BYTES} bytes"):
        Outbox(ENDPOINT, b"")


# --- sockets ---
def receive_until(inbox: Inbox, count: int, rejected: int, timeout_s: float = 10.0) -> list:
    messages, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        messages += inbox.receive(50)
        if len(messages) >= count and inbox.rejected >= rejected:
            break
    return messages


def test_an_inbox_takes_its_clusters_messages_and_drops_and_counts_the_rest():
    key = new_control_key()
    context = zmq.Context()
    inbox = Inbox("127.0.0.1", key, context)
    raw = context.socket(zmq.PUSH)
    raw.connect(inbox.endpoint)
    outbox, stranger = Outbox(inbox.endpoint, key, context), Outbox(inbox.endpoint, b"x" * 32)
    try:
        announce = TransferAnnounce(room=99, prefill_rank=0, num_tokens=4)
        raw.send(encode(announce))  # unsigned
        stranger.send(announce)  # signed with another key
        captured = FrameSigner(key, inbox.endpoint).sign(encode(AbortRequest(5)))
        raw.send(captured)
        raw.send(captured)  # replayed
        outbox.send(AbortRequest(6))
        messages = receive_until(inbox, count=2, rejected=3)
        # Two sockets: the inbox takes their messages in no set order.
        assert sorted(m.room for m in messages) == [5, 6]
        assert inbox.rejected == 3
    finally:
        raw.close(linger=0)
        for socket in (outbox, stranger, inbox):
            socket.close()
        context.term()


# --- what a decode node takes from an authenticated prefill node ---
@pytest.fixture
def announced_node(tiny_model_path: Path) -> Iterator[Callable[[], tuple]]:
    """Decode nodes over the tiny model (tests/test_early_announce.py) whose request ROOM, of
    PROMPT, went to prefill-0 (rank PREFILL_RANK), with a receiver that records what it posts."""
    with ExitStack() as nodes:

        def make():
            node, cache = announced_decode_node(nodes, tiny_model_path, TransferState.BOOTSTRAPPING)
            node.rooms[ROOM].handle = None
            node.incoming.prefill_ranks = {0: PREFILL_RANK, 1: PREFILL_RANK + 1}
            receiver = node.incoming.receiver = ScratchReceiver()
            receiver.expected = []

            def expect(src_rank, room, pools, metadata, row):
                receiver.expected.append((src_rank, room))
                return TransferHandle(room, src_rank)

            receiver.expect = expect
            return node, cache

        yield make


def scratch(node, cache, rank: int, room: int, num_tokens: int):
    return (rank, room, [kv_nbytes(cache.kv_pool, num_tokens), node.metadata.row_nbytes])


def test_an_announcement_from_another_prefill_rank_is_discarded_and_fails_the_request(
    announced_node,
):
    node, cache = announced_node()
    node._handle(TransferAnnounce(ROOM, PREFILL_RANK + 1, len(PROMPT)))
    discarded = [scratch(node, cache, PREFILL_RANK + 1, ROOM, len(PROMPT))]
    assert node.incoming.receiver.discarded == discarded
    (update,) = node.router.updates
    assert update.error == (
        f"room {ROOM} was announced by rank {PREFILL_RANK + 1}, but its prefill went to "
        f"prefill-0 (rank {PREFILL_RANK})"
    )
    assert cache.is_empty() and node.metadata.num_free == 2 and not node.rooms
    # Its own prefill node's announcement, later, is received into scratch too.
    node._handle(TransferAnnounce(ROOM, PREFILL_RANK, len(PROMPT)))
    assert len(node.incoming.receiver.discarded) == 2 and not node.incoming.receiver.expected


def test_an_announcement_from_no_prefill_rank_posts_nothing_and_fails_the_request(announced_node):
    node, cache = announced_node()
    node._handle(TransferAnnounce(ROOM, 42, len(PROMPT)))
    assert not node.incoming.receiver.discarded and not node.incoming.receiver.expected
    (update,) = node.router.updates
    assert update.error == f"room {ROOM} was announced by rank 42, which is no prefill node's"
    assert cache.is_empty() and not node.rooms
    node._handle(TransferAnnounce(ROOM + 1, 42, 4))  # an unknown room: nothing either
    assert not node.incoming.receiver.discarded and len(node.router.updates) == 1


@pytest.mark.parametrize("num_tokens", [0, -3, 65, 10**12])
def test_a_token_count_no_prompt_has_posts_nothing_and_breaks_that_channel(
    announced_node, num_tokens
):
    node, cache = announced_node()
    node._handle(TransferAnnounce(ROOM + 1, PREFILL_RANK, num_tokens))
    assert not node.incoming.receiver.discarded and not node.incoming.receiver.expected
    assert f"with {num_tokens} tokens, not 1..64" in node.incoming.receiver.broken[PREFILL_RANK]
    assert ROOM in node.rooms and not node.router.updates  # the room announced was unknown


def test_a_second_announcement_fails_the_request_and_frees_it_once_the_first_ends(announced_node):
    node, cache = announced_node()
    node._handle(TransferAnnounce(ROOM, PREFILL_RANK, len(PROMPT)))
    assert node.incoming.receiver.expected == [(PREFILL_RANK, ROOM)]
    node._handle(TransferAnnounce(ROOM, PREFILL_RANK, len(PROMPT)))
    discarded = [scratch(node, cache, PREFILL_RANK, ROOM, len(PROMPT))]
    assert node.incoming.receiver.discarded == discarded
    (update,) = node.router.updates
    assert update.error == f"room {ROOM} was announced twice by prefill-0"
    assert not cache.is_empty(), "the first transfer's receive is posted into the slots"
    node.rooms[ROOM].handle.advance(TransferState.SUCCESS)
    node._land_transfers()
    assert cache.is_empty() and node.metadata.num_free == 2 and not node.rooms


def test_draft_depths_the_request_does_not_receive_fail_it(announced_node):
    node, cache = announced_node()
    node._handle(TransferAnnounce(ROOM, PREFILL_RANK, len(PROMPT), num_draft_tokens=2))
    (update,) = node.router.updates
    assert update.error == "prefill-0 announced 2 draft depths, this node receives 0"
    assert "came with 2 draft depths" in node.incoming.receiver.broken[PREFILL_RANK]
    assert cache.is_empty() and not node.rooms


def test_another_reused_count_than_asked_for_fails_the_request(announced_node):
    """The decode node asked for the whole prompt (it holds none of it): an announcement that
    leaves out 2 positions is refused, and received into scratch of its announced sizes."""
    node, cache = announced_node()
    node._handle(TransferAnnounce(ROOM, PREFILL_RANK, len(PROMPT), reused_tokens=2))
    (update,) = node.router.updates
    assert update.error == "prefill-0 announced 2 reused tokens, this node holds 0"
    discarded = [scratch(node, cache, PREFILL_RANK, ROOM, len(PROMPT) - 2)]
    assert node.incoming.receiver.discarded == discarded
    assert cache.is_empty() and not node.rooms


@pytest.mark.parametrize("reused", [-1, len(PROMPT)])
def test_a_reused_count_outside_the_prompt_posts_nothing_and_breaks_that_channel(
    announced_node, reused
):
    node, _ = announced_node()
    node._handle(TransferAnnounce(ROOM, PREFILL_RANK, len(PROMPT), reused_tokens=reused))
    assert not node.incoming.receiver.discarded and not node.incoming.receiver.expected
    broken = node.incoming.receiver.broken[PREFILL_RANK]
    assert f"with {reused} of its {len(PROMPT)} tokens reused" in broken
    (update,) = node.router.updates
    assert "reused" in update.error


def rejected(exposition: str) -> dict[tuple[str, str], float]:
    """The rejected-messages counter of each (node, role) in a /metrics exposition, the front
    ends' own under ("router", "router")."""
    counts = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == REJECTED:
                counts[(sample.labels["node"], sample.labels["role"])] = sample.value
            elif sample.name == FRONTEND_REJECTED:
                counts[("router", "router")] = sample.value
    return counts


def test_rejections_show_in_metrics_for_nodes_and_the_router():
    async def stats() -> dict:
        return {"kv_used": 0, "control_rejected": 4}

    node = SimpleNamespace(name="decode-0", role="decode", alive=True, in_flight=0, stats=stats)
    metrics = ClusterMetrics([node])
    metrics.control_rejected.inc(2)
    exposition = asyncio.run(metrics.render()).decode()
    assert rejected(exposition) == {("decode-0", "decode"): 4, ("router", "router"): 2}


# --- a live cluster ---
ENGINE = dict(max_model_len=128, kv_cache_tokens=1024, max_num_seqs=8)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-control-auth")
    make_tiny_llama(path)
    return str(path)


@pytest.fixture(scope="module")
def cluster(tiny_model):
    pytest.importorskip("ray")
    cluster = launch(tiny_model, prefill=1, decode=1, **ENGINE)
    cluster.router.metrics.nodes._max_age_s = 0.0
    server = serve(cluster)
    yield cluster, server
    server.stop()
    cluster.shutdown()


def scrape_rejected(url: str) -> dict[tuple[str, str], float]:
    return rejected(httpx.get(url + "/metrics", timeout=30).text)


def test_forged_messages_to_a_live_cluster_are_dropped_and_it_serves_on(cluster, tiny_model):
    import ray

    cluster_, server = cluster
    endpoint = ray.get(cluster_.decode_actors[0].describe.remote(), timeout=30)["endpoint"]
    context = zmq.Context()
    to_decode, to_router = context.socket(zmq.PUSH), context.socket(zmq.PUSH)
    to_decode.connect(endpoint)
    to_router.connect(cluster_.router.endpoint)
    stranger = Outbox(endpoint, new_control_key(), context)
    try:
        # The announcement that, unsigned, used to leave every later request hanging: a room
        # that does not exist, from the prefill node's own rank.
        forged = TransferAnnounce(room=1234567, prefill_rank=0, num_tokens=8)
        to_decode.send(encode(forged))
        stranger.send(forged)
        captured = FrameSigner(cluster_.control_key, endpoint).sign(encode(AbortRequest(99)))
        to_decode.send(captured)  # good (an abort of no request: harmless)
        to_decode.send(captured)  # replayed
        to_router.send(encode(TokenFrame(rooms=[1], num_tokens=[1], token_ids=[5], texts=["x"])))
        counted = {("prefill-0", "prefill"): 0, ("decode-0", "decode"): 3, ("router", "router"): 1}
        assert wait_for(lambda: scrape_rejected(server.url) == counted, 30)
    finally:
        for socket in (to_decode, to_router):
            socket.close(linger=0)
        stranger.close()
        context.term()

    prompt = "the quick brown fox"
    [expected] = LLM(tiny_model, device="cpu", **ENGINE).generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    with Client(server.url) as client:
        out = client.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True)
    assert out.token_ids == expected.token_ids
    assert wait_for(cluster_.kv_pools_empty, 30)
    assert scrape_rejected(server.url) == counted
    (stats,) = [s for s in cluster_.node_stats() if s["node"] == "decode-0"]
    assert stats["control_rejected"] == 3
