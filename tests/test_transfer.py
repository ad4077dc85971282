"""The KV + metadata transfer over a real gloo group of 3 processes: 0 = prefill A, 1 = prefill B,
2 = decode. One scripted run (module fixture) covers, per room: KV byte-identical at different
slot numbers on each side, the metadata row landed; two senders interleaved; a room-tag mismatch;
a receive whose sender never sends (timeout, which breaks that channel only, and leaves the
handle saying its slots may still be written) next to a transfer from another peer that
completes; a send that fails inside the worker, which then sends the next. A second run of 2
processes moves pools whose slots are one contiguous run on either side, both, or neither: each
side sends from (receives into) the pool itself or gathers (scatters) on its own, and every
combination lands the same bytes. Children report plain Python values through a multiprocessing
Queue."""

from __future__ import annotations

import os
import queue
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import metadata.kv_receiver as kv_receiver
import metadata.kv_sender as kv_sender
from engine.scheduling.kv_pool import KVPool
from metadata.buffers import MetadataBuffers
from metadata.process_group import create_store_server, init_transfer_group
from metadata.transfer import KVReceiver, KVSender, TransferHandle, TransferState
from metadata.wire import KVSource, PoolMessages, gather_kv, kv_nbytes, scatter_kv

CAPACITY = 96
HIDDEN_SIZE = 16
SPEC_HIDDEN_SIZE = 2 * HIDDEN_SIZE  # wider than hidden_size, as with hc_mult = 2
DRAFT_STEPS, TOPK = 2, 1
# (room, tokens) per prefill rank, in send order; B's 204 is announced but never sent.
ROOMS = {0: [(101, 1), (102, 7), (103, 33)], 1: [(201, 5), (202, 1), (203, 12)]}
MISMATCH_ROOM, WRONG_TAG = 104, 999
NEVER_SENT, AFTER_TIMEOUT_B, AFTER_TIMEOUT_A = (204, 3), (205, 4), (105, 6)
# Short deadlines only where a timeout is the point; generous ones elsewhere, so that a loaded
# machine never fails a transfer that should succeed.
RECEIVE_TIMEOUT_S, SEND_TIMEOUT_S, GENEROUS_S = 5.0, 3.0, 30.0
GATHER_FAILS, AFTER_SEND_FAILURE = 301, 302
BEGUN = 102  # sent in two parts: `KVSender.begin` posts the target KV, `send` the rest
ALL = ROOMS[0] + ROOMS[1] + [(MISMATCH_ROOM, 2), NEVER_SENT, AFTER_TIMEOUT_B, AFTER_TIMEOUT_A]


def make_pools(seed: int | None, device: str = "cpu") -> list[KVPool]:
    """Target pool (bf16) and one draft depth (fp32); random contents when seeded, else zeros."""
    pools = [
        KVPool(CAPACITY, 3, 2, 8, torch.bfloat16, device),
        KVPool(CAPACITY, 1, 2, 4, torch.float32, device),
    ]
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)  # on the CPU: the same values on any device
        for pool in pools:
            for buf in pool.k_buffers + pool.v_buffers:
                buf.copy_(torch.randn(buf.shape, generator=gen))
    return pools


