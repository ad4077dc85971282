"""MetadataBuffers: the row allocator, the room tag (written last, zeroed on free), and the hidden
width, which is spec_hidden_size and never hidden_size."""

from __future__ import annotations

import pytest
import torch

from metadata.buffers import FIELDS, MetadataBuffers

HIDDEN_SIZE = 8


def make(spec_hidden_size: int = HIDDEN_SIZE, rows: int = 3) -> MetadataBuffers:
    return MetadataBuffers(rows, spec_hidden_size, 2, 1, torch.bfloat16, "cpu")


def write(buffers: MetadataBuffers, row: int, room: int, width: int | None = None) -> None:
    width = buffers.spec_hidden_size if width is None else width
    buffers.write_row(
        row, room=room, output_id=7, output_logprob=-0.5, hidden_state=torch.ones(width)
    )


def test_allocate_hands_out_each_row_once_and_free_returns_it() -> None:
    buffers = make(rows=3)
    rows = [buffers.allocate() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2] and buffers.num_free == 0
    with pytest.raises(MemoryError, match="all 3 metadata rows"):
        buffers.allocate()
    buffers.free(rows[1])
    assert buffers.num_free == 1 and buffers.allocate() == rows[1]
    with pytest.raises(ValueError, match="freed but not allocated"):
        buffers.free(rows[1] + 10)


def test_double_free_is_refused() -> None:
    buffers = make()
    row = buffers.allocate()
    buffers.free(row)
    with pytest.raises(ValueError, match="freed but not allocated"):
        buffers.free(row)


def test_row_landed_only_for_its_room_and_free_zeroes_the_room() -> None:
    buffers = make()
    row = buffers.allocate()
    assert not buffers.row_landed(row, 42)
    write(buffers, row, room=42)
    assert buffers.row_landed(row, 42) and not buffers.row_landed(row, 43)
    buffers.free(row)
    assert int(buffers.room[row]) == 0 and not buffers.row_landed(row, 42)


def test_write_row_fills_every_field() -> None:
    buffers = make()
    row = buffers.allocate()
    buffers.write_row(
        row,
        room=9,
        output_id=5,
        output_logprob=-1.25,
        hidden_state=torch.arange(HIDDEN_SIZE, dtype=torch.float32),
        topk_index=torch.tensor([[3], [4]]),
        topk_p=torch.tensor([0.75, 0.5]),
        cached_tokens=6,
    )
    got = dict(zip(FIELDS, buffers.row_tensors(row)))
    assert got["output_ids"].tolist() == [5] and got["output_logprob"].tolist() == [-1.25]
    assert got["hidden_states"].tolist() == list(range(HIDDEN_SIZE))
    assert got["topk_index"].tolist() == [3, 4] and got["topk_p"].tolist() == [0.75, 0.5]
    assert got["cached_tokens"].tolist() == [6] and got["room"].tolist() == [9]


def test_row_tensors_are_views_in_field_order_with_room_last() -> None:
    buffers = make()
    row = buffers.allocate()
    tensors = buffers.row_tensors(row)
    assert FIELDS[-1] == "room" and len(tensors) == len(FIELDS)
    assert all(t.is_contiguous() and t.dim() == 1 for t in tensors)
    tensors[-1].fill_(77)  # a view: writing it writes the row, which is how a receive lands
    assert buffers.row_landed(row, 77)


def test_copy_row_from_lands_a_staged_row() -> None:
    source, target = make(), make()
    write(source, source.allocate(), room=11)
    staged = target.empty_row_tensors()
    for dst, src in zip(staged, source.row_tensors(0)):
        dst.copy_(src)
    row = target.allocate()
    target.copy_row_from(row, staged)
    assert target.row_landed(row, 11) and torch.equal(
        target.hidden_states[row], source.hidden_states[0]
    )


def test_wrong_hidden_width_is_rejected_naming_both_widths() -> None:
    buffers = make(spec_hidden_size=2 * HIDDEN_SIZE)
    row = buffers.allocate()
    with pytest.raises(
        ValueError,
        match=rf"width {HIDDEN_SIZE} != spec_hidden_size "
        rf"{2 * HIDDEN_SIZE}",
    ):
        write(buffers, row, room=3, width=HIDDEN_SIZE)
    assert not buffers.row_landed(row, 3)


def test_spec_hidden_size_wider_than_hidden_size_works() -> None:
    width = 2 * HIDDEN_SIZE  # hc_mult = 2: the residual stream is twice hidden_size
    buffers = make(spec_hidden_size=width)
    row = buffers.allocate()
    hidden = torch.linspace(-1, 1, width)
    buffers.write_row(row, room=5, output_id=1, output_logprob=0.0, hidden_state=hidden)
    assert buffers.hidden_states.shape == (3, width)
    assert torch.equal(buffers.hidden_states[row], hidden.to(torch.bfloat16))
    assert buffers.row_landed(row, 5)


def test_room_zero_and_wrong_topk_width_are_rejected() -> None:
    buffers = make()
    row = buffers.allocate()
    with pytest.raises(ValueError, match="room 0 marks a free row"):
        write(buffers, row, room=0)
    with pytest.raises(ValueError, match="topk_index has 3 values, expected"):
        buffers.write_row(
            row,
            room=1,
            output_id=1,
            output_logprob=0.0,
            hidden_state=torch.ones(HIDDEN_SIZE),
            topk_index=torch.tensor([1, 2, 3]),
        )


def test_every_field_is_a_view_of_one_row_slice_with_room_last() -> None:
    buffers = MetadataBuffers(3, 7, 3, 2, torch.float16, "cpu", boundary_width=5)  # odd widths
    row = buffers.allocate()
    start = buffers.row_bytes(row).data_ptr()
    assert buffers.row_bytes(row).shape == (buffers.row_nbytes,)
    assert buffers.row_bytes(row).is_contiguous()
    tensors = buffers.row_tensors(row)
    offsets = [t.data_ptr() - start for t in tensors]
    ends = [o + t.numel() * t.element_size() for o, t in zip(offsets, tensors)]
    # In FIELDS order (room last), without overlaps, each aligned for its dtype, inside the row.
    assert offsets[0] == 0 and all(end <= o for end, o in zip(ends, offsets[1:]))
    assert all(o % 16 == 0 for o in offsets) and ends[-1] <= buffers.row_nbytes
    buffers.row_bytes(row).fill_(0)
    write(buffers, row, room=21)
    assert buffers.row_bytes(row).any()  # write_row wrote into the row's bytes


def test_a_row_copied_as_one_byte_slice_lands_every_field() -> None:
    def make_wide() -> MetadataBuffers:
        return MetadataBuffers(4, 7, 3, 2, torch.float32, "cpu", boundary_width=5)

    source, target = make_wide(), make_wide()
    row = source.allocate()
    boundary = torch.arange(10, dtype=torch.float32).view(2, 5)
    source.write_row(
        row,
        room=31,
        output_id=4,
        output_logprob=-0.75,
        hidden_state=torch.linspace(0, 1, 7),
        topk_index=torch.arange(6),
        topk_p=torch.full((6,), 0.125),
        boundary_hidden=boundary,
        cached_tokens=3,
    )
    landed = 2  # another row number on the receiving side
    target.row_bytes(landed).copy_(source.row_bytes(row))
    assert target.row_landed(landed, 31)
    for got, sent in zip(target.row_tensors(landed), source.row_tensors(row)):
        assert torch.equal(got, sent)
    assert torch.equal(target.boundary_hidden[landed], boundary)
    assert not target.row_landed(landed - 1, 31)  # the neighbouring rows are untouched
