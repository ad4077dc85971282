"""The noise a sampled row draws from: on a GPU a counter-based hash of each row's seed
(splitmix64, computed the same on every device), and the seed streams that key it, one per
seeded output position."""

from __future__ import annotations

import math

import pytest
import torch
from test_sampling import CHI2_CRITICAL

from engine.sampling.sampler import PositionSeed, exponential_noise, hashed_exponential, noise_seeds
from engine.sampling.step_sampling import position_seed

_MASK64 = 2**64 - 1


def _splitmix64_reference(z: int) -> int:
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
    return z ^ (z >> 31)


def test_hashed_noise_is_splitmix64_of_the_seed_stream() -> None:
    """The GPU's noise, computed here on the CPU: torch's signed 64-bit arithmetic must give
    the unsigned hash bit for bit (wrapping products, logical shifts)."""
    seeds = [0, 1, 2**62 + 12345, 2**63 - 1]
    noise = hashed_exponential(torch.tensor(seeds), 40).double()
    for r, seed in enumerate(seeds):
        base = _splitmix64_reference(seed)
        for v in (0, 1, 17, 39):
            z = _splitmix64_reference((base + (v + 1) * 0x9E3779B97F4A7C15) & _MASK64)
            uniform = ((z >> 11) + 0.5) * 2.0**-53
            assert noise[r, v] == pytest.approx(-math.log(uniform), rel=1e-6)


def test_hashed_noise_depends_on_the_seed_alone() -> None:
    alone = hashed_exponential(torch.tensor([77]), 1000)
    among = hashed_exponential(torch.tensor([5, 77, 9, 77]), 1000)
    assert torch.equal(among[1], alone[0]) and torch.equal(among[3], alone[0])
    assert not torch.equal(among[0], among[2])
    assert (among > 0).all()


def test_hashed_noise_races_to_the_right_frequencies() -> None:
    """argmax p / E with the hashed Exp(1) noise draws token v with probability p_v, over
    consecutive seeds (the derived seeds of a run are drawn, but nearby ones must not
    correlate)."""
    probs = torch.tensor([0.05, 0.35, 0.1, 0.3, 0.2])
    draws = 20000
    noise = hashed_exponential(torch.arange(draws), 5)
    counts = torch.bincount((probs / noise).argmax(-1), minlength=5).double()
    wanted = draws * probs.double()
    chi2 = float(((counts - wanted) ** 2 / wanted).sum())
    assert chi2 < CHI2_CRITICAL[4], (chi2, counts.tolist())
    mean = float(hashed_exponential(torch.arange(64), 4096).double().mean())
    assert mean == pytest.approx(1.0, abs=0.01)


def test_a_positions_seed_stream_is_its_generators(monkeypatch) -> None:
    """A seeded position's noise seed on a GPU is the number its generator draws first, the
    same however often the position is asked for, and a CPU's noise row is filled from that
    generator; a GPU asks for each position's generator once (a speculative step asks again
    for positions it verified before)."""
    keys = [position_seed(seed, index).key for seed in (0, 7, 2**40) for index in (0, 3)]
    for key in keys:
        drawn = torch.randint(
            2**63 - 1, (), generator=torch.Generator().manual_seed(key), dtype=torch.int64
        )
        assert noise_seeds([PositionSeed(key)] * 2) == [int(drawn)] * 2
    made = []
    real = torch.Generator

    def counted(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "Generator", counted)
    fresh = position_seed(12345, 6789)
    noise_seeds([fresh, fresh, position_seed(12345, 6789)])
    assert len(made) == 1
    probs = torch.full((2, 50), 0.02)
    noise = exponential_noise(probs, [fresh, real().manual_seed(fresh.key)])
    assert torch.equal(noise[0], noise[1])
