"""The speculative options of an engine (EngineConfig's draft tree, draft vocabulary and round
plan) and the checks that refuse a bad value with its reason: one place, used by EngineConfig and
by the command line before a config is built (engine.loading.loader)."""

from __future__ import annotations

from engine.executor.forward_batch import TREE_MAX_TOKENS

# What a draft may propose from (EngineConfig.draft_vocab).
DRAFT_VOCAB_CHOICES = ("draft", "full")


def check_draft_vocab_choice(value: str) -> None:
    if value not in DRAFT_VOCAB_CHOICES:
        raise ValueError(
            f"draft_vocab must be one of {', '.join(DRAFT_VOCAB_CHOICES)}, got {value!r}"
        )


SPECULATIVE_PLAN_CHOICES = ("adaptive", "always")


def check_speculative_plan(plan: str, disable_batch_size: int | None) -> None:
    if plan not in SPECULATIVE_PLAN_CHOICES:
        raise ValueError(
            f"speculative_plan must be one of {', '.join(SPECULATIVE_PLAN_CHOICES)}, got {plan!r}"
        )
    if disable_batch_size is not None and disable_batch_size < 1:
        raise ValueError(f"speculative_disable_batch_size must be >= 1, got {disable_batch_size}")


# A tree's verify span is the newest token then the nodes, each token's visible rows a 64-bit
# mask (engine.executor.forward_batch.Span.visible).
MAX_DRAFT_TREE_TOKENS = TREE_MAX_TOKENS - 1


def check_draft_tree(topk: int, num_draft_tokens: int | None, num_chains: int | None) -> None:
    """The draft tree's settings, each with the reason it is refused."""
    if topk < 1:
        raise ValueError(f"speculative_topk must be >= 1, got {topk}")
    if num_draft_tokens is not None:
        if topk < 2:
            raise ValueError("num_draft_tokens needs speculative_topk >= 2 (a tree)")
        if not 1 <= num_draft_tokens <= MAX_DRAFT_TREE_TOKENS:
            raise ValueError(
                f"num_draft_tokens must be in 1..{MAX_DRAFT_TREE_TOKENS}, got {num_draft_tokens}"
            )
    if topk > 1 and num_chains is not None and num_chains > 1:
        raise ValueError(
            "give num_draft_chains or speculative_topk, not both: N chains are the tree that "
            "branches at the first draft only"
        )