def slot_plan(seed: int) -> dict[int, list[int]]:
    """Disjoint random slots per room (every room, so both sides can derive either side's)."""
    perm = (torch.randperm(CAPACITY, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    plan, start = {}, 0
    for room, n in ALL:
        plan[room], start = perm[start : start + n], start + n
    return plan


def row_values(room: int) -> dict:
    gen = torch.Generator().manual_seed(room)
    return dict(
        output_id=room * 3,
        output_logprob=-room / 1000,
        hidden_state=torch.randn(SPEC_HIDDEN_SIZE, generator=gen).to(torch.bfloat16),
        topk_index=torch.tensor([room, room + 1]),
        topk_p=torch.tensor([0.5, 0.25]),
        cached_tokens=room % 5,
    )


def make_metadata(device: str = "cpu") -> MetadataBuffers:
    return MetadataBuffers(16, SPEC_HIDDEN_SIZE, DRAFT_STEPS, TOPK, torch.bfloat16, device)


def run_prefill(rank: int) -> dict:
    pools, plan, metadata = make_pools(seed=rank), slot_plan(seed=rank), make_metadata()
    sender = KVSender("cpu", timeout_s=GENEROUS_S)
    connected = [sender.connect(2)] + ([sender.connect(1)] if rank == 0 else [])
    script = [(room, room) for room, _ in ROOMS[rank]]
    script += [(MISMATCH_ROOM, WRONG_TAG), (AFTER_TIMEOUT_A[0],) * 2] if rank == 0 else []
    script += [(AFTER_TIMEOUT_B[0],) * 2] if rank == 1 else []
    handles: list[tuple[TransferHandle, int]] = []
    for room, tag in script:
        row = metadata.allocate()
        metadata.write_row(row, room=tag, **row_values(room))
        pairs = [(pool, plan[room]) for pool in pools]
        # Short for B's room that the decode rank will no longer receive: it fails quickly.
        timeout = SEND_TIMEOUT_S if room == AFTER_TIMEOUT_B[0] else None
        # BEGUN's target KV goes first, before its row exists; the receiver sees one transfer.
        begun = sender.begin(2, room, PoolMessages.build(pairs[:1])) if room == BEGUN else None
        handles.append(
            (sender.send(2, room, pairs, metadata, row, timeout_s=timeout, begun=begun), row)
        )
    # The caller's thread posts: `send` returns with the sends posted, in the caller's order.
    result = {"posted_on_return": [("posted" in handle.phases) for handle, _ in handles]}
    if rank == 0:
        # A pool whose storage is broken: the gather (of slots that are not one ascending run)
        # raises in `send` (as a CUDA OOM would) before anything is posted; 302 is sent after.
        corrupt = make_pools(seed=None)[1]
        corrupt.kv_buffer = torch.zeros(1)
        for room, pool, slots in (
            (GATHER_FAILS, corrupt, [2, 1]),
            (AFTER_SEND_FAILURE, pools[0], [1, 2]),
        ):
            row = metadata.allocate()
            metadata.write_row(row, room=room, **row_values(room))
            # A begin that fails before posting anything leaves `send` the whole transfer.
            begun = None
            if room == AFTER_SEND_FAILURE:
                begun = sender.begin(1, room, PoolMessages.build([(corrupt, [2, 1])]))
            result[f"begin-{room}"] = None if begun is None else (begun.state.name, begun.error)
            handles.append((sender.send(1, room, [(pool, slots)], metadata, row, begun=begun), row))
        try:
            sender.send(7, 999, [(pools[0], [1])], metadata, 15)
        except ValueError as err:
            result["bad_peer"] = str(err)
    else:
        receiver = KVReceiver("cpu", timeout_s=GENEROUS_S)
        result["connected_receiver"] = receiver.connect(0).wait(60).name
        # 301 was announced (as a prefill node does before its forward): its receives are
        # posted, and the send that failed before posting must still fill them.
        failed = receiver.expect(
            0, GATHER_FAILS, [(make_pools(seed=None)[1], [7, 8])], metadata, metadata.allocate()
        )
        target, target_row = make_pools(seed=None)[0], metadata.allocate()
        received = receiver.expect(0, AFTER_SEND_FAILURE, [(target, [5, 6])], metadata, target_row)
        result["received_failed_send"] = (failed.wait(60).name, failed.error)
        result["received_after_send_failure"] = received.wait(60).name
        receiver.close()
    for handle, row in handles:
        result[handle.room] = (handle.wait(60).name, handle.error)
        result[f"phases-{handle.room}"] = (handle.phases, handle.elapsed_s)
        result[f"may_still_read-{handle.room}"] = handle.may_still_read
        metadata.free(row)
    result["connected"] = [handle.wait(60).name for handle in connected]
    sender.close()
    return result


def run_decode() -> dict:
    pools, plan, metadata = make_pools(seed=None), slot_plan(seed=2), make_metadata()
    receiver = KVReceiver("cpu", timeout_s=GENEROUS_S)
    connected = [receiver.connect(0), receiver.connect(1)]
    order = [(0, r) for r in ROOMS[0]] + [(1, r) for r in ROOMS[1]]
    order = order[0::3] + order[1::3] + order[2::3]  # interleave A and B room by room
    order += [(0, (MISMATCH_ROOM, 2)), (1, NEVER_SENT), (1, AFTER_TIMEOUT_B), (0, AFTER_TIMEOUT_A)]
    handles = {}
    for src, (room, _) in order:
        row = metadata.allocate()
        pairs = [(pool, plan[room]) for pool in pools]
        timeout = RECEIVE_TIMEOUT_S if room == NEVER_SENT[0] else None
        handle = receiver.expect(src, room, pairs, metadata, row, timeout_s=timeout)
        handles[room] = (handle, src, row)
    handles[AFTER_TIMEOUT_A[0]][0].wait(60)
    result = {"never_sent_state_when_a_done": handles[NEVER_SENT[0]][0].state.name}
    senders = {src: (make_pools(seed=src), slot_plan(seed=src)) for src in (0, 1)}
    for room, (handle, src, row) in handles.items():
        state = handle.wait(60)
        src_pools, src_plan = senders[src]
        kv_equal = all(
            torch.equal(gather_kv(p, plan[room]), gather_kv(q, src_plan[room]))
            for p, q in zip(pools, src_pools)
        )
        expected = row_values(room)
        row_ok = (
            int(metadata.output_ids[row]) == expected["output_id"]
            and metadata.output_logprob[row].item()
            == torch.tensor(expected["output_logprob"], dtype=torch.float32).item()
            and torch.equal(metadata.hidden_states[row], expected["hidden_state"])
            and metadata.topk_index[row].tolist() == expected["topk_index"].tolist()
            and metadata.topk_p[row].tolist() == expected["topk_p"].tolist()
            and int(metadata.cached_tokens[row]) == expected["cached_tokens"]
        )
        result[room] = dict(
            state=state.name,
            error=handle.error,
            kv_equal=kv_equal,
            row_ok=row_ok,
            landed=metadata.row_landed(row, room),
            phases=handle.phases,
            elapsed_s=handle.elapsed_s,
            may_still_write=handle.may_still_write,
        )
    used = sorted(s for room, _ in ALL if room != NEVER_SENT[0] for s in plan[room])
    untouched = torch.ones(CAPACITY + 1, dtype=torch.bool)
    untouched[used] = False
    result["connected"] = [handle.wait(60).name for handle in connected]
    result["untouched_zero"] = all(
        not buf[untouched].any() for p in pools for buf in p.k_buffers + p.v_buffers
    )
    receiver.close()
    return result


def child(scenario: str, rank: int, world: int, port: int, results: mp.Queue) -> None:
    torch.set_num_threads(1)  # up to three processes on two cores
    try:
        device = {"cuda": f"cuda:{rank}", "shared_gpu": "cuda:0"}.get(scenario, "cpu")
        backend = "gloo" if scenario in HOST_STAGED else None
        init_transfer_group("127.0.0.1", port, rank, world, device, timeout_s=60, backend=backend)
        if scenario in ("cuda", *HOST_STAGED):
            result = run_cuda(rank, device, host_staged=scenario in HOST_STAGED)
        elif scenario == "combos":
            result = run_combos(rank)
        elif scenario == "discard":
            result = run_discard(rank)
        else:
            result = run_decode() if rank == 2 else run_prefill(rank)
        results.put((rank, result))
    except BaseException:
        results.put((rank, {"crash": traceback.format_exc()}))
    # Nobody leaves while a peer may still be receiving. Not a gloo barrier: the timeouts above
    # broke a channel on purpose, and the store is independent of it.
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    store.add("finished", 1)
    while store.add("finished", 0) < world:
        time.sleep(0.05)
    # Leave without tearing down the group or finalizing the interpreter: operations parked by
    # the timeouts are still posted (NCCL would wait for them), and a daemon thread woken inside
    # gloo that re-enters Python during finalization aborts the process ("terminate called
    # without an active exception").
    results.close()
    results.join_thread()
    os._exit(0)


def run_ranks(scenario: str, world: int) -> dict[int, dict]:
    store, port = create_store_server("127.0.0.1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=child, args=(scenario, rank, world, port, results))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    collected = {}
    try:
        for _ in procs:
            rank, result = results.get(timeout=120)
            collected[rank] = result
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(world)) - set(collected))} never reported")
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        del store
    for rank, result in collected.items():
        assert "crash" not in result, f"rank {rank}:\n{result['crash']}"
    assert [proc.exitcode for proc in procs] == [0] * world
    return collected


