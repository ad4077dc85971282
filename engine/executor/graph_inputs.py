"""What a captured forward reads: the layout of a graph set's static input buffer, the batch
sizes and token counts captured, and the buffer's columns for a batch padded to a captured
size (engine.executor.cuda_graph fills the buffer from them and replays).

Padded tokens read token 0 at position 0, each as a request of its own over the request
table's padding row, and write their K and V to the padding slot, which no request owns."""

from __future__ import annotations

import numpy as np

from engine.executor.forward_batch import Span, tree_bits
from engine.scheduling.allocator import PADDING_SLOT

# The static input buffer: three rows of per-token values, then five of per-request values,
# then for graphs of token trees each token's visibility mask (ForwardBatch.tree_bits).
IDS, POSITIONS, SLOTS = range(3)
ROWS, SEQ_LENS, Q_STARTS, Q_LENS, LAST = range(5)
NUM_ROWS = 8
TREE_BITS = 8


def batch_size_buckets(max_batch_size: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, every 8 to 64, every 16 to 256, every 32 beyond,
    and `max_batch_size` itself, none above it."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 257, 16)]
    sizes += range(288, max_batch_size + 1, 32)
    return sorted({s for s in sizes if s < max_batch_size} | {max_batch_size})


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts captured for spans longer than one token: 8, 16, 32, 48, 64, 96, 128, ...
    (each power of two and one and a half times it), and `max_tokens` itself, none above it."""
    sizes = {8, 16}
    power = 32
    while power < max_tokens:
        sizes.update((power, power * 3 // 2))
        power *= 2
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


def bucket_for(buckets: list[int], batch_size: int) -> int | None:
    """The smallest bucket that holds `batch_size`, or None above the largest."""
    for size in buckets:
        if size >= batch_size:
            return size
    return None


def padded_columns(
    size: int, spans: list[Span], padding_row: int, trees: bool = False
) -> list[list[int]]:
    """A graph's eight input rows over `size` columns: per token its id, position and KV slot;
    per request its row, length, first token, number of tokens and last token; with `trees`,
    a ninth of each token's visibility mask (-1, causal, for padding). The spans come first,
    then one padding request per remaining token (token 0 at position 0, writing the padding
    slot, over the padding row), then requests of no token, which attention skips."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    rows, seq_lens, starts, lens = [], [], [], []
    for span in spans:
        rows.append(span.row)
        seq_lens.append(span.start + len(span.token_ids))
        starts.append(len(ids))
        lens.append(len(span.token_ids))
        ids += span.token_ids
        if span.positions is None:
            positions += range(span.start, span.start + len(span.token_ids))
        else:
            positions += span.positions
        slots += span.slots
    padding = size - len(ids)
    assert padding >= 0, f"{len(ids)} tokens in a graph of {size}"
    rows += [padding_row] * padding
    seq_lens += [1] * padding
    starts += range(len(ids), size)
    lens += [1] * padding
    ids += [0] * padding
    positions += [0] * padding
    slots += [PADDING_SLOT] * padding
    empty = size - len(rows)
    rows += [padding_row] * empty
    seq_lens += [1] * empty
    starts += [0] * empty
    lens += [0] * empty
    lasts = [start + max(n, 1) - 1 for start, n in zip(starts, lens)]
    columns = [ids, positions, slots, rows, seq_lens, starts, lens, lasts]
    if trees:
        columns.append(tree_bits(spans) + [-1] * padding)
    return columns


def uniform_columns(
    size: int,
    rows: np.ndarray,
    starts: np.ndarray,
    tokens: np.ndarray,
    slots: np.ndarray,
    padding_row: int,
) -> np.ndarray:
    """`padded_columns` of spans that all bring the same number of tokens, from arrays: request
    i's span starts at `starts[i]` in row `rows[i]` with `tokens[i]` [width] writing `slots[i]`
    [width]. A speculative round's verify: no walk over its requests in Python."""
    n, width = tokens.shape
    used = n * width
    assert used <= size, f"{used} tokens in a graph of {size}"
    padding = size - used
    columns = np.zeros((NUM_ROWS, size), dtype=np.int64)
    columns[IDS, :used] = tokens.ravel()
    columns[POSITIONS, :used] = (starts[:, None] + np.arange(width)).ravel()
    columns[SLOTS, :used] = slots.ravel()
    columns[SLOTS, used:] = PADDING_SLOT
    reqs = columns[3:]
    reqs[ROWS, :n] = rows
    reqs[ROWS, n:] = padding_row
    reqs[SEQ_LENS, :n] = starts + width
    reqs[SEQ_LENS, n:] = 1
    reqs[Q_STARTS, :n] = np.arange(0, used, width)
    reqs[Q_STARTS, n : n + padding] = np.arange(used, size)
    reqs[Q_LENS, :n] = width
    reqs[Q_LENS, n : n + padding] = 1
    reqs[LAST] = reqs[Q_STARTS] + np.maximum(reqs[Q_LENS], 1) - 1
    return columns
