"""Sampling with speculation keeps the target's distribution: the first tokens of many seeded
requests, with chains and with trees, follow the exact distribution that a reference (HF
transformers) gives, and a broken acceptance rule fails that same check, so the check has the
power to see one. The rule itself: tests/test_spec_tree_rules.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from tiny_drafts import make_good_draft, make_predictable_llama
from transformers import LlamaForCausalLM

from engine import LLM, SamplingParams
from engine.sampling.sampler import filtered_probs
from spec.runtime.acceptance import Verdict, accept_on_host
from spec.runtime.tree import DraftTree

VOCAB = 16
PROMPT = [1, 5, 7, 3]
NUM_RUNS = 1200


def chi_square_p_value(observed: Counter, expected: dict, total: int) -> float:
    """Pearson's test; cells expected fewer than 5 times are pooled into one."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, prob in expected.items():
        exp = prob * total
        if exp < 5:
            pooled_obs += observed.get(key, 0)
            pooled_exp += exp
            continue
        stat += (observed.get(key, 0) - exp) ** 2 / exp
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    df = torch.tensor((cells - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))


# --- the rule itself ------------------------------------------------------------------------


def test_greedy_accepts_the_matching_prefix_then_adds_the_target_token() -> None:
    targets = [3, 5, 1, 6]  # the target's argmax at the newest token and each draft

    def accept_greedy(targets: list[int], drafts: list[int]):
        return accept_on_host([DraftTree.chain(drafts)], [targets])[0]

    all_right = accept_greedy(targets, [3, 5, 1])
    assert (all_right.tokens, all_right.num_accepted) == ([3, 5, 1, 6], 3)
    second_wrong = accept_greedy(targets, [3, 4, 1])
    assert (second_wrong.tokens, second_wrong.num_accepted) == ([3, 5], 1)
    first_wrong = accept_greedy(targets, [0, 5, 1])
    assert (first_wrong.tokens, first_wrong.num_accepted) == ([3], 0)
    no_drafts = accept_greedy(targets[:1], [])
    assert (no_drafts.tokens, no_drafts.num_accepted) == ([3], 0)


# --- the engine, against the exact distribution ----------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 16-token vocabulary with sharp next-token distributions, and a draft that proposes
    the likely token often: a wrong acceptance rule then shifts the output a lot."""
    root = tmp_path_factory.mktemp("spec_sampling")
    make_predictable_llama(root / "target", seed=0, vocab_size=VOCAB, logit_scale=3.0)
    make_good_draft(root / "draft", root / "target", 2, noise=0.01)
    return root / "target", root / "draft"


def _exact_distribution(target: Path, params: SamplingParams) -> dict[tuple[int, int, int], float]:
    """P(t1, t2, t3) of the first three tokens, from HF transformers' logits."""
    hf = LlamaForCausalLM.from_pretrained(target).eval()
    pairs = [(a, b) for a in range(VOCAB) for b in range(VOCAB)]
    ids = torch.tensor([PROMPT + [a, b] for a, b in pairs])
    with torch.no_grad():
        logits = hf(ids).logits.float()
    n = len(PROMPT)
    p1 = filtered_probs(logits[0, n - 1], params)
    joint = {}
    for row, (a, b) in enumerate(pairs):
        p2 = filtered_probs(logits[row, n], params)
        p3 = filtered_probs(logits[row, n + 1], params)
        for c in range(VOCAB):
            joint[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return joint


def _sample_runs(
    folders: tuple[Path, Path], params: SamplingParams, topk: int | None = None
) -> list[tuple[int, ...]]:
    """`topk`: draft trees of the top-k shape (spec/runtime/tree.py) instead of chains."""
    target, draft = folders
    llm = LLM(
        str(target),
        device="cpu",
        kv_cache_tokens=8 * NUM_RUNS,
        max_num_seqs=400,
        max_model_len=16,
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(draft),
        speculative_topk=topk,
    )
    seeded = [
        SamplingParams(**{**params.__dict__, "seed": seed, "max_tokens": 3, "ignore_eos": True})
        for seed in range(NUM_RUNS)
    ]
    outputs = llm.generate([PROMPT] * NUM_RUNS, seeded)
    assert sum(o.usage.completion_tokens_details.accepted_prediction_tokens for o in outputs) > 0
    return [tuple(o.token_ids) for o in outputs]


def _p_values(runs: list[tuple[int, ...]], joint: dict) -> dict[str, float]:
    """Tests of the tokens speculation produced (t1 comes from the prefill alone)."""
    marginals = {"t2": Counter(), "t3": Counter(), "t2,t3": Counter()}
    for _t1, t2, t3 in runs:
        marginals["t2"][t2] += 1
        marginals["t3"][t3] += 1
        marginals["t2,t3"][(t2, t3)] += 1
    expected: dict[str, dict] = {"t2": Counter(), "t3": Counter(), "t2,t3": Counter()}
    for (_, b, c), prob in joint.items():
        expected["t2"][b] += prob
        expected["t3"][c] += prob
        expected["t2,t3"][(b, c)] += prob
    return {k: chi_square_p_value(marginals[k], expected[k], len(runs)) for k in marginals}


SETTINGS = {
    "temperature-1": SamplingParams(temperature=1.0),
    "temperature-0.7-top-p-0.9": SamplingParams(temperature=0.7, top_p=0.9),
}


@pytest.mark.parametrize("topk", [None, 4])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_speculative_sampling_keeps_the_target_distribution(
    folders, name: str, topk: int | None
) -> None:
    params = SETTINGS[name]
    runs = _sample_runs(folders, params, topk)
    p_values = _p_values(runs, _exact_distribution(folders[0], params))
    assert min(p_values.values()) > 1e-3, p_values


def _tree_second_chance(tree, targets):
    """A rule that favours drafts: where the walk stops at a node with children, take the
    first child anyway."""
    (verdict,) = accept_on_host([tree], [targets])
    row = verdict.path[-1] + 1 if verdict.path else 0
    kids = tree.children()[row]
    if kids:
        child = kids[0]
        path = [*verdict.path, child]
        tokens = [tree.tokens[n] for n in path] + [targets[child + 1]]
        return Verdict(tokens, len(path), path)
    return verdict


def _second_chance_on_host(trees, targets):
    return [_tree_second_chance(tree, chosen) for tree, chosen in zip(trees, targets)]


@pytest.mark.parametrize("topk", [None, 4])
def test_the_check_catches_a_broken_acceptance_rule(folders, monkeypatch, topk) -> None:
    monkeypatch.setattr("spec.runtime.host_verify.accept_on_host", _second_chance_on_host)
    params = SETTINGS["temperature-1"]
    runs = _sample_runs(folders, params, topk=topk)
    p_values = _p_values(runs, _exact_distribution(folders[0], params))
    assert min(p_values.values()) < 1e-6, p_values
