"""KVPool.move_slots: a request's KV moved between slots of the pool on the device (a draft
tree's accepted nodes to the positions their request keeps), every layer's K and V at once."""

from __future__ import annotations

import pytest
import torch
from devices import DEVICES

from engine.scheduling.allocator import PADDING_SLOT
from engine.scheduling.kv_pool import KVPool


def _numbered_pool(device: str) -> KVPool:
    pool = KVPool(8, 2, 1, 3, torch.float32, device)
    values = torch.arange(pool.kv_buffer.numel(), dtype=torch.float32, device=device)
    pool.kv_buffer.copy_(values.view_as(pool.kv_buffer))
    return pool


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "moves",
    [
        [(3, 2), (4, 3), (5, 4)],  # down: each slot read before the move into it
        [(2, 3), (3, 4), (4, 5)],  # up: a slot-by-slot copy would carry slot 2 to all three
        [(6, 1)],
    ],
)
def test_every_source_is_read_before_any_target_is_written(
    device: str, moves: list[tuple[int, int]]
) -> None:
    pool = _numbered_pool(device)
    before = pool.kv_buffer.clone()
    source = torch.tensor([s for s, _ in moves], device=device)
    target = torch.tensor([t for _, t in moves], device=device)
    pool.move_slots(source, target)
    after = pool.kv_buffer
    for s, t in moves:
        assert torch.equal(after[t], before[s])  # every layer, K and V
    untouched = [slot for slot in range(pool.capacity + 1) if slot not in dict(moves).values()]
    assert torch.equal(after[untouched], before[untouched])


@pytest.mark.parametrize("device", DEVICES)
def test_pairs_sent_to_the_padding_slot_move_nothing_real(device: str) -> None:
    """A caller that moves fewer slots for one request than for another sends the rest to the
    padding slot: only that slot (which nobody reads) changes besides the real targets."""
    pool = _numbered_pool(device)
    before = pool.kv_buffer.clone()
    source = torch.tensor([5, PADDING_SLOT, 7, PADDING_SLOT], device=device)
    target = torch.tensor([4, PADDING_SLOT, PADDING_SLOT, PADDING_SLOT], device=device)
    pool.move_slots(source, target)
    assert torch.equal(pool.kv_buffer[4], before[5])
    changed = (pool.kv_buffer != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= {PADDING_SLOT, 4}
    # The per-layer views read the moved KV.
    assert torch.equal(pool.k_buffers[1][4], before[5, 1, 0])
    assert torch.equal(pool.v_buffers[0][4], before[5, 0, 1])
