"""Tensor parallel ranks seen from outside a cluster: the follower processes of a node's Ray
actor (found through /proc, so a test can kill one outright), and greedy tokens through a
router, one prompt at a time."""

from __future__ import annotations

from pathlib import Path

from engine import SamplingParams


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def follower_ranks(actor_class: bytes) -> list[int]:
    """The follower ranks' pids: the spawned children of this host's `actor_class` actors
    (b"AggregatedNode", b"PrefillNode", b"DecodeNode")."""
    ranks = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "cmdline").read_bytes().startswith(b"ray::" + actor_class):
                continue
        except OSError:
            continue
        for child in children(int(entry.name)):
            try:
                if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    ranks.append(child)
            except OSError:
                continue
    return ranks


async def router_tokens(
    router, tag: str, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    """Each prompt's tokens through `router`, one request at a time."""
    outputs = []
    for i, prompt in enumerate(prompts):
        tokens: list[int] = []
        async for delta in router.generate(f"{tag}{i}", prompt, params):
            tokens += delta.token_ids
        outputs.append(tokens)
    return outputs
