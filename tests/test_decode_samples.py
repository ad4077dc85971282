"""Parallel samples of one prompt on a decode node (decode_node.samples), built over the tiny
model with no process group (tests/node_builders.py): they preallocate together, sharing the
first sample's prompt slots; one PrefillRequest names them all; the first sample's transfer
carries the prompt's target KV and each other's only its row; a sample runs once its transfer
and the prompt's have landed. Each stays a request of its own: a failed prompt fails the
samples waiting for it with its reason, aborting the sample that brings the prompt waits for
the others, and every slot and row comes back."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from node_builders import built, new_decode_node
from stream_recorder import FRONTEND, StreamRecorder

from decode_node.node import DecodeNode
from engine import LLM, SamplingParams
from metadata.messages import (
    AbortRequest,
    GenerateRequest,
    ParallelSample,
    PrefillRequest,
    PrefillResult,
    SamplingSpec,
    TransferAnnounce,
)
from metadata.pair_group import PairLink
from metadata.process_group import create_store_server
from metadata.rank_kv import RankKV, outgoing_pools
from metadata.transfer import TransferHandle, TransferState

CAPACITY = 64
PROMPT = list(range(3, 13))
ROOMS = [101, 102, 103]
PREFILL_RANK = 3
PREFILL_ERROR = "prefill-0: prefill forward failed: RuntimeError: injected"


class Recorder(StreamRecorder):
    """The front end, the prefill node's outbox and the KV receiver, in one log."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[object] = []
        self.receives: dict[int, tuple[list[int], TransferHandle]] = {}
        self.pools: dict[int, list] = {}  # where each room's node channel lands

    def send(self, msg) -> None:
        super().send(msg)
        self.messages.append(msg)

    def expect(self, src_rank, room, pools, metadata, row) -> TransferHandle:
        handle = TransferHandle(room, src_rank)
        handle.advance(TransferState.TRANSFERRING)
        self.receives[room] = ([len(slots) for _, slots in pools], handle)
        self.pools[room] = pools
        return handle

    def discard(self, src_rank, room, message_nbytes) -> None:
        self.messages.append(("discarded", room, len(message_nbytes)))

    def of(self, kind: type) -> list:
        return [m for m in self.messages if isinstance(m, kind)]

    def attach(self, decode: DecodeNode) -> Recorder:
        """Stand in for `decode`'s front end, its prefill node's outbox and its KV receiver,
        paired with prefill-0 at data-plane rank PREFILL_RANK (decode-0 being rank 1)."""
        decode.rank = 1
        decode.streams = self.streams("decode-0")
        decode.incoming.receiver = self
        decode.prefill_peers.outboxes = {0: self}
        decode.incoming.prefill_ranks = {0: PREFILL_RANK}
        return self


@pytest.fixture
def node(tiny_model_path: Path) -> Iterator[tuple[DecodeNode, Recorder]]:
    """A decode node over the tiny model with a pool of CAPACITY slots and four metadata rows,
    paired with prefill-0 (data-plane rank PREFILL_RANK) through the recorder."""
    engine = dict(max_num_seqs=8, max_prefill_tokens=256)
    with built(new_decode_node(tiny_model_path, CAPACITY, 4, **engine)) as decode:
        recorder = Recorder().attach(decode)
        yield decode, recorder


def generate() -> GenerateRequest:
    sampling = SamplingSpec(8, 0.8, 0, 1.0, 11, [], [], True, None)
    samples = [ParallelSample(room, f"r{room}", 11 + room) for room in ROOMS[1:]]
    return GenerateRequest(ROOMS[0], "r", PROMPT, sampling, 0, FRONTEND, samples=samples)


def announce(decode: DecodeNode, room: int, prompt_room: int = 0) -> None:
    decode._handle(TransferAnnounce(room, PREFILL_RANK, len(PROMPT), 0, prompt_room))


def land(decode: DecodeNode, recorder: Recorder, room: int, token: int) -> None:
    """The transfer of `room` lands (its row written as the prefill node's would be)."""
    tracked = decode.rooms[room]
    decode.metadata.output_ids[tracked.meta_row] = token
    decode._handle(PrefillResult(room))
    recorder.receives[room][1].advance(TransferState.SUCCESS)


def empty(decode: DecodeNode) -> bool:
    return decode.kv_cache.is_empty() and decode.metadata.num_free == decode.metadata.num_rows


