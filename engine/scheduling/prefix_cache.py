"""A radix tree over token ids whose nodes hold the KV slots of the tokens on their edge: the
prefix cache. A request that starts with a cached prefix reads those slots instead of computing
them again. Plain Python, no torch: the slots are the allocator's (engine.scheduling.allocator).

Invariants (checked by `check_integrity`, tested in tests/test_prefix_cache.py):
- every node but the root has a non-empty edge of tokens and one slot per token on it, and is
  filed under its parent by the edge's first token; so a prefix of tokens names at most one
  path, and a node's slots are the KV of its path's tokens at their positions;
- the tree never holds a slot twice, and never the padding slot;
- `refs` counts the holds (`lock`) taken at a node or below it: a node's refs are at least the
  sum of its children's, so a held node's ancestors are held;
- `evict` frees only nodes with no holds and no children (leaves first, least recently used
  first): a slot that a running request reads is never handed back;
- `size` is the slots in the tree, `evictable_size` those of nodes without holds.

The tree owns its slots: the caller moves slots into it (`insert`) and frees what `evict`
returns; a request that reads a matched prefix holds it (`lock`) until it lets go (`unlock`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from engine.scheduling.allocator import PADDING_SLOT


class PrefixNode:
    __slots__ = ("key", "slots", "children", "parent", "refs", "last_used")

    def __init__(self, key: list[int], slots: list[int], parent: PrefixNode | None) -> None:
        self.key = key
        self.slots = slots
        self.children: dict[int, PrefixNode] = {}
        self.parent = parent
        self.refs = 0
        self.last_used = 0


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of some tokens: its slots, and the node that ends it (the root
    when nothing matched), which a reader locks."""

    slots: list[int]
    node: PrefixNode

    @property
    def length(self) -> int:
        return len(self.slots)


def _common_length(key: Sequence[int], tokens: Sequence[int], start: int) -> int:
    n = min(len(key), len(tokens) - start)
    i = 0
    while i < n and key[i] == tokens[start + i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self) -> None:
        self.root = PrefixNode([], [], None)
        self.root.refs = 1  # never evicted
        self.size = 0
        self.evictable_size = 0
        self.evicted_tokens = 0  # slots handed back by evict, ever
        self._clock = itertools.count(1)

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest prefix of `tokens` in the tree. A match that ends inside an edge splits
        it there, so that the match ends at a node; the path counts as used now."""
        node, i, slots = self.root, 0, []
        now = next(self._clock)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            common = _common_length(child.key, tokens, i)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_used = now
            slots += child.slots
            node, i = child, i + common
        return PrefixMatch(slots, node)

    def insert(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        """Cache `slots` as the KV of `tokens` (one each). Returns how many leading tokens were
        cached already: their slots stay the tree's, and the caller's for them (where they
        differ) remain the caller's to free; the slots of the rest now belong to the tree."""
        if len(tokens) != len(slots):
            raise ValueError(f"{len(tokens)} tokens but {len(slots)} slots")
        node, i = self.root, 0
        now = next(self._clock)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = PrefixNode(list(tokens[i:]), list(slots[i:]), node)
                leaf.last_used = now
                node.children[tokens[i]] = leaf
                self.size += len(leaf.slots)
                self.evictable_size += len(leaf.slots)
                return i
            common = _common_length(child.key, tokens, i)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_used = now
            node, i = child, i + common
        return i

    def lock(self, node: PrefixNode) -> None:
        """Hold `node` and its ancestors: none of them is evicted until `unlock`."""
        while node is not self.root:
            if node.refs == 0:
                self.evictable_size -= len(node.slots)
            node.refs += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: PrefixNode) -> None:
        while node is not self.root:
            if node.refs <= 0:
                raise ValueError("a prefix unlocked more often than it was locked")
            node.refs -= 1
            if node.refs == 0:
                self.evictable_size += len(node.slots)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_slots: int) -> list[int]:
        """Take at least `num_slots` slots out of the tree (fewer if no more are free of holds),
        whole nodes, leaves first, the least recently used first; the caller frees them."""
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children and not n.refs]
        heapq.heapify(leaves)
        freed: list[int] = []
        while leaves and len(freed) < num_slots:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            freed += node.slots
            self.size -= len(node.slots)
            self.evictable_size -= len(node.slots)
            if parent is not self.root and not parent.children and not parent.refs:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        self.evicted_tokens += len(freed)
        return freed

    def slots(self) -> list[int]:
        """Every slot the tree holds."""
        return [slot for node in self._nodes() for slot in node.slots]

    def _split(self, node: PrefixNode, at: int) -> PrefixNode:
        """Cut `node`'s edge after `at` tokens: a new node holds the first part and becomes the
        parent of `node`, which keeps the rest. Holds and use pass through both."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key)
        head = PrefixNode(node.key[:at], node.slots[:at], parent)
        head.refs, head.last_used = node.refs, node.last_used
        parent.children[head.key[0]] = head
        node.key, node.slots, node.parent = node.key[at:], node.slots[at:], head
        head.children[node.key[0]] = node
        return head

    def _nodes(self) -> list[PrefixNode]:
        """Every node but the root."""
        found, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found

    def check_integrity(self) -> None:
        problems = []
        seen: set[int] = set()
        size = evictable = 0
        for node in self._nodes():
            parent = node.parent
            if not node.key or len(node.key) != len(node.slots):
                problems.append(f"a node with {len(node.key)} tokens and {len(node.slots)} slots")
                continue
            if parent is None or parent.children.get(node.key[0]) is not node:
                problems.append("a node not filed under its parent by its first token")
            held_below = sum(child.refs for child in node.children.values())
            if node.refs < held_below:
                problems.append(f"a node with {node.refs} holds below children with {held_below}")
            if seen & set(node.slots) or PADDING_SLOT in node.slots:
                problems.append("a slot held twice, or the padding slot held")
            seen.update(node.slots)
            size += len(node.slots)
            evictable += 0 if node.refs else len(node.slots)
        if size != self.size or evictable != self.evictable_size:
            problems.append(
                f"counted {size} slots ({evictable} evictable), recorded {self.size} "
                f"({self.evictable_size})"
            )
        if problems:
            raise AssertionError("prefix cache corrupt: " + "; ".join(problems))
