"""What the nodes do with a request's KV slots and metadata row once its transfer ends: free
them, unless the transfer timed out with its operations still posted. Receives land straight
in the decode node's slots and sends read the prefill node's slots and row in place, so those
are held (with a warning naming the room) until the peer is gone, then freed; the decode node's
row is received through a staging tensor and is freed at once. Nodes are built over the tiny
model with no process group (tests/node_builders.py), each with one transfer that ended."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest
from node_builders import built, new_decode_node, new_prefill_node
from stream_recorder import FRONTEND, StreamRecorder

from decode_node.tracked import Tracked
from engine.request import Request
from engine.sampling.sampling_params import SamplingParams
from metadata.messages import PrefillResult
from metadata.serving_node import ServingNode
from metadata.transfer import TransferHandle, TransferState
from prefill_node.pending import Pending

CAPACITY = 64
ROOM = 4242
PROMPT = list(range(3, 13))


def handle(state: TransferState, left_posted: bool) -> TransferHandle:
    done = TransferHandle(ROOM, peer=1)
    done.left_posted = left_posted
    if state == TransferState.FAILED:
        done.fail("rank 1 did not complete the transfer within 5 s")
    else:
        done.advance(state)
    return done


@pytest.fixture
def nodes() -> Iterator[Callable[[ServingNode], ServingNode]]:
    """Closes the nodes it is given after the test."""
    with ExitStack() as stack:
        yield lambda node: stack.enter_context(built(node))


def decode_node(nodes, model: Path, left_posted: bool, state: TransferState):
    """A decode node (pool of 64 slots, four request rows, two metadata rows) receiving ROOM,
    whose transfer ended in `state`."""
    node = nodes(new_decode_node(model, CAPACITY, 2, max_num_seqs=4))
    cache = node.kv_cache
    node.streams = StreamRecorder().streams("decode-0")
    req = Request(str(ROOM), PROMPT, SamplingParams(max_tokens=4))
    cache.grow(req, len(PROMPT) + 4)
    message = SimpleNamespace(room=ROOM, prefill_node=0)
    stream = node.streams.open(FRONTEND, ROOM)
    tracked = Tracked(req, message, stream, meta_row=node.metadata.allocate())
    tracked.handle = handle(state, left_posted)
    tracked.result = PrefillResult(ROOM)  # the prefill's result came with the KV
    tracked.aborted = state == TransferState.SUCCESS  # the client left: freed either way
    node.rooms = {ROOM: tracked}
    node.incoming.requests = [tracked]
    return node, cache


@pytest.mark.parametrize("state", [TransferState.FAILED, TransferState.SUCCESS])
def test_decode_node_frees_the_slots_of_a_transfer_that_ended(
    nodes, tiny_model_path, state: TransferState
) -> None:
    node, cache = decode_node(nodes, tiny_model_path, left_posted=False, state=state)
    node._land_transfers()
    assert cache.is_empty() and node.metadata.num_free == 2 and not node.rooms


def test_decode_node_holds_the_slots_a_posted_receive_may_still_write(
    nodes, tiny_model_path, caplog
) -> None:
    node, cache = decode_node(nodes, tiny_model_path, left_posted=True, state=TransferState.FAILED)
    slots = list(node.rooms[ROOM].req.slots)
    with caplog.at_level(logging.WARNING, logger="decode_node.node"):
        node._land_transfers()
    allocator = cache.kv_pool.allocator
    assert allocator.num_used == len(slots) and not allocator.can_allocate(64 - len(slots) + 1)
    allocator.check_integrity()
    # The request is gone, its req_to_token row and its staged metadata row are free again.
    assert not node.rooms and not node.incoming.requests
    assert cache.req_to_token_pool.num_free_rows == 3 and node.metadata.num_free == 2
    assert f"room {ROOM}: {len(slots)} KV slots held until rank 1 is replaced" in caplog.text
    assert "hold 14 KV slots" in node.quarantine.degraded()
    # Its prefill node (rank 1 here) is gone: nothing can write into them any more.
    node._drop_peer(0, 1, "prefill-0 died")
    assert cache.is_empty() and node.quarantine.degraded() is None


def prefill_node(nodes, model: Path, left_posted: bool):
    """A prefill node (pool of 64 slots, four request rows, two metadata rows) sending ROOM,
    whose transfer failed."""
    node = nodes(new_prefill_node(model, CAPACITY, 2, max_num_seqs=4))
    req = Request(str(ROOM), PROMPT, SamplingParams(max_tokens=4))
    node.kv_cache.grow(req, len(PROMPT))
    pending = Pending(req, decode_node=0, decode_rank=1, meta_row=node.metadata.allocate())
    pending.handle = handle(TransferState.FAILED, left_posted)
    node.outgoing.sending = [pending]
    return node


def test_prefill_node_frees_after_a_failure_that_left_nothing_posted(
    nodes, tiny_model_path
) -> None:
    node = prefill_node(nodes, tiny_model_path, left_posted=False)
    node._finish_transfers()
    assert node.kv_cache.is_empty() and node.metadata.num_free == 2 and not node.outgoing.sending


def test_prefill_node_holds_the_slots_and_row_a_posted_send_may_still_read(
    nodes, tiny_model_path, caplog
) -> None:
    node = prefill_node(nodes, tiny_model_path, left_posted=True)
    with caplog.at_level(logging.WARNING, logger="prefill_node.node"):
        node._finish_transfers()
    assert node.kv_cache.kv_pool.allocator.num_used == len(PROMPT)
    assert node.metadata.num_free == 1  # the row the send reads in place
    assert node.kv_cache.req_to_token_pool.num_free_rows == 3 and not node.outgoing.sending
    assert f"room {ROOM}: {len(PROMPT)} KV slots held until rank 1 is replaced" in caplog.text
    node._drop_peer(0, 1, "decode-0 died")
    assert node.kv_cache.is_empty() and node.metadata.num_free == 2
