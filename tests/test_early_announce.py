"""The prefill node announces each transfer when the request's prefill batch is admitted, before
the forward, so that the decode node's receives are posted by the time the KV is ready. What the
announcement cannot carry (the first token's top logprobs, the prefill timeline, or the error)
follows in a PrefillResult, sent before the KV. A prefill that fails after the announcement still
sends the announced transfer (posted receives cannot be cancelled) under a void row, and the
decode node fails just that request with the prefill's error. Nodes are built over the tiny
model with no process group (tests/node_builders.py): their outboxes and KV channel are a
recorder, which logs the order of messages, forwards and sends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from node_builders import built, new_decode_node, new_prefill_node
from stream_recorder import FRONTEND, StreamRecorder
from tiny_drafts import make_random_draft

import decode_node.tracked as tracked_module
from decode_node.node import DecodeNode
from decode_node.tracked import Tracked
from engine.request import Request
from engine.sampling.sampling_params import SamplingParams
from engine.scheduling.kv_cache import KVCacheManager
from metadata.buffers import MetadataBuffers
from metadata.messages import (
    MessageError,
    PrefillResult,
    TransferAnnounce,
    decode,
    encode,
)
from metadata.transfer import TransferHandle, TransferState
from metadata.wire import kv_nbytes
from prefill_node.node import PrefillNode
from prefill_node.pending import Pending, drafts_after_first_token

CAPACITY = 64
HIDDEN = 8
SPEC = "multi-layer-eagle"


class Recorder:
    """Stands for a node's outboxes and its KVSender: logs what each is asked to do, in order,
    with what a send would read (its pools' slot counts, the row's room tag) at that moment."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.handles: list[TransferHandle] = []
        self.begun: list[int] = []  # rooms whose send finished a begun transfer

    def send(self, msg) -> None:  # an outbox
        self.events.append(("message", msg))

    def begin_kv(self, dst_rank, room, messages):  # KVSender.begin
        counts = [piece.num_tokens for piece in messages.pieces]
        self.events.append(("kv-begin", room, counts))
        return TransferHandle(room, dst_rank)

    def send_kv(self, dst_rank, room, pools_and_slots, metadata, row, begun=None):  # .send
        counts = [len(slots) for _, slots in pools_and_slots]
        self.events.append(("kv", room, counts, int(metadata.room[row])))
        if begun is not None:
            self.begun.append(room)
        handle = begun or TransferHandle(room, dst_rank)
        self.handles.append(handle)
        return handle

    def messages(self, kind: type) -> list:
        return [e[1] for e in self.events if e[0] == "message" and isinstance(e[1], kind)]

    def kinds(self) -> list[str]:
        return [type(e[1]).__name__ if e[0] == "message" else e[0] for e in self.events]


def _failing_draft_extend(requests, hidden, input_embeds=None, prompt_sources=None) -> None:
    raise RuntimeError("injected draft extend failure")