def test_samples_preallocate_together_and_share_the_prompts_slots(node):
    decode, recorder = node
    decode._handle(generate())
    decode._preallocate()
    (request,) = recorder.of(PrefillRequest)
    assert request.room == ROOMS[0]
    assert [(s.room, s.seed) for s in request.samples] == [(102, 113), (103, 114)]
    # One copy of the prompt, each sample's first token of its own.
    assert decode.kv_cache.kv_pool.allocator.num_used == len(PROMPT) + 3
    assert decode.metadata.num_free == 1
    announce(decode, ROOMS[0])
    announce(decode, ROOMS[1], prompt_room=ROOMS[0])
    # The prompt's target KV lands in the first sample's slots; the others receive rows only.
    assert recorder.receives[ROOMS[0]][0] == [len(PROMPT)]
    assert recorder.receives[ROOMS[1]][0] == []
    # A sample announced as bringing its own prompt KV is refused: received into scratch
    # (the target's KV and the row), and failed.
    announce(decode, ROOMS[2])
    assert ROOMS[2] not in recorder.receives
    assert ("discarded", ROOMS[2], 2) in recorder.messages
    (refused,) = recorder.updates
    assert refused.room == ROOMS[2] and "prompt KV" in refused.error


def test_samples_whose_first_step_can_never_fit_are_refused_not_queued(node):
    """62 prompt tokens and three first tokens exceed a pool of 64 even when it is empty,
    though each sample alone (62 + 2 tokens) fits it: waiting for room would hold up every
    request behind them. Each sample ends with the reason; a request queued after them
    preallocates."""
    decode, recorder = node
    request = generate()
    long = dataclasses.replace(
        request,
        prompt_token_ids=list(range(3, 65)),
        sampling=dataclasses.replace(request.sampling, max_tokens=2),
    )
    decode._handle(long)
    errors = {update.room: update.error for update in recorder.updates}
    assert sorted(errors) == ROOMS
    assert all("more than this node's pool of 64" in error for error in errors.values())
    assert not decode.prealloc and not decode.rooms
    decode._handle(dataclasses.replace(generate(), room=200, samples=[]))
    decode._preallocate()
    assert [request.room for request in recorder.of(PrefillRequest)] == [200]
    assert decode.kv_cache.kv_pool.allocator.num_used == len(PROMPT) + 1


def test_a_sample_runs_once_the_prompt_landed_and_every_slot_comes_back(node):
    decode, recorder = node
    decode._handle(generate())
    decode._preallocate()
    announce(decode, ROOMS[0])
    for room in ROOMS[1:]:
        announce(decode, room, prompt_room=ROOMS[0])
    land(decode, recorder, ROOMS[1], 51)
    decode._land_transfers()
    assert not decode.engine.scheduler.running  # its prompt is still on its way
    land(decode, recorder, ROOMS[0], 50)
    land(decode, recorder, ROOMS[2], 52)
    decode._land_transfers()
    running = decode.engine.scheduler.running
    assert sorted(r.output_token_ids[0] for r in running) == [50, 51, 52]
    assert [u.token_ids for u in recorder.updates] == [[50], [51], [52]]
    for req in list(running):
        decode._abort(int(req.request_id))
    assert empty(decode)


def test_a_failed_prompt_fails_the_samples_waiting_for_it_with_its_reason(node):
    decode, recorder = node
    decode._handle(generate())
    decode._preallocate()
    announce(decode, ROOMS[0])
    for room in ROOMS[1:]:
        announce(decode, room, prompt_room=ROOMS[0])
    land(decode, recorder, ROOMS[1], 51)
    decode._handle(PrefillResult(ROOMS[0], error=PREFILL_ERROR))
    recorder.receives[ROOMS[0]][1].fail("room tag mismatch")  # the void transfer ended
    land(decode, recorder, ROOMS[2], 52)
    decode._land_transfers()
    errors = {u.room: u.error for u in recorder.updates}
    assert errors[ROOMS[0]] == PREFILL_ERROR
    for room in ROOMS[1:]:
        assert errors[room] == f"the prompt's KV did not land: {PREFILL_ERROR}"
    assert not decode.engine.scheduler.running and not decode.rooms and empty(decode)


def test_the_prompts_carrier_is_aborted_on_the_prefill_node_only_after_the_others(node):
    decode, recorder = node
    decode._handle(generate())
    decode._preallocate()
    decode._abort(ROOMS[0])
    assert not recorder.of(AbortRequest)  # the others still wait for its transfer
    decode._abort(ROOMS[1])
    decode._abort(ROOMS[2])
    assert [a.room for a in recorder.of(AbortRequest)] == [ROOMS[1], ROOMS[2], ROOMS[0]]


def test_an_aborted_carrier_still_brings_the_prompt_for_the_others(node):
    decode, recorder = node
    decode._handle(generate())
    decode._preallocate()
    announce(decode, ROOMS[0])
    for room in ROOMS[1:]:
        announce(decode, room, prompt_room=ROOMS[0])
    decode._abort(ROOMS[0])
    land(decode, recorder, ROOMS[0], 50)
    land(decode, recorder, ROOMS[1], 51)
    land(decode, recorder, ROOMS[2], 52)
    decode._land_transfers()
    running = decode.engine.scheduler.running
    assert sorted(int(r.request_id) for r in running) == ROOMS[1:]
    for req in list(running):
        decode._abort(int(req.request_id))
    assert empty(decode)


