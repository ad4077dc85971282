"""The draft tree's own rules (spec/runtime/tree.py, spec/runtime/acceptance.py): the attention mask
of its nodes against the ancestors found by brute force, the choice of the budget's nodes, and
acceptance: the longest path the target agrees with (greedy), and tree speculative sampling, whose
committed tokens are distributed as the target's."""

from __future__ import annotations

import math
import random
from collections import Counter

import torch
from test_spec_sampling import chi_square_p_value

from engine import SamplingParams
from engine.sampling.sampler import filtered_probs
from spec.runtime.acceptance import Verdict, accept_on_host
from spec.runtime.tree import DraftTree, TreeGrowth, TreeShape


def accept_tree(tree: DraftTree, targets: list[int]) -> Verdict:
    return accept_on_host([tree], [targets])[0]


def _random_tree(rng: random.Random, size: int) -> DraftTree:
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, size)]
    return DraftTree([rng.randrange(100) for _ in range(size)], parents)


def _ancestors(parents: list[int], node: int) -> set[int]:
    found = set()
    while node >= 0:
        found.add(node)
        node = parents[node]
    return found


def test_each_node_sees_exactly_its_ancestors_the_root_and_itself() -> None:
    rng = random.Random(0)
    for size in [1, 2, 5, 17, 40, 61]:
        tree = _random_tree(rng, size)
        masks = tree.visible()
        assert masks[0] == 1  # the root sees itself only (and the cache before it)
        for node in range(size):
            rows = {0} | {a + 1 for a in _ancestors(tree.parents, node)}
            seen = {r for r in range(size + 1) if masks[node + 1] >> r & 1}
            assert seen == rows
            assert tree.levels[node] == len(_ancestors(tree.parents, node))
        assert tree.positions(50)[1:] == [50 + level for level in tree.levels]


def test_a_cut_tree_keeps_every_kept_node_s_ancestors() -> None:
    rng = random.Random(1)
    for _ in range(50):
        tree = _random_tree(rng, 20)
        max_level, max_nodes = rng.randint(1, 5), rng.randint(1, 20)
        cut = tree.pruned(max_level, max_nodes)
        assert all(level <= max_level for level in cut.levels) and len(cut) <= max_nodes
        assert len(cut) == min(max_nodes, sum(level <= max_level for level in tree.levels))
        for node in range(len(cut)):
            assert cut.parents[node] < node
            # The kept node's path is the same tokens as in the whole tree.
            assert cut.path(node) in [tree.path(n) for n in range(len(tree))]


def test_growth_expands_the_best_nodes_and_keeps_the_budget_s_best() -> None:
    """Random proposals over three depths of top-3 trees, two trees at once, against a
    brute force over every candidate: each depth expands its level's greedy child (the first)
    and the beam_width - 1 best others by score (the path's summed log-probabilities); the
    tree is the budget's best candidates (ties: the shallower, then the earlier), ordered by
    level then score, each node's parent the candidate's."""
    shape, k, size = TreeShape.top_k(3, 10), 3, 2
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        growth = TreeGrowth(shape, k, size, "cpu")
        # Per tree its candidates (token, parent candidate, level, score), and the expanded.
        candidates: list[list[tuple[int, int, int, float]]] = [[] for _ in range(size)]
        expanded = [[-1] for _ in range(size)]
        for d in range(k):
            width, count = shape.width_at(d), len(expanded[0])
            top = torch.randperm(500, generator=generator)[: size * count * width]
            top = top.view(size, count, width)
            probs = torch.rand(size, count, width, generator=generator)
            probs = probs.sort(-1, descending=True).values
            growth.add_level(d, top, probs)
            for t, cands in enumerate(candidates):
                first = len(cands)
                for e, parent in enumerate(expanded[t]):
                    base = cands[parent][3] if parent >= 0 else 0.0
                    for c in range(width):
                        score = base + math.log(float(probs[t, e, c]))
                        cands.append((int(top[t, e, c]), parent, d + 1, score))
                if d + 1 < k:
                    others = sorted(range(first + 1, len(cands)), key=lambda n: -cands[n][3])
                    expanded[t] = [first] + others[: shape.beam_width - 1]
                    assert growth.beam_candidate[t].tolist() == expanded[t]
        selected = growth.select().long().tolist()
        for cands, values in zip(candidates, selected):
            best = sorted(range(len(cands)), key=lambda n: (-cands[n][3], cands[n][2], n))
            order = sorted(best[: shape.budget], key=lambda n: (cands[n][2], -cands[n][3]))
            node_of = {old: new for new, old in enumerate(order)}
            tokens = [cands[n][0] for n in order]
            parents = [node_of[cands[n][1]] if cands[n][1] >= 0 else -1 for n in order]
            assert values == tokens + parents + [cands[n][2] for n in order]
            assert all(parent < i for i, parent in enumerate(parents))