@pytest.fixture(scope="module")
def outcome() -> dict[int, dict]:
    return run_ranks("cpu", world=3)


def test_connect_opens_every_channel(outcome: dict) -> None:
    assert outcome[0]["connected"] == ["SUCCESS", "SUCCESS"]
    assert outcome[1]["connected"] == ["SUCCESS"]
    assert outcome[1]["connected_receiver"] == "SUCCESS"
    assert outcome[2]["connected"] == ["SUCCESS", "SUCCESS"]


@pytest.mark.parametrize("room", [room for room, _ in ROOMS[0] + ROOMS[1]] + [105])
def test_kv_and_row_land_at_other_slots(outcome: dict, room: int) -> None:
    got = outcome[2][room]
    assert got["state"] == "SUCCESS", got["error"]
    assert got["kv_equal"] and got["row_ok"] and got["landed"]


def test_receiver_writes_only_its_slots(outcome: dict) -> None:
    assert outcome[2]["untouched_zero"]


def test_senders_succeed(outcome: dict) -> None:
    for rank in (0, 1):
        for room, _ in ROOMS[rank]:
            state, error = outcome[rank][room]
            assert state == "SUCCESS", (room, error)


def test_room_tag_mismatch_fails_with_reason(outcome: dict) -> None:
    got = outcome[2][MISMATCH_ROOM]
    assert got["state"] == "FAILED" and not got["landed"]
    assert f"room tag mismatch: expected {MISMATCH_ROOM} got {WRONG_TAG}" in got["error"]
    assert got["kv_equal"]  # the KV itself arrived; only the tag says it is not this room's


