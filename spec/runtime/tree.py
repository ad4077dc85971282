"""The draft token tree: its shape, its nodes, and the rule that grows it (`TreeGrowth`);
spec/runtime/acceptance.py verifies it.

A draft extend grows each request's tree level by level (the general extend,
spec/runtime/tree_extender.py, and the fixed-shape one on the device, spec/runtime/device_tree.py,
by one rule: `TreeGrowth`): depth 0 proposes the root's likeliest tokens, and at each deeper level
the draft's greedy node and the `beam_width - 1` best other nodes by cumulative draft
log-probability are run through the next depth, each proposing its `node_width` likeliest
children. The `budget` best nodes of all those proposed are verified in one target forward,
each node seeing the cached prefix, its ancestors and itself (a tree attention mask); the
longest path the target agrees with is kept.

Chains are trees too: one chain is (1, 1, 1, K), and N chains that start with depth 0's N
likeliest tokens and go on greedily are (N, 1, N, N * K)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.speculative_options import MAX_DRAFT_TREE_TOKENS


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


# Scores are sums of log-probabilities; a probability that underflowed to 0 counts as this,
# so that a child never scores above its parent and no score is -inf (ties with -inf would
# let a child rank before its parent).
_MIN_PROB = 1e-30


class TreeGrowth:
    """The rule that grows a batch of `size` draft trees of `shape` over `k` depths, for the
    fixed-shape extend on the device (spec/runtime/device_tree.py) and the general extend
    (spec/runtime/tree_extender.py) alike: every candidate proposed so far, with its score (its
    path's draft log-probabilities summed, in float32), and the nodes the next depth expands (their
    candidate index, score and path). Candidates are numbered in the order they are proposed,
    level by level. Tensor operations of fixed shape: it runs inside a CUDA graph's replay."""

    def __init__(self, shape: TreeShape, k: int, size: int, device) -> None:
        self.shape = shape
        self.k = k
        self.tokens: list[torch.Tensor] = []  # per level [size, L]
        self.parents: list[torch.Tensor] = []  # candidate index, -1: the root
        self.scores: list[torch.Tensor] = []
        self.num_candidates = 0
        self.beam_candidate = torch.full((size, 1), -1, dtype=torch.int64, device=device)
        self.beam_score = torch.zeros((size, 1), dtype=torch.float32, device=device)
        self.beam_paths = torch.zeros((size, 1, 0), dtype=torch.int64, device=device)
        self.parent_beam: torch.Tensor | None = None  # [size, forks]: each fork's parent node

    def add_level(self, d: int, top: torch.Tensor, top_p: torch.Tensor) -> None:
        """Depth d's proposals, [size, expanded, width] ids and probabilities, by the first
        `expanded` nodes chosen to expand (node 0 the greedy one; the general extend expands
        the greedy node alone where it lacks the room for the others): candidates of level
        d+1, and the nodes the next depth expands, the greedy child (the chain's next draft)
        and the `beam_width - 1` best others by score."""
        size, expanded, width = top.shape
        beam_score = self.beam_score[:, :expanded, None]
        scores = beam_score + torch.log(top_p.float().clamp_min(_MIN_PROB))
        scores = scores.reshape(size, expanded * width)
        tokens = top.reshape(size, expanded * width)
        self.tokens.append(tokens)
        self.scores.append(scores)
        # Each expanded node's candidate index, once for each of its children (no
        # repeat_interleave: it waits for the device to size its output, which a graph forbids).
        parents = self.beam_candidate[:, :expanded, None].expand(size, expanded, width)
        self.parents.append(parents.reshape(size, expanded * width))
        first = self.num_candidates
        self.num_candidates += expanded * width
        if d + 1 >= self.k:
            return
        forks = min(self.shape.beam_width, expanded * width) - 1
        chosen = torch.zeros((size, 1), dtype=torch.int64, device=top.device)
        if forks:
            # The greedy child (column 0) is expanded anyway. A stable sort, not top-k: equal
            # scores keep candidate order.
            best = scores[:, 1:].sort(dim=1, descending=True, stable=True).indices[:, :forks]
            chosen = torch.cat([chosen, best + 1], dim=1)
        parent = chosen // width
        self.parent_beam = parent[:, 1:]
        self.beam_score = scores.gather(1, chosen)
        self.beam_candidate = first + chosen
        paths = self.beam_paths[:, :expanded].gather(1, parent[:, :, None].expand(-1, -1, d))
        self.beam_paths = torch.cat([paths, tokens.gather(1, chosen)[:, :, None]], dim=2)

    def select(self) -> torch.Tensor:
        """The `budget` candidates of highest score as trees, [size, 3 * budget] float64:
        tokens, parents (node indices, -1: the root) and levels, nodes ordered by level then
        score. A child's score is its parent's plus a log-probability, never above it, so the
        choice keeps every chosen node's ancestors; ordering ties by level puts a parent
        first."""
        tokens = torch.cat(self.tokens, dim=1)
        parents = torch.cat(self.parents, dim=1)
        scores = torch.cat(self.scores, dim=1).double()
        size, count = scores.shape
        budget = min(self.shape.budget, count)
        levels = torch.cat(
            [
                torch.full((t.shape[1],), d + 1, dtype=torch.float64, device=scores.device)
                for d, t in enumerate(self.tokens)
            ]
        )
        # Candidates are in level order, so a stable sort by score ranks equal scores by
        # level and then candidate order (a parent before its child).
        chosen = scores.sort(dim=1, descending=True, stable=True).indices[:, :budget]
        chosen_levels = levels[chosen]
        order = (chosen_levels * 1e6 - scores.gather(1, chosen)).argsort(dim=1, stable=True)
        chosen = chosen.gather(1, order)
        node_of = torch.full((size, count + 1), -1, dtype=torch.int64, device=scores.device)
        nodes = torch.arange(budget, device=scores.device).expand(size, -1)
        node_of[:, 1:].scatter_(1, chosen, nodes)
        node_parents = node_of.gather(1, parents.gather(1, chosen) + 1)
        return torch.cat(
            [tokens.gather(1, chosen).double(), node_parents.double(), levels[chosen]], dim=1
        )


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
