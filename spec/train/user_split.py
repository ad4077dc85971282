"""A user's prompts made ready for training: repeats dropped, and a held-out share set apart that
shares no conversation and no user message with what is trained on.

Rules, on normalised text (spec.train.user_prompts.normalised):

- a conversation whose opening (system prompt and first user message) an earlier one of the file
  has is a repeat: the target's answer to that opening is already there;
- one whose first user message is a template or self-written message is a repeat too;
- one holding any user message of the built-in held-out set is dropped: it must never be trained
  on;
- conversations that share a user message are linked, and a held-out conversation is taken
  with everything linked to it: whole groups go to the held-out set, chosen in an order drawn
  from the seed, until it holds its share. A group holding a template or self-written message
  stays in training (that message is trained on already)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from spec.train.user_prompts import UserConversation, normalised


@dataclass
class UserPromptSplit:
    train: list[UserConversation]
    heldout: list[UserConversation]
    repeats: int  # dropped: an earlier opening, or a template or self-written message
    heldout_overlap: int  # dropped: they hold a built-in held-out message


def user_message_keys(conversation: UserConversation) -> set[str]:
    return {normalised(text) for text in conversation.user_turns}


def split_user_prompts(
    conversations: list[UserConversation],
    known_messages: Iterable[str],
    heldout_messages: Iterable[str],
    heldout_share: float,
    seed: int = 0,
) -> UserPromptSplit:
    """`known_messages`: the user messages of the template and self-written prompts;
    `heldout_messages`: those of the built-in held-out set; `heldout_share`: the share of the
    kept conversations to hold out (whole linked groups, so it may come out a little under)."""
    if not 0.0 <= heldout_share < 1.0:
        raise ValueError(f"the held-out share of user prompts is in [0, 1), got {heldout_share}")
    known = {normalised(text) for text in known_messages}
    banned = {normalised(text) for text in heldout_messages}
    kept: list[UserConversation] = []
    openings: set[tuple[str, str]] = set()
    repeats = overlap = 0
    for conversation in conversations:
        keys = user_message_keys(conversation)
        first = normalised(conversation.user_turns[0])
        opening = (normalised(conversation.system or ""), first)
        if keys & banned:
            overlap += 1
        elif opening in openings or first in known:
            repeats += 1
        else:
            openings.add(opening)
            kept.append(conversation)
    chosen = _heldout_groups(kept, known, heldout_share, seed)
    return UserPromptSplit(
        train=[c for i, c in enumerate(kept) if i not in chosen],
        heldout=[c for i, c in enumerate(kept) if i in chosen],
        repeats=repeats,
        heldout_overlap=overlap,
    )


def _heldout_groups(
    kept: list[UserConversation], known: set[str], share: float, seed: int
) -> set[int]:
    """Indices into `kept` of the held-out conversations: whole groups of conversations linked
    by a shared user message."""
    parent = list(range(len(kept)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for i, conversation in enumerate(kept):
        for key in user_message_keys(conversation):
            if key in owner:
                parent[root(i)] = root(owner[key])
            else:
                owner[key] = i
    groups: dict[int, list[int]] = {}
    for i in range(len(kept)):
        groups.setdefault(root(i), []).append(i)
    wanted = round(share * len(kept))
    if share > 0 and len(kept) >= 2:
        wanted = max(1, wanted)

    def order(members: list[int]) -> str:
        first = min(min(user_message_keys(kept[i])) for i in members)
        return hashlib.sha256(f"{seed}\0{first}".encode()).hexdigest()

    chosen: set[int] = set()
    for members in sorted(groups.values(), key=order):
        if len(chosen) >= wanted:
            break
        if len(chosen) + len(members) > wanted or any(
            user_message_keys(kept[i]) & known for i in members
        ):
            continue
        chosen.update(members)
    return chosen