def test_receive_that_never_comes_times_out_without_blocking_other_peers(outcome: dict) -> None:
    got = outcome[2][NEVER_SENT[0]]
    assert got["state"] == "FAILED"
    assert "rank 1" in got["error"] and f"within {RECEIVE_TIMEOUT_S:g} s" in got["error"]
    # A's later room finished while B's stuck receive was still pending, and A's channel (and
    # the whole gloo group: no timed gloo wait was used) stays usable after the timeout.
    assert outcome[2]["never_sent_state_when_a_done"] in ("WAITING", "TRANSFERRING")
    assert outcome[2][AFTER_TIMEOUT_A[0]]["state"] == "SUCCESS"
    assert outcome[1]["received_after_send_failure"] == "SUCCESS"


def test_a_timed_out_transfer_says_its_buffers_may_still_be_touched(outcome: dict) -> None:
    # The receive of 204 stays posted: the decode node must never hand its slots on.
    assert outcome[2][NEVER_SENT[0]]["may_still_write"]
    # 205 failed at once on the broken channel, before posting anything; the rest completed.
    for room, _ in ALL:
        if room != NEVER_SENT[0]:
            assert not outcome[2][room]["may_still_write"], room
    # B's send of 205 stays posted too: the prefill node must keep its slots and row.
    assert outcome[1][f"may_still_read-{AFTER_TIMEOUT_B[0]}"]
    assert not outcome[1][f"may_still_read-{ROOMS[1][0][0]}"]
    assert not outcome[0][f"may_still_read-{GATHER_FAILS}"]  # failed before posting


def test_timeout_breaks_that_channel_on_both_sides(outcome: dict) -> None:
    # The receive of 204 is still posted, so B's next room must not be received after it...
    got = outcome[2][AFTER_TIMEOUT_B[0]]
    assert got["state"] == "FAILED" and "channel to rank 1 unusable since room 204" in got["error"]
    # ...and B's send of it, never matched, fails at the sender's own deadline.
    state, error = outcome[1][AFTER_TIMEOUT_B[0]]
    assert state == "FAILED" and f"within {SEND_TIMEOUT_S:g} s" in error


def test_a_begun_transfer_lands_as_one(outcome: dict) -> None:
    phases, _ = outcome[0][f"phases-{BEGUN}"]
    assert list(phases) == ["begun", "gathered", "posted", "completed"]
    assert outcome[0][BEGUN] == ("SUCCESS", None)
    got = outcome[2][BEGUN]
    assert got["state"] == "SUCCESS" and got["kv_equal"] and got["row_ok"] and got["landed"]


def test_a_failed_begin_leaves_the_whole_transfer_to_send(outcome: dict) -> None:
    state, error = outcome[0][f"begin-{AFTER_SEND_FAILURE}"]
    assert state == "FAILED" and f"room {AFTER_SEND_FAILURE}, peer rank 1" in error
    assert outcome[0][AFTER_SEND_FAILURE] == ("SUCCESS", None)
    assert outcome[1]["received_after_send_failure"] == "SUCCESS"


