"""The Triton kernel that decides a round of draft trees (engine/kernels/tree_accept.py), a
fast implementation of the acceptance rule, against its torch reference
(spec.runtime.acceptance.accept, the committed tokens along its path,
spec.runtime.tree_round.keep_accepted_kv): the same paths, verdicts and KV moves, for trees from one
node to 62 (the most a visibility mask holds), 1 to 8 levels deep, siblings with distinct tokens (as
the engine grows them) or repeated ones, and paths of every length."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.scheduling.kv_pool import KVPool, ReqToTokenPool
from spec.runtime.acceptance import accept
from spec.runtime.tree_round import keep_accepted_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _tree(rng: np.random.Generator, count: int, depth: int, repeated: bool):
    """Nodes ordered by level, no level skipped, siblings with distinct tokens (as every tree
    the engine grows), or with `repeated` tokens of a few values, siblings' among them."""
    levels = np.sort(rng.integers(1, depth + 1, size=count))
    levels[0] = 1
    for i in range(1, count):
        levels[i] = min(levels[i], levels[i - 1] + 1)
    parents = [
        -1 if lv == 1 else int(rng.choice([j for j in range(i) if levels[j] == lv - 1]))
        for i, lv in enumerate(levels)
    ]
    tokens = rng.choice(np.arange(3, 6 if repeated else 1000), size=count, replace=repeated)
    return tokens, np.array(parents), levels


def _targets(rng: np.random.Generator, tokens, parents, stop: float) -> np.ndarray:
    """The argmax at the root and each node: down a random path, each level's node matched
    with probability 1 - stop; elsewhere tokens no node carries."""
    count = len(tokens)
    targets = rng.integers(1000, 2000, size=count + 1)
    row = 0  # span row of the current node (0: the root)
    while rng.random() > stop:
        children = [c for c in range(count) if parents[c] == row - 1]
        if not children:
            break
        child = int(rng.choice(children))
        targets[row] = tokens[child]
        row = child + 1
    return targets


@pytest.mark.parametrize("count,k", [(1, 1), (8, 3), (24, 3), (24, 5), (62, 8)])
@pytest.mark.parametrize("stop", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("nodes_from", ["host", "block"])
@pytest.mark.parametrize("repeated", [False, True])
@torch.inference_mode()
def test_the_kernel_decides_trees_as_the_reference_does(
    count: int, k: int, stop: float, nodes_from: str, repeated: bool
) -> None:
    """`nodes_from`: an int64 tensor of their own (copied from the host), or float64 columns
    of a wider block, as the extend that grew the trees leaves them on the device."""
    rng = np.random.default_rng(count * 10 + k)
    n, context, device = 9, 160, "cuda"
    pool = KVPool(n * context + 8, 30, 3, 64, torch.bfloat16, device)  # rows of 11,520
    table = ReqToTokenPool(n, context, device)
    slots = torch.randperm(n * context, device=device)[: n * context].view(n, context) + 1
    table.req_to_token[:n] = slots
    pool.kv_buffer.normal_()
    trees = [_tree(rng, count, k, repeated) for _ in range(n)]
    targets = np.stack([_targets(rng, t, p, stop) for t, p, _ in trees])
    nodes = np.stack([np.concatenate(tree) for tree in trees])
    rows = rng.permutation(n)
    newest = rng.integers(0, context - count - 2, size=n)
    on = {
        name: torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device)
        for name, a in dict(targets=targets, nodes=nodes, rows=rows, newest=newest).items()
    }
    before = pool.kv_buffer.clone()

    tokens, parents, _ = on["nodes"].view(n, 3, count).unbind(1)
    accepted, path = accept(on["targets"], tokens, parents, k)
    committed = on["targets"].gather(1, path)
    keep_accepted_kv(pool, table.req_to_token, on["rows"], on["newest"], path, accepted)
    expected_kv = pool.kv_buffer.clone()

    from engine.kernels.tree_accept import accept_trees

    pool.kv_buffer.copy_(before)
    nodes_in = on["nodes"]
    if nodes_from == "block":  # the chains (2K columns) before them, the verdicts after
        block = torch.full((n, 2 * k + 3 * count + k + 2), -7.0, dtype=torch.float64)
        block[:, 2 * k : 2 * k + 3 * count] = torch.from_numpy(nodes.astype(np.float64))
        nodes_in = block.to(device)[:, 2 * k : 2 * k + 3 * count]
    decided = accept_trees(
        on["targets"], nodes_in, on["rows"], on["newest"], table.req_to_token,
        pool.kv_buffer, k,
    )  # fmt: skip
    assert torch.equal(decided[:, : k + 1], path)
    assert torch.equal(decided[:, k + 1 : 2 * k + 2], committed)
    assert torch.equal(decided[:, 2 * k + 2], accepted)
    assert torch.equal(pool.kv_buffer, expected_kv)
    if stop == 0.0 and k >= 2:  # some request accepted a path of several nodes
        assert int(accepted.max()) >= 2
