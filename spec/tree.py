"""The draft token tree: its shape and its nodes (spec/acceptance.py verifies it).

A draft extend grows each request's tree level by level (spec/tree_extender.py): depth 0
proposes the root's likeliest tokens, and at each deeper level the draft's greedy node and the
`beam_width - 1` best other nodes by cumulative draft log-probability are run through the next
depth, each proposing its `node_width` likeliest children. The `budget` best nodes of all those
proposed are verified in one target forward, each node seeing the cached prefix, its ancestors
and itself (a tree attention mask); the longest path the target agrees with is kept.

Chains are trees too: one chain is (1, 1, 1, K), and N chains that start with depth 0's N
likeliest tokens and go on greedily are (N, 1, N, N * K)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.config import MAX_DRAFT_TREE_TOKENS, EngineConfig


@dataclass(frozen=True)
class TreeShape:
    root_width: int  # the root's children: depth 0's likeliest tokens
    node_width: int  # children proposed by each node expanded at a deeper level
    beam_width: int  # nodes expanded per level, the draft's greedy path's among them
    budget: int  # nodes verified

    def __post_init__(self) -> None:
        for name in ("root_width", "node_width", "beam_width", "budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"draft tree {name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def chains(cls, num_chains: int, depth: int) -> TreeShape:
        return cls(num_chains, 1, num_chains, num_chains * depth)

    @classmethod
    def top_k(cls, k: int, budget: int) -> TreeShape:
        """SGLang's `--speculative-eagle-topk k --speculative-num-draft-tokens budget`."""
        return cls(k, k, k, budget)

    @property
    def is_chain(self) -> bool:
        return self.root_width == 1 and self.node_width == 1

    def width_at(self, depth: int) -> int:
        """Tokens proposed at each expanded node by draft depth `depth`."""
        return self.root_width if depth == 0 else self.node_width


@dataclass
class DraftTree:
    """Nodes 0..N-1, parents before children (`parents[i] < i`, -1: the root, which is the
    newest committed token and no node). A verify span is the root then the nodes, so node i is
    span row i + 1."""

    tokens: list[int]
    parents: list[int]
    levels: list[int] = field(default_factory=list)  # the root's children are level 1

    def __post_init__(self) -> None:
        if not self.levels:
            for i, parent in enumerate(self.parents):
                assert parent < i, "parents come before their children"
                self.levels.append(self.levels[parent] + 1 if parent >= 0 else 1)

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), list(range(1, len(tokens) + 1)))

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))

    @property
    def depth(self) -> int:
        return max(self.levels, default=0)

    def pruned(self, max_level: int, max_nodes: int) -> DraftTree:
        """The nodes of level <= max_level, the first max_nodes of them: a tree still, since
        a node's ancestors come before it and are no deeper."""
        keep = [i for i in range(len(self.tokens)) if self.levels[i] <= max_level][:max_nodes]
        if len(keep) == len(self.tokens):
            return self
        new_index = {old: new for new, old in enumerate(keep)}
        return DraftTree(
            [self.tokens[i] for i in keep],
            [new_index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep],
            [self.levels[i] for i in keep],
        )

    def visible(self) -> list[int]:
        """Per span row (the root, then each node), the span rows it attends as a bitmask:
        itself, its ancestors and the root."""
        masks = [1]
        for i, parent in enumerate(self.parents):
            masks.append(masks[parent + 1] | (1 << (i + 1)))
        return masks

    def positions(self, root_position: int) -> list[int]:
        return [root_position] + [root_position + level for level in self.levels]

    def children(self) -> list[list[int]]:
        """Per span row, its children's node indices in node order."""
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, parent in enumerate(self.parents):
            kids[parent + 1].append(i)
        return kids

    def path(self, node: int) -> list[int]:
        """The tokens from level 1 down to `node`."""
        tokens = []
        while node >= 0:
            tokens.append(self.tokens[node])
            node = self.parents[node]
        return tokens[::-1]

    def row_drafts(self) -> list[list[int]]:
        """Per span row, the drafts that precede the token it predicts."""
        return [[]] + [self.path(i) for i in range(len(self.tokens))]


@dataclass
class Candidate:
    token: int
    parent: int  # a candidate's index, -1: the root
    level: int
    score: float  # cumulative draft log-probability


def select_tree(candidates: list[Candidate], budget: int) -> DraftTree:
    """The `budget` candidates of highest score, as a tree. A child's score is its parent's
    plus a log-probability, never above it, so the choice keeps every chosen node's ancestors;
    ordering ties by level puts a parent first."""
    order = sorted(
        range(len(candidates)), key=lambda i: (-candidates[i].score, candidates[i].level)
    )
    chosen = order[:budget]
    chosen.sort(key=lambda i: (candidates[i].level, -candidates[i].score))
    new_index = {old: new for new, old in enumerate(chosen)}
    tokens, parents, levels = [], [], []
    for i in chosen:
        cand = candidates[i]
        assert cand.parent < 0 or cand.parent in new_index, "a chosen node's parent is chosen"
        tokens.append(cand.token)
        parents.append(new_index[cand.parent] if cand.parent >= 0 else -1)
        levels.append(cand.level)
    return DraftTree(tokens, parents, levels)


def log_prob(p: float) -> float:
    return math.log(p) if p > 0 else -math.inf


def tree_shape(config: EngineConfig, num_draft_steps: int) -> TreeShape:
    """The draft tree an engine's config asks for: `speculative_topk` k > 1 gives SGLang's
    top-k tree of `num_draft_tokens` nodes, `num_draft_chains` N > 1 N chains."""
    if config.speculative_topk > 1:
        default = min(config.speculative_topk * num_draft_steps, MAX_DRAFT_TREE_TOKENS)
        return TreeShape.top_k(config.speculative_topk, config.num_draft_tokens or default)
    nodes = config.num_draft_chains * num_draft_steps
    if nodes > MAX_DRAFT_TREE_TOKENS:
        raise ValueError(
            f"{config.num_draft_chains} draft chains of {num_draft_steps} drafts are {nodes} "
            f"tokens a step; at most {MAX_DRAFT_TREE_TOKENS} are verified at once"
        )
    return TreeShape.chains(config.num_draft_chains, num_draft_steps)