@pytest.fixture(scope="module")
def draft(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_draft(tmp_path_factory.mktemp("announce") / "draft", tiny_model_path, 2)


def recorded_prefill_node(
    nodes: ExitStack,
    model: Path,
    recorder: Recorder,
    fail: bool = False,
    draft: Path | None = None,
    **engine: object,
) -> PrefillNode:
    """A prefill node over `model` (pool of CAPACITY slots, four metadata rows), closed with
    `nodes`, whose outboxes and KV sender are `recorder`, which logs every forward; `fail`:
    the forward fails; `draft`: it speculates with that draft, whose draft extend fails.
    `engine`: more EngineArgs (a chunk size, the prefix cache)."""
    spec = dict(speculative_algorithm=SPEC, draft_model=str(draft)) if draft else {}
    engine = dict(max_num_seqs=8, max_prefill_tokens=512, **spec, **engine)
    node = nodes.enter_context(built(new_prefill_node(model, CAPACITY, 4, **engine)))
    node.rank = 0
    node.outgoing.outboxes = {0: recorder}
    node.outgoing.sender = SimpleNamespace(send=recorder.send_kv, begin=recorder.begin_kv)
    forward = node.runner.forward

    def logged_forward(batch, keep_hidden: bool = False):
        recorder.events.append(("forward",))
        if fail:
            raise RuntimeError("injected forward failure")
        return forward(batch, keep_hidden=keep_hidden)

    node.runner.forward = logged_forward
    if draft:
        node.speculator.draft_extend_prefill = _failing_draft_extend
    return node


@pytest.fixture
def make_prefill(tiny_model_path: Path, draft: Path) -> Iterator[Callable[..., PrefillNode]]:
    """`recorded_prefill_node`s over the tiny model; `failing_drafts`: with two draft depths
    whose draft extend fails."""
    with ExitStack() as nodes:

        def make(recorder: Recorder, fail: bool = False, failing_drafts: bool = False):
            used = draft if failing_drafts else None
            return recorded_prefill_node(nodes, tiny_model_path, recorder, fail, used)

        yield make


def run_batch(
    node: PrefillNode,
    prompts: dict[int, tuple[list[int], int]],
    ranks: dict[int, int] | None = None,
) -> None:
    """Queue requests {room: (prompt, max_tokens)} (for decode ranks {room: rank}, else all for
    rank 1), admit them as one batch and prefill it."""
    for room, (prompt, max_tokens) in prompts.items():
        req = Request(str(room), prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
        if node.speculator is not None:
            req.num_draft_tokens = node.num_draft_steps
        rank = (ranks or {}).get(room, 1)
        node.waiting.append([Pending(req, decode_node=0, decode_rank=rank)])
    node._feed()
    assert len(node.prefilling) == len(prompts)
    node.engine.step()


def finish_sends(node: PrefillNode, recorder: Recorder) -> None:
    for handle in recorder.handles:
        handle.advance(TransferState.SUCCESS)
    node._finish_transfers()


PROMPTS = {11: ([3, 4, 5], 4), 12: ([6, 7], 4), 13: ([8, 9, 10, 11], 4)}
# Every transfer announced before the forward, then each one's result and KV in that order.
ANNOUNCED_THEN_SENT = ["TransferAnnounce"] * 3 + ["forward"] + ["PrefillResult", "kv"] * 3


def test_every_transfer_is_announced_before_the_forward_and_sent_in_that_order(
    make_prefill,
) -> None:
    recorder = Recorder()
    node = make_prefill(recorder)
    run_batch(node, PROMPTS)
    assert recorder.kinds() == ANNOUNCED_THEN_SENT
    announced = [(a.room, a.num_tokens) for a in recorder.messages(TransferAnnounce)]
    assert announced == [(room, len(prompt)) for room, (prompt, _) in PROMPTS.items()]
    sends = [e for e in recorder.events if e[0] == "kv"]
    # Announcement order, the announced length, and the row tagged with its own room.
    assert [(room, counts, tag) for _, room, counts, tag in sends] == [
        (room, [len(prompt)], room) for room, (prompt, _) in PROMPTS.items()
    ]
    assert all(r.error is None for r in recorder.messages(PrefillResult))
    finish_sends(node, recorder)
    assert node.kv_cache.is_empty() and node.metadata.num_free == 4


def test_a_forward_that_fails_after_the_announcement_still_sends_each_transfer_void(
    make_prefill,
) -> None:
    recorder = Recorder()
    node = make_prefill(recorder, fail=True)
    run_batch(node, PROMPTS)
    assert recorder.kinds() == ANNOUNCED_THEN_SENT
    for result in recorder.messages(PrefillResult):
        assert result.error.startswith("prefill-0: prefill forward failed: RuntimeError")
        assert "injected forward failure" in result.error
    sends = [e for e in recorder.events if e[0] == "kv"]
    # What was announced, under a row whose room tag matches no room.
    assert [(room, counts, tag) for _, room, counts, tag in sends] == [
        (room, [len(prompt)], 0) for room, (prompt, _) in PROMPTS.items()
    ]
    assert node.prompts_done == 0
    finish_sends(node, recorder)
    assert node.kv_cache.is_empty() and node.metadata.num_free == 4 and not node.outgoing.sending


def test_a_request_whose_transfer_cannot_be_prepared_is_void_in_its_place(make_prefill) -> None:
    recorder = Recorder()
    node = make_prefill(recorder)
    write_row = node.metadata.write_row

    def failing_write_row(row, *, room, **fields):
        if room == 12:
            raise ValueError("injected row failure")
        write_row(row, room=room, **fields)

    node.metadata.write_row = failing_write_row
    run_batch(node, PROMPTS)
    sends = [(room, tag) for _, room, _, tag in (e for e in recorder.events if e[0] == "kv")]
    assert sends == [(11, 11), (12, 0), (13, 13)]
    errors = {r.room: r.error for r in recorder.messages(PrefillResult)}
    assert errors[11] is None and errors[13] is None
    assert errors[12].startswith("prefill-0: preparing the transfer failed: ValueError")
    finish_sends(node, recorder)
    assert node.kv_cache.is_empty() and node.metadata.num_free == 4


def test_the_pools_of_a_void_transfer_are_the_announced_ones(make_prefill) -> None:
    """Whether a request drafts is decided at the announcement (max_tokens 2 leaves one token
    after the first: no draft); a failed draft extend still sends one pool per depth, and fails
    only the requests that draft."""
    recorder = Recorder()
    node = make_prefill(recorder, failing_drafts=True)
    run_batch(node, {21: ([3, 4, 5], 8), 22: ([6, 7], 2)})
    announced = {a.room: a.num_draft_tokens for a in recorder.messages(TransferAnnounce)}
    assert announced == {21: 2, 22: 0}
    sends = [
        (room, counts, tag) for _, room, counts, tag in (e for e in recorder.events if e[0] == "kv")
    ]
    assert sends == [(21, [3, 3, 3], 0), (22, [2], 22)]
    errors = {r.room: r.error for r in recorder.messages(PrefillResult)}
    assert "draft extend failure" in errors[21] and errors[22] is None
    finish_sends(node, recorder)
    assert node.kv_cache.is_empty() and node.metadata.num_free == 4


def test_a_request_alone_for_its_decode_node_posts_its_kv_right_after_the_forward(
    make_prefill,
) -> None:
    """Room 11 is the batch's only request for rank 1: its target KV goes as soon as the forward
    is enqueued, the rest after the first token. Rooms 12 and 13 share rank 2, whose order
    allows no second transfer between the two parts of one: they go whole, after."""
    recorder = Recorder()
    node = make_prefill(recorder)
    run_batch(node, PROMPTS, ranks={11: 1, 12: 2, 13: 2})
    assert recorder.kinds() == ANNOUNCED_THEN_SENT[:4] + ["kv-begin"] + ANNOUNCED_THEN_SENT[4:]
    assert recorder.events[4] == ("kv-begin", 11, [3])
    assert recorder.begun == [11]
    finish_sends(node, recorder)
    assert node.kv_cache.is_empty() and node.metadata.num_free == 4


def test_a_begun_transfer_that_fails_later_is_finished_void(make_prefill) -> None:
    recorder = Recorder()
    node = make_prefill(recorder, failing_drafts=True)
    run_batch(node, {21: ([3, 4, 5], 8)})
    assert ("kv-begin", 21, [3]) in recorder.events
    sends = [e[1:] for e in recorder.events if e[0] == "kv"]
    assert sends == [(21, [3, 3, 3], 0)] and recorder.begun == [21]
    assert "draft extend failure" in recorder.messages(PrefillResult)[0].error
    finish_sends(node, recorder)
    assert node.kv_cache.is_empty() and node.metadata.num_free == 4


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("num_draft_tokens", [0, 1, 3])
def test_the_announcement_decides_drafting_as_the_first_token_will(max_tokens, num_draft_tokens):
    req = Request("1", [3, 4], SamplingParams(max_tokens=max_tokens))
    req.num_draft_tokens = num_draft_tokens
    before = drafts_after_first_token(req)
    req.output_token_ids.append(5)
    assert before == (req.lookahead > 0)


def test_the_prefill_result_crosses_the_wire_typed() -> None:
    done = PrefillResult(7, [[3, -0.5], [4, -1.25]], [["prefill_start", 12]])
    failed = PrefillResult(8, error="prefill-1: prefill failed: RuntimeError: x")
    assert decode(encode(done)) == done and decode(encode(failed)) == failed
    with pytest.raises(MessageError, match="PrefillResult.error"):
        decode(encode(PrefillResult(9, error=5)))


def test_a_void_row_lands_as_no_rooms() -> None:
    metadata = MetadataBuffers(2, HIDDEN, 0, 1, torch.float32, "cpu")
    row = metadata.allocate()
    metadata.write_row(row, room=5, output_id=1, output_logprob=0.0, hidden_state=torch.ones(8))
    metadata.void(row)
    assert not metadata.row_landed(row, 5) and int(metadata.room[row]) == 0


# --- the decode node ---

ROOM = 4242
PROMPT = list(range(3, 13))
PREFILL_RANK = 3  # prefill-0's, which every request here goes to


def announced_decode_node(
    nodes: ExitStack, model: Path, state: TransferState, error: str | None = None
) -> tuple[DecodeNode, KVCacheManager]:
    """A decode node over `model` (pool of CAPACITY slots, two metadata rows), closed with
    `nodes`, streaming to a recorder (`node.router`), receiving request ROOM from prefill-0,
    its transfer in `state` (failed with `error`)."""
    node = nodes.enter_context(built(new_decode_node(model, CAPACITY, 2, max_num_seqs=8)))
    cache = node.kv_cache
    node.router = StreamRecorder()
    node.streams = node.router.streams("decode-0")
    node.incoming.prefill_ranks = {0: PREFILL_RANK}
    req = Request(str(ROOM), PROMPT, SamplingParams(max_tokens=4))
    cache.grow(req, len(PROMPT) + 4)
    message = SimpleNamespace(room=ROOM, prefill_node=0)
    stream = node.streams.open(FRONTEND, ROOM)
    tracked = Tracked(req, message, stream, meta_row=node.metadata.allocate())
    tracked.handle = TransferHandle(ROOM, peer=0)
    if state == TransferState.FAILED:
        tracked.handle.fail(error)
    else:
        tracked.handle.advance(state)
    node.rooms = {ROOM: tracked}
    node.incoming.requests = [tracked]
    return node, cache


@pytest.fixture
def make_decode(
    tiny_model_path: Path,
) -> Iterator[Callable[..., tuple[DecodeNode, KVCacheManager]]]:
    """`announced_decode_node`s over the tiny model."""
    with ExitStack() as nodes:

        def make(state: TransferState, error: str | None = None):
            return announced_decode_node(nodes, tiny_model_path, state, error)

        yield make


PREFILL_ERROR = "prefill-0: prefill forward failed: RuntimeError: injected forward failure"
MISMATCH = f"room tag mismatch: expected {ROOM} got 0 (from rank 0)"


def test_a_prefill_error_fails_the_request_at_once_and_frees_its_slots_once_the_kv_came(
    make_decode,
):
    node, cache = make_decode(TransferState.TRANSFERRING)
    node._handle(PrefillResult(ROOM, error=PREFILL_ERROR))
    assert [(u.room, u.error) for u in node.router.updates] == [(ROOM, PREFILL_ERROR)]
    node._land_transfers()
    assert not cache.is_empty(), "the void transfer may still write into the slots"
    node.rooms[ROOM].handle.fail(MISMATCH)
    node._land_transfers()
    assert cache.is_empty() and node.metadata.num_free == 2 and not node.rooms
    assert len(node.router.updates) == 1  # one terminal answer


def test_a_void_transfer_that_ends_before_its_result_reports_the_prefill_error(make_decode):
    node, cache = make_decode(TransferState.FAILED, error=MISMATCH)
    node._land_transfers()
    assert node.incoming.requests and not node.router.updates  # waits for the result
    node._handle(PrefillResult(ROOM, error=PREFILL_ERROR))
    node._land_transfers()
    assert [u.error for u in node.router.updates] == [PREFILL_ERROR]
    assert cache.is_empty() and node.metadata.num_free == 2 and not node.rooms


def test_a_transfer_whose_result_never_comes_fails_naming_the_prefill_node(
    make_decode, monkeypatch
):
    node, cache = make_decode(TransferState.SUCCESS)
    node._land_transfers()
    assert node.incoming.requests and not node.router.updates
    monkeypatch.setattr(tracked_module, "RESULT_WAIT_S", 0.0)
    node._land_transfers()
    (update,) = node.router.updates
    assert "prefill-0 sent no result" in update.error
    assert cache.is_empty() and node.metadata.num_free == 2 and not node.rooms


class ScratchReceiver:
    def __init__(self) -> None:
        self.discarded: list[tuple[int, int, list[int]]] = []
        self.broken: dict[int, str] = {}

    def discard(self, src_rank, room, message_nbytes):
        self.discarded.append((src_rank, room, message_nbytes))
        return TransferHandle(room, src_rank)

    def break_channel(self, peer, reason):
        self.broken[peer] = reason


@pytest.mark.parametrize("room, num_tokens", [(ROOM, len(PROMPT) + 1), (ROOM + 1, 4)])
def test_a_refused_announcement_is_still_received_into_scratch(make_decode, room, num_tokens):
    """A token count that does not match, or a room the node no longer knows: the prefill
    node sends the transfer anyway, and only receives of the announced sizes keep the pair's
    NCCL order."""
    node, cache = make_decode(TransferState.BOOTSTRAPPING)
    node.rooms[ROOM].handle = None
    node.incoming.receiver = ScratchReceiver()
    node._handle(TransferAnnounce(room, 3, num_tokens, 0))
    sizes = [kv_nbytes(cache.kv_pool, num_tokens), node.metadata.row_nbytes]
    assert node.incoming.receiver.discarded == [(3, room, sizes)]
    if room == ROOM:
        (update,) = node.router.updates
        assert update.error == f"prefill announced {num_tokens} tokens, expected {len(PROMPT)}"
        assert cache.is_empty() and not node.rooms
    else:
        assert not node.router.updates and ROOM in node.rooms


def test_draft_depths_the_node_cannot_receive_break_the_channel_from_that_rank(make_decode):
    """With no draft depths of its own the node cannot size the depth messages: later
    transfers from that rank then fail at once instead of taking this one's data."""
    node, cache = make_decode(TransferState.BOOTSTRAPPING)
    node.incoming.receiver = ScratchReceiver()
    node._handle(TransferAnnounce(ROOM + 1, 3, 4, 2))
    assert not node.incoming.receiver.discarded
    assert "came with 2 draft depths" in node.incoming.receiver.broken[3]
