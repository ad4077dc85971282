"""Token-id prompts for the prefix-cache tests: groups that share a random opening."""

from __future__ import annotations

import random


def shared_prefix_prompts(seed: int, groups: int = 3, per_group: int = 4) -> list[list[int]]:
    """`groups` random openings of 20 to 40 tokens, each followed by `per_group` random
    questions of 1 to 12 tokens; shuffled, so that a group's prompts arrive apart."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = [rng.randrange(3, 320) for _ in range(rng.randint(20, 40))]
        for _ in range(per_group):
            prompts.append(system + [rng.randrange(3, 320) for _ in range(rng.randint(1, 12))])
    rng.shuffle(prompts)
    return prompts