def test_send_returns_with_the_sends_already_posted(outcome: dict) -> None:
    for rank in (0, 1):
        assert outcome[rank]["posted_on_return"] and all(outcome[rank]["posted_on_return"])


def test_send_failure_names_room_and_peer_and_worker_survives(outcome: dict) -> None:
    state, error = outcome[0][GATHER_FAILS]
    assert state == "FAILED" and f"room {GATHER_FAILS}, peer rank 1" in error
    assert outcome[0][AFTER_SEND_FAILURE] == ("SUCCESS", None)
    assert outcome[1]["received_after_send_failure"] == "SUCCESS"


def test_a_send_that_fails_before_posting_goes_out_as_zeros(outcome: dict) -> None:
    """The receiver, whose receives were posted at the announcement, fails that room on its
    row's tag (zeros: room 0), and the pair's next transfer lands in order."""
    state, error = outcome[1]["received_failed_send"]
    assert state == "FAILED" and f"expected {GATHER_FAILS} got 0" in error
    assert outcome[1]["received_after_send_failure"] == "SUCCESS"


def test_send_to_a_rank_outside_the_world_is_refused(outcome: dict) -> None:
    assert "peer rank 7 is not another rank of this world (size 3" in outcome[0]["bad_peer"]


def assert_phases_in_order(phases: dict[str, float], names: list[str], elapsed_s: float) -> None:
    assert list(phases) == names
    times = list(phases.values())
    assert 0 <= times[0] and times == sorted(times) and times[-1] <= elapsed_s


@pytest.mark.parametrize("room", [room for room, _ in ROOMS[0]])
def test_handles_time_each_phase_of_the_job(outcome: dict, room: int) -> None:
    phases, elapsed_s = outcome[0][f"phases-{room}"]
    begun = ["begun"] if room == BEGUN else []
    assert_phases_in_order(phases, [*begun, "gathered", "posted", "completed"], elapsed_s)
    got = outcome[2][room]
    names = ["posted", "landed", "scattered", "synced"]
    assert_phases_in_order(got["phases"], names, got["elapsed_s"])


def test_phase_clock_counts_from_the_job_start_and_needs_no_gpu() -> None:
    handle = TransferHandle(room=5, peer=1)
    handle.start_clock(gpu_events=False)
    time.sleep(0.002)
    handle.mark("posted")
    handle.mark("completed")
    handle.stop_clock(read_gpu_events=True)
    assert 0.002 <= handle.phases["posted"] <= handle.phases["completed"] <= handle.elapsed_s
    assert handle.gpu_phases == {}


def test_handle_moves_forward_only_and_failure_is_sticky() -> None:
    handle = TransferHandle(room=5, peer=1)
    assert handle.state == TransferState.BOOTSTRAPPING
    handle.advance(TransferState.TRANSFERRING)
    handle.advance(TransferState.WAITING)
    assert handle.state == TransferState.TRANSFERRING
    assert handle.wait(0.01) == TransferState.TRANSFERRING  # not done: returns after timeout
    handle.fail("lost")
    handle.advance(TransferState.SUCCESS)
    assert handle.wait() == TransferState.FAILED and handle.error == "lost"


def test_gather_scatter_round_trip_and_slot_validation() -> None:
    source, target = make_pools(seed=3)[0], make_pools(seed=None)[0]
    kv = gather_kv(source, [5, 2, 9])
    assert kv.shape == (3, 3, 2, 2, 8) and kv.is_contiguous()
    scatter_kv(target, [1, 40, 7], kv)
    assert torch.equal(gather_kv(target, [1, 40, 7]), kv)
    # The per-layer views the model writes through see what the transfer scattered.
    assert torch.equal(target.k_buffers[2][40], kv[1, 2, 0])
    assert torch.equal(target.v_buffers[0][7], kv[2, 0, 1])
    for bad in ([0], [CAPACITY + 1]):
        with pytest.raises(ValueError, match="slots must lie in"):
            KVSource.build([(source, bad)], make_metadata(), 0)


