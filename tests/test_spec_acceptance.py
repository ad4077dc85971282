"""The acceptance rule (spec.runtime.acceptance.accept) against a brute-force definition of it, on
random trees and chains: of all paths from the root, the longest whose every node carries the
target's choice at its parent's row and is the first of its siblings (in node order) to carry
it; the committed tokens are the path's, then the target's choice at its last row. The trees
have siblings with equal tokens and nodes off the accepted path that match their parent's
target too, so the rule's every clause is exercised. The batched forms the engine's paths
use (`accept_on_host`, `chain_verdicts`) give the same verdicts."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from spec.runtime.acceptance import accept, accept_on_host, chain_verdicts
from spec.runtime.tree import DraftTree

VOCAB = 3  # few tokens: siblings repeat one another and many nodes match


def _brute_force(tree: DraftTree, targets: list[int]) -> tuple[list[int], list[int]]:
    """The accepted nodes (level 1 first) and the committed tokens, by checking every path."""

    def first_match(node: int) -> bool:
        parent = tree.parents[node]
        wanted = targets[parent + 1]
        siblings = [s for s in range(len(tree)) if tree.parents[s] == parent]
        return (
            tree.tokens[node] == wanted
            and min(s for s in siblings if tree.tokens[s] == wanted) == node
        )

    best: list[int] = []
    for node in range(len(tree)):
        path = []
        at = node
        while at >= 0:
            path.append(at)
            at = tree.parents[at]
        path.reverse()
        if all(first_match(n) for n in path) and len(path) > len(best):
            best = path
    last_row = best[-1] + 1 if best else 0
    return best, [tree.tokens[n] for n in best] + [targets[last_row]]


def _random_tree(rng: random.Random, size: int, chain: bool) -> DraftTree:
    if chain:
        return DraftTree.chain([rng.randrange(VOCAB) for _ in range(size)])
    parents = [rng.randrange(-1, i) for i in range(size)]
    return DraftTree([rng.randrange(VOCAB) for _ in range(size)], parents)


def _random_targets(rng: random.Random, tree: DraftTree) -> list[int]:
    """Random choices, but down a random path the target agrees with each level's node with
    probability 0.7: long accepted paths are common."""
    targets = [rng.randrange(VOCAB) for _ in range(len(tree) + 1)]
    kids, row = tree.children(), 0
    while kids[row] and rng.random() < 0.7:
        node = rng.choice(kids[row])
        targets[row] = tree.tokens[node]
        row = node + 1
    return targets


def _case(seed: int, chain: bool) -> tuple[list[DraftTree], list[list[int]]]:
    rng = random.Random(seed)
    trees = [_random_tree(rng, rng.randrange(0, 12), chain) for _ in range(64)]
    return trees, [_random_targets(rng, tree) for tree in trees]


@pytest.mark.parametrize("chain", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_accept_is_the_brute_force_rule(seed: int, chain: bool) -> None:
    """Trees of 0 to 11 nodes padded to one width (parents -2), one call: each tree's count,
    path rows and committed tokens (`targets.gather(1, path)`) are the brute force's, and the
    path is 0 past the accepted nodes."""
    trees, targets = _case(seed, chain)
    width = max(len(t) for t in trees)
    depth = max(t.depth for t in trees)
    tokens = torch.full((len(trees), width), -2)
    parents = torch.full((len(trees), width), -2)
    rows = torch.full((len(trees), width + 1), -1)
    for i, (tree, chosen) in enumerate(zip(trees, targets)):
        tokens[i, : len(tree)] = torch.tensor(tree.tokens, dtype=torch.int64)
        parents[i, : len(tree)] = torch.tensor(tree.parents, dtype=torch.int64)
        rows[i, : len(chosen)] = torch.tensor(chosen)
    accepted, path = accept(rows, tokens, parents, depth)
    assert path.shape == (len(trees), depth + 1)
    committed = rows.gather(1, path)
    lengths = set()
    for i, (tree, chosen) in enumerate(zip(trees, targets)):
        nodes, expected_tokens = _brute_force(tree, chosen)
        a = len(nodes)
        lengths.add(a)
        assert int(accepted[i]) == a
        assert path[i].tolist() == [0] + [n + 1 for n in nodes] + [0] * (depth - a)
        assert committed[i, : a + 1].tolist() == expected_tokens
    assert {0, 1, 2, 3} <= lengths  # no accepted path, and paths of several nodes


@pytest.mark.parametrize("chain", [False, True])
def test_accept_on_host_gives_the_brute_force_verdicts(chain: bool) -> None:
    trees, targets = _case(10 + chain, chain)
    for tree, chosen, verdict in zip(trees, targets, accept_on_host(trees, targets)):
        nodes, tokens = _brute_force(tree, chosen)
        assert (verdict.path, verdict.tokens, verdict.num_accepted) == (nodes, tokens, len(nodes))


def test_the_first_matching_sibling_is_followed() -> None:
    """Root -> a(7), b(7); b -> c(5). The target chose 7 at the root and 5 after it: a is
    taken, and a has no child, though b's child would have matched."""
    tree = DraftTree([7, 7, 5], [-1, -1, 1])
    (verdict,) = accept_on_host([tree], [[7, 5, 5, 0]])
    assert (verdict.path, verdict.tokens) == ([0], [7, 5])


def _walked(logits: torch.Tensor, ids: torch.Tensor, width: int) -> list[list[int]]:
    """Per span: the argmax at each token, then the drafts accepted walking the chain."""
    rows = []
    for first in range(0, logits.shape[0] - width + 1, width):
        targets = logits[first : first + width].argmax(dim=-1).tolist()
        drafts = ids[first + 1 : first + width].tolist()
        accepted = 0
        while accepted < width - 1 and drafts[accepted] == targets[accepted]:
            accepted += 1
        rows.append([*targets, accepted])
    return rows


@pytest.mark.parametrize("width", [1, 2, 4, 6])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_chain_verdicts_follow_each_chain_until_a_draft_differs(width: int, extra: int) -> None:
    """Spans of `width` tokens (the newest, then its drafts), every accept count from none to
    all drafts; `extra` trailing tokens (a graph's padding) that make no whole span are left
    out."""
    rng = np.random.default_rng(width * 10 + extra)
    n, vocab = 9, 11
    logits = torch.from_numpy(rng.normal(size=(n * width + extra, vocab))).float()
    ids = torch.from_numpy(rng.integers(0, vocab, size=n * width + extra))
    targets = logits.argmax(dim=-1)
    for i in range(n):
        accept_count = i % width  # 0 .. width - 1 drafts accepted
        first = i * width
        ids[first + 1 : first + 1 + accept_count] = targets[first : first + accept_count]
        if accept_count < width - 1:  # the next draft differs from the target
            ids[first + 1 + accept_count] = (targets[first + accept_count] + 1) % vocab
    verdicts = chain_verdicts(logits, ids, width)
    assert verdicts.tolist() == _walked(logits, ids, width)
    assert verdicts[:n, width].tolist() == [i % width for i in range(n)]
    # The chain's shortcut is `accept` over a tree whose node i's parent is node i - 1.
    used = n * width
    chains = ids[:used].view(n, width)[:, 1:]
    parents = torch.arange(-1, width - 2).expand(n, -1)
    accepted, _ = accept(verdicts[:n, :width], chains, parents, width - 1)
    assert accepted.tolist() == verdicts[:n, width].tolist()