def test_a_sample_aborted_before_preallocation_leaves_the_others_to_it(node):
    decode, recorder = node
    decode._handle(generate())
    decode._abort(ROOMS[0])
    decode._preallocate()
    (request,) = recorder.of(PrefillRequest)
    assert request.room == ROOMS[1] and [s.room for s in request.samples] == [ROOMS[2]]
    assert decode.kv_cache.kv_pool.allocator.num_used == len(PROMPT) + 2


@pytest.fixture(scope="module")
def prefill_tp2(tiny_model_path: Path) -> Iterator[LLM]:
    """A prefill end of two ranks: each holds one of the tiny model's two KV heads."""
    with LLM(
        str(tiny_model_path),
        device="cpu",
        dtype="float32",
        tensor_parallel_size=2,
        kv_cache_tokens=256,
        enable_prefix_cache=False,
    ) as llm:
        yield llm


def _prefill_and_send(prefill: LLM, sender: RankKV, recorder: Recorder) -> None:
    """Prefill PROMPT on `prefill`'s ranks and send its KV to the decode node (data-plane
    rank 1) as a prefill node does for the carrier's room: the ranks' heads through their links,
    the node channel's part copied here into where the decode node posted it."""
    engine = prefill.engine
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    req = engine.make_request("p", PROMPT, greedy, False, None)
    engine.add_request(req)
    engine.step()  # the prompt's forward
    slots = list(req.slots[: len(PROMPT)])
    outgoing, target = outgoing_pools(sender, 1, [(engine.runner.kv_pool, slots)])
    sender.send(1, ROOMS[0], target, len(slots))
    (out_pool, out_slots), (in_pool, in_slots) = outgoing[0], recorder.pools[ROOMS[0]][0]
    in_pool.kv_buffer[torch.tensor(in_slots)] = out_pool.kv_buffer[torch.tensor(out_slots)]
    engine.abort("p")


@pytest.mark.parametrize("decode_tp", [1, 2])
def test_an_aborted_carrier_brings_the_prompt_through_every_rank(
    tiny_model_path, tiny_llm, prefill_tp2, decode_tp
):
    """P(TP 2) -> D(TP 1): decode rank 0 takes head 0 through the node channel (staged) and head
    1 from prefill rank 1 through its link; D(TP 2): decode rank 1 takes head 1 through its
    own. The carrier, aborted before its transfer landed, still writes the prompt's KV there:
    the other samples' greedy output is the offline engine's from their first tokens on."""
    first = {ROOMS[1]: 51, ROOMS[2]: 52}
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    expected = {
        room: [token] + tiny_llm.generate([PROMPT + [token]], params)[0].token_ids
        for room, token in first.items()
    }
    engine = dict(max_num_seqs=8, max_prefill_tokens=256, tensor_parallel_size=decode_tp)
    store, port = create_store_server("127.0.0.1")
    with built(new_decode_node(tiny_model_path, CAPACITY, 4, **engine)) as decode:
        recorder = Recorder().attach(decode)
        sender = RankKV(prefill_tp2.engine.runner, True, 2, 2, 30.0, "prefill-0")
        sides = [
            (sender, PairLink("127.0.0.1", port, 1, 0, decode_tp), PREFILL_RANK),
            (decode.rank_kv, PairLink("127.0.0.1", port, PREFILL_RANK, 0, 2), 1),
        ]
        with ThreadPoolExecutor(2) as pool:  # each side's links wait for the other's
            list(pool.map(lambda side: side[0].pair([side[1]], side[2]), sides))
        try:
            greedy = dataclasses.replace(generate().sampling, temperature=0.0)
            decode._handle(dataclasses.replace(generate(), sampling=greedy))
            decode._preallocate()
            announce(decode, ROOMS[0])
            for room in ROOMS[1:]:
                announce(decode, room, prompt_room=ROOMS[0])
            _prefill_and_send(prefill_tp2, sender, recorder)
            decode._abort(ROOMS[0])
            land(decode, recorder, ROOMS[0], 50)
            for room, token in first.items():
                land(decode, recorder, room, token)
            decode._land_transfers()
            assert sorted(int(r.request_id) for r in decode.engine.scheduler.running) == ROOMS[1:]
            while decode.engine.scheduler.running:
                decode._step()
            served: dict[int, list[int]] = {}
            for update in recorder.updates:
                assert update.error is None, update.error
                served.setdefault(update.room, []).extend(update.token_ids)
            assert served == expected
            assert empty(decode)
        finally:
            sender.forget(1)
            decode.rank_kv.forget(PREFILL_RANK)
            del store