# --- each side reads or fills a pool in place when its slots there are one contiguous run ---
# (room, sender's pools direct, receiver's pools direct, tokens): every combination, and one
# transfer whose two pools go different ways on each side.
COMBOS = [
    (401, (True, True), (True, True), 9),
    (402, (True, True), (False, False), 8),
    (403, (False, False), (True, True), 7),
    (404, (False, False), (False, False), 5),
    (405, (True, False), (False, True), 6),
]
COMBO_REGION = 18  # slots per room, per pool: room i uses [1 + 18 i, 1 + 18 (i + 1))


def combo_slots(room: int, direct: bool, n: int, receiver: bool) -> list[int]:
    """A contiguous run, or the same count of slots spread out and out of order; the receiver's
    sit elsewhere in its region than the sender's."""
    first = 1 + (room - COMBOS[0][0]) * COMBO_REGION + (1 if receiver else 0)
    if direct:
        return list(range(first, first + n))
    spread = list(range(first, first + 2 * n, 2))
    return spread[1::2] + spread[0::2]


def combo_plan(receiver: bool) -> dict[int, list[list[int]]]:
    plan = {}
    for room, sent, landed, n in COMBOS:
        directs = landed if receiver else sent
        plan[room] = [combo_slots(room, direct, n, receiver) for direct in directs]
    return plan


def counting(module, name: str, counts: dict[str, int]):
    """Wraps module.<name> (the sender's gather_kv, the receiver's scatter_kv) to count its calls
    in this process."""
    inner = getattr(module, name)

    def wrapper(*args, **kwargs):
        counts[name] += 1
        return inner(*args, **kwargs)

    setattr(module, name, wrapper)


def run_combos(rank: int) -> dict:
    counts = {"gather_kv": 0, "scatter_kv": 0}
    counting(kv_sender, "gather_kv", counts)
    counting(kv_receiver, "scatter_kv", counts)
    receiving = rank == 1
    pools, metadata = make_pools(seed=None if receiving else 0), make_metadata()
    plan = combo_plan(receiving)
    workers = KVReceiver("cpu", timeout_s=GENEROUS_S) if receiving else KVSender("cpu")
    result = {"connected": workers.connect(1 - rank).wait(60).name}
    for room, *_ in COMBOS:
        row = metadata.allocate()
        pairs = list(zip(pools, plan[room]))
        before = dict(counts)
        if receiving:
            handle = workers.expect(0, room, pairs, metadata, row)
        else:
            metadata.write_row(row, room=room, **row_values(room))
            handle = workers.send(1, room, pairs, metadata, row)
        state = handle.wait(60)
        got = dict(
            state=state.name,
            error=handle.error,
            staged=handle.staged,
            calls={name: counts[name] - before[name] for name in counts},
            nbytes=handle.nbytes,
        )
        if receiving:
            sent_pools, sent_plan = make_pools(seed=0), combo_plan(receiver=False)
            got["kv_equal"] = all(
                torch.equal(gather_kv(p, slots), gather_kv(q, sent))
                for p, slots, q, sent in zip(pools, plan[room], sent_pools, sent_plan[room])
            )
            got["landed"] = metadata.row_landed(row, room)
            expected = row_values(room)
            got["row_ok"] = int(metadata.output_ids[row]) == expected["output_id"] and (
                torch.equal(metadata.hidden_states[row], expected["hidden_state"])
            )
        result[room] = got
    if receiving:
        written = torch.zeros(CAPACITY + 1, dtype=torch.bool)
        for slots_per_pool in plan.values():
            for slots in slots_per_pool:
                written[slots] = True
        result["untouched_zero"] = all(
            not buf[~written].any() for p in pools for buf in p.k_buffers + p.v_buffers
        )
    workers.close()
    return result


@pytest.fixture(scope="module")
def combos() -> dict[int, dict]:
    return run_ranks("combos", world=2)


@pytest.mark.parametrize("room", [room for room, *_ in COMBOS])
def test_in_place_and_staged_sides_interoperate(combos: dict, room: int) -> None:
    sent, landed = combos[0][room], combos[1][room]
    assert sent["state"] == landed["state"] == "SUCCESS", (sent["error"], landed["error"])
    assert landed["kv_equal"] and landed["landed"] and landed["row_ok"]
    assert sent["nbytes"] == landed["nbytes"]  # one byte count, whichever way each side went