def test_chain_shapes_are_trees() -> None:
    assert TreeShape.chains(1, 3).is_chain
    assert TreeShape.chains(4, 3) == TreeShape(4, 1, 4, 12)
    assert not TreeShape.top_k(4, 8).is_chain
    assert DraftTree.chain([5, 6, 7]).is_chain
    assert DraftTree.chain([5, 6, 7]).visible() == [1, 3, 7, 15]


# Root -> a(0), b(1); a -> c(2), d(3); b -> e(4); d -> f(5).
TREE = DraftTree([10, 11, 12, 13, 14, 15], [-1, -1, 0, 0, 1, 3])


def test_greedy_follows_the_target_s_choices_down_the_tree() -> None:
    targets = [0] * 7
    targets[0], targets[1], targets[4], targets[6] = 10, 13, 15, 99  # root, a, d, f
    verdict = accept_tree(TREE, targets)
    assert (verdict.tokens, verdict.num_accepted, verdict.path) == ([10, 13, 15, 99], 3, [0, 3, 5])
    targets[0] = 11  # b, then b's row wants 77: no child
    targets[2] = 77
    verdict = accept_tree(TREE, targets)
    assert (verdict.tokens, verdict.path) == ([11, 77], [1])
    targets[0] = 42
    assert accept_tree(TREE, targets).tokens == [42]


def _tree_and_probs() -> tuple[DraftTree, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 16, generator=generator) * 1.5
    params = SamplingParams(temperature=1.0)
    probs = torch.stack([filtered_probs(row, params) for row in logits])
    # The root's children are the target's two likeliest tokens: a rule that favours or
    # shortchanges children then shifts the output a lot.
    first_two = probs[0].topk(2).indices.tolist()
    return DraftTree([*first_two, 3, 4, 5, 6], TREE.parents), probs


def _rule_samples(rule, draws: int) -> tuple[torch.Tensor, torch.Tensor, Counter, Counter]:
    """The first two committed tokens of `draws` verifies: rule(tree, probs, generator)."""
    tree, probs = _tree_and_probs()
    generator = torch.Generator().manual_seed(1)
    first: Counter = Counter()
    second: Counter = Counter()
    for _ in range(draws):
        tokens = rule(tree, probs, generator).tokens
        first[tokens[0]] += 1
        if tokens[0] == tree.tokens[0]:
            second[tokens[1]] += 1
    return probs[0], probs[1], first, second


def _draw_every_row(tree, probs, generator):
    """What the engine does: every row draws from its own distribution, then the walk."""
    targets = [int(torch.multinomial(row, 1, generator=generator)) for row in probs]
    return accept_tree(tree, targets)


def test_tree_sampling_commits_tokens_distributed_as_the_target() -> None:
    """The first token ~ p at the root, whichever children the root has; after the first
    child was accepted, the second ~ p at that child's row."""
    draws = 8000
    p0, p_a, first, second = _rule_samples(_draw_every_row, draws)
    assert chi_square_p_value(first, dict(enumerate(p0.tolist())), draws) > 1e-3
    n = sum(second.values())
    assert chi_square_p_value(second, dict(enumerate(p_a.tolist())), n) > 1e-3


def _second_chance(tree, probs, generator):
    """A tempting mistake: when the root's draw is no child, draw again and take a child if
    that draw is one, which gives children more than their share."""
    verdict = _draw_every_row(tree, probs, generator)
    if not verdict.path:
        again = int(torch.multinomial(probs[0], 1, generator=generator))
        child = next((n for n in tree.children()[0] if tree.tokens[n] == again), None)
        if child is not None:
            return Verdict([again, int(probs[child + 1].argmax())], 1, [child])
    return verdict


def test_the_check_catches_a_rule_that_favours_children() -> None:
    draws = 8000
    p0, _, first, _ = _rule_samples(_second_chance, draws)
    assert chi_square_p_value(first, dict(enumerate(p0.tolist())), draws) < 1e-6
