"""The prompts a router sent one node, as a radix tree over token ids with no KV in it: the
router's guess at what that node's prefix cache holds (cluster.control.cache_aware).

It is a guess because the node's own cache (engine.scheduling.prefix_cache) may have evicted a
prompt the tree still holds, or never cached one that failed. The tree is bounded like that cache:
past `max_tokens` tokens it drops its least recently used leaves, so it forgets old prompts at
about the rate a node with that many KV slots would.

Invariants (checked by `check_integrity`, tested in tests/test_cache_aware.py):
- every node but the root has a non-empty edge, filed under its parent by the edge's first
  token, so a prefix of tokens names at most one path;
- `size` is the sum of the edges' lengths, and at most `max_tokens` after every insert;
- a node is used no earlier than any of its children (`insert` touches a whole path), so
  dropping least recently used leaves never leaves a newer prompt without its prefix.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence


class _Edge:
    __slots__ = ("key", "children", "parent", "last_used")

    def __init__(self, key: list[int], parent: _Edge | None) -> None:
        self.key = key
        self.children: dict[int, _Edge] = {}
        self.parent = parent
        self.last_used = 0


def _common_length(key: list[int], tokens: Sequence[int], start: int) -> int:
    end = min(len(key), len(tokens) - start)
    # Whole edges usually match: compare them at C speed, and walk only the one that differs.
    if key[:end] == list(tokens[start : start + end]):
        return end
    i = 0
    while key[i] == tokens[start + i]:
        i += 1
    return i


class RoutedPrefixes:
    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.root = _Edge([], None)
        self.size = 0
        self._clock = itertools.count(1)

    def match(self, tokens: Sequence[int]) -> int:
        """The length of the longest prefix of `tokens` in the tree; changes nothing."""
        edge, i = self.root, 0
        while i < len(tokens):
            child = edge.children.get(tokens[i])
            if child is None:
                break
            common = _common_length(child.key, tokens, i)
            i += common
            if common < len(child.key):
                break
            edge = child
        return i

    def insert(self, tokens: Sequence[int]) -> None:
        """Hold `tokens` (at most their first `max_tokens`) as just used, then drop least
        recently used leaves until the tree is within `max_tokens`."""
        tokens = list(tokens[: self.max_tokens])
        now = next(self._clock)
        edge, i = self.root, 0
        edge.last_used = now
        while i < len(tokens):
            child = edge.children.get(tokens[i])
            if child is None:
                child = _Edge(tokens[i:], edge)
                edge.children[tokens[i]] = child
                self.size += len(child.key)
                child.last_used = now
                break
            common = _common_length(child.key, tokens, i)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_used = now
            edge, i = child, i + common
        self._evict(now)

    def _split(self, edge: _Edge, at: int) -> _Edge:
        """Cut `edge` after `at` tokens; the first part, returned, takes its place."""
        parent = edge.parent
        assert parent is not None
        head = _Edge(edge.key[:at], parent)
        head.last_used = edge.last_used
        parent.children[head.key[0]] = head
        edge.key = edge.key[at:]
        edge.parent = head
        head.children[edge.key[0]] = edge
        return head

    def _evict(self, now: int) -> None:
        if self.size <= self.max_tokens:
            return
        leaves = [(e.last_used, id(e), e) for e in self._edges() if not e.children]
        heapq.heapify(leaves)
        while self.size > self.max_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.size -= len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))

    def _edges(self) -> list[_Edge]:
        found, stack = [], list(self.root.children.values())
        while stack:
            edge = stack.pop()
            found.append(edge)
            stack.extend(edge.children.values())
        return found

    def check_integrity(self) -> None:
        """Raise AssertionError where an invariant of the module's docstring does not hold."""
        total = 0
        for edge in self._edges():
            parent = edge.parent
            assert edge.key, "an empty edge"
            assert parent is not None and parent.children.get(edge.key[0]) is edge
            assert parent is self.root or parent.last_used >= edge.last_used
            total += len(edge.key)
        assert total == self.size, (total, self.size)
        assert self.size <= self.max_tokens, (self.size, self.max_tokens)