@pytest.mark.parametrize(("room", "sent_direct", "landed_direct", "_n"), COMBOS)
def test_each_side_stages_only_the_pools_whose_slots_are_spread(
    combos: dict, room: int, sent_direct: tuple, landed_direct: tuple, _n: int
) -> None:
    sent, landed = combos[0][room], combos[1][room]
    # A pool sent from a contiguous run is neither gathered nor staged.
    assert sent["staged"] == sent["calls"]["gather_kv"] == sent_direct.count(False)
    assert sent["calls"]["scatter_kv"] == 0
    assert landed["staged"] == landed["calls"]["scatter_kv"] == landed_direct.count(False)
    assert landed["calls"]["gather_kv"] == 0


def test_direct_receives_write_only_their_slots(combos: dict) -> None:
    assert combos[1]["untouched_zero"]
    assert combos[0]["connected"] == combos[1]["connected"] == "SUCCESS"


def run_cuda(rank: int, device: str, host_staged: bool = False) -> dict:
    """Rank 0 -> rank 1 on two GPUs over NCCL (or, `host_staged`, over gloo through host memory:
    two nodes sharing a GPU): two rooms at scattered slots and the COMBOS rooms (pools read and
    filled in place or staged, each side on its own) land byte-identical, then a room that is
    never sent times out on the receiver's own clock and breaks that channel."""
    pools = make_pools(seed=0 if rank == 0 else None, device=device)
    plan, metadata = slot_plan(seed=rank), make_metadata(device)
    combo = combo_plan(receiver=rank == 1)
    transfers = [(room, [(p, plan[room]) for p in pools]) for room in (101, 102)]
    transfers += [(room, list(zip(pools, combo[room]))) for room, *_ in COMBOS]
    # First a transfer the receiver discards; BEGUN's target KV goes ahead of its row.
    discarded = (DISCARDED[0], [(p, DISCARDED[1]) for p in pools])
    if rank == 0:
        sender = KVSender(device, phase_events=True, host_staged=host_staged)
        handles = [sender.connect(1)]
        for room, pairs in [discarded, *transfers]:
            row = metadata.allocate()
            metadata.write_row(row, room=room, **row_values(room))
            begun = sender.begin(1, room, PoolMessages.build(pairs[:1])) if room == BEGUN else None
            handles.append(sender.send(1, room, pairs, metadata, row, begun=begun))
        result = {
            "sent": [h.wait(60).name for h in handles],
            "gpu_phases": [h.gpu_phases for h in handles],
            "staged": {h.room: h.staged for h in handles[1:]},
        }
        sender.close()
        return result
    receiver = KVReceiver(device, timeout_s=GENEROUS_S, host_staged=host_staged)
    result = {"connected": receiver.connect(0).wait(60).name}
    sizes = [kv_nbytes(p, len(DISCARDED[1])) for p in pools] + [metadata.row_nbytes]
    scratch = receiver.discard(0, DISCARDED[0], sizes)
    sent_pools = make_pools(seed=0)
    sent_plan, sent_combo = slot_plan(seed=0), combo_plan(receiver=False)
    for room, pairs in transfers:
        row = metadata.allocate()
        handle = receiver.expect(0, room, pairs, metadata, row)
        sent_slots = [sent_plan[room]] * len(pools) if room < 400 else sent_combo[room]
        result[room] = (
            handle.wait(60).name,
            handle.error,
            metadata.row_landed(row, room),
            all(
                torch.equal(gather_kv(p, slots).cpu(), gather_kv(q, sent))
                for (p, slots), q, sent in zip(pairs, sent_pools, sent_slots)
            ),
            handle.staged,
        )
    for room in (103, 104):  # 103 is never sent; 104 queues behind it on the broken channel
        handle = receiver.expect(
            0, room, [(pools[0], [1])], metadata, metadata.allocate(), timeout_s=RECEIVE_TIMEOUT_S
        )
        result[room] = (handle.wait(60).name, handle.error, handle.may_still_write)
    result["discarded"] = scratch.wait(60).name
    receiver.close()
    return result


# Scenarios whose group is gloo while the pools may be on a GPU: every message crosses through
# host memory. "host_staged" runs that path on CPU pools, "shared_gpu" on one GPU shared by both.
HOST_STAGED = ("host_staged", "shared_gpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_transfer_between_two_gpus() -> None:
    got = run_ranks("cuda", world=2)
    assert list(got[0]["gpu_phases"][0]) == ["started"]  # connect: no phases of its own
    rooms = [DISCARDED[0], 101, 102] + [room for room, *_ in COMBOS]
    for room, gpu_phases in zip(rooms, got[0]["gpu_phases"][1:]):
        begun = ["begun", "kv_sent"] if room == BEGUN else []
        assert list(gpu_phases) == ["started", *begun, "gathered", "posted", "completed"]
        assert gpu_phases["completed"] >= gpu_phases["gathered"] >= 0
    check_landed(got)


def test_transfer_staged_through_host_memory() -> None:
    """The path of two nodes sharing a GPU (gloo cannot send GPU tensors), run on CPU pools:
    fresh host buffers on the wire, copied into the slots and the row after landing."""
    check_landed(run_ranks("host_staged", world=2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_transfer_between_two_processes_sharing_one_gpu() -> None:
    check_landed(run_ranks("shared_gpu", world=2))


def check_landed(got: dict[int, dict]) -> None:
    assert got[0]["sent"] == ["SUCCESS"] * (4 + len(COMBOS))
    assert got[1]["connected"] == "SUCCESS" and got[1]["discarded"] == "SUCCESS"
    # One token is a run of one: read and filled in place; 33 scattered ones are staged.
    assert got[1][101] == ("SUCCESS", None, True, True, 0) and got[0]["staged"][101] == 0
    assert got[1][102] == ("SUCCESS", None, True, True, 2) and got[0]["staged"][102] == 2
    for room, sent_direct, landed_direct, _ in COMBOS:
        assert got[1][room] == ("SUCCESS", None, True, True, landed_direct.count(False))
        assert got[0]["staged"][room] == sent_direct.count(False)
    state, error, may_still_write = got[1][103]
    assert state == "FAILED" and f"within {RECEIVE_TIMEOUT_S:g} s" in error and may_still_write
    state, error, may_still_write = got[1][104]
    assert state == "FAILED" and "channel to rank 0 unusable since room 103" in error
    assert not may_still_write


# A transfer the decode side refuses is still sent: received into scratch, it keeps the pair's
# order, and the next transfer lands whole.
DISCARDED, AFTER_DISCARD = (601, [1, 2, 3]), (602, [4, 5, 6, 7, 8])


def run_discard(rank: int) -> dict:
    receiving = rank == 1
    pools, metadata = make_pools(seed=None if receiving else 0), make_metadata()
    workers = KVReceiver("cpu", timeout_s=GENEROUS_S) if receiving else KVSender("cpu")
    result = {"connected": workers.connect(1 - rank).wait(60).name}
    handles = {}
    for room, slots in (DISCARDED, AFTER_DISCARD):
        row = metadata.allocate()
        if not receiving:
            metadata.write_row(row, room=room, **row_values(room))
            handles[room] = workers.send(1, room, [(p, slots) for p in pools], metadata, row)
        elif room == DISCARDED[0]:
            sizes = [kv_nbytes(p, len(slots)) for p in pools] + [metadata.row_nbytes]
            handles[room] = workers.discard(0, room, sizes)
        else:
            landing = [(p, [s + 40 for s in slots]) for p in pools]
            handles[room] = workers.expect(0, room, landing, metadata, row)
            result["row"] = row
    for room, handle in handles.items():
        result[room] = (handle.wait(60).name, handle.error)
    if receiving:
        sent = make_pools(seed=0)
        slots = AFTER_DISCARD[1]
        result["kv_equal"] = all(
            torch.equal(gather_kv(p, [s + 40 for s in slots]), gather_kv(q, slots))
            for p, q in zip(pools, sent)
        )
        result["landed"] = metadata.row_landed(result.pop("row"), AFTER_DISCARD[0])
        # Nothing of the discarded transfer reached a pool.
        result["pools_untouched"] = all(
            not buf[: 40 + 1].any() for p in pools for buf in p.k_buffers + p.v_buffers
        )
    workers.close()
    return result


def test_a_discarded_transfer_keeps_the_pair_in_order() -> None:
    got = run_ranks("discard", world=2)
    assert got[0][DISCARDED[0]] == ("SUCCESS", None) == got[1][DISCARDED[0]]
    assert got[0][AFTER_DISCARD[0]] == ("SUCCESS", None) == got[1][AFTER_DISCARD[0]]
    assert got[1]["kv_equal"] and got[1]["landed"] and got[1]["pools_untouched"]
