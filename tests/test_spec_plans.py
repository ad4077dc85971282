"""A speculating engine's decode steps, each running the round plan chosen for it
(spec/runtime/round_plan.py), chosen here through the worker's public `set_plan_policy`: every plan
kind decodes what plain decoding does, with the acceptance of the host's general round; the
adaptive plan switches speculation off for a draft that never accepts and keeps it on for one
that always does; switching on and off mid-request loses nothing and leaks no slot, with the
plain steps launched ahead by overlap scheduling as a plain engine's are
(engine/executor/overlap.py) or without; the trace of a step names its plan, and the engine counts
plans by label."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from queued_rounds import with_emulated_graphs
from tiny_drafts import make_good_draft, make_predictable_llama, target_config

from cluster.control.tracing import NodeTimeline, RequestTimeline, chrome_trace
from engine import LLM, SamplingParams
from engine.sampling.grammar import json_schema_grammar
from spec.draft_model import MultiLayerEagleDraft, save_draft
from spec.runtime.round_costs import MIN_ACCEPT_SAMPLES, StepCosts
from spec.runtime.round_plan import PlanPolicy

SPEC = "multi-layer-eagle"
K = 3
TREE = dict(speculative_topk=2, num_draft_tokens=6)
ENGINE = dict(kv_cache_tokens=8192, max_num_seqs=16)


def _workload(seed: int = 0, n: int = 4) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy requests ending at different steps (max_tokens, EOS for one)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(4, 30))] for _ in range(n)]
    params = [
        SamplingParams(max_tokens=14 + 5 * i, temperature=0, ignore_eos=i != 1) for i in range(n)
    ]
    return prompts, params


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The target, a draft that accepts some ("good"), one that accepts every draft of the
    workload's ("perfect"), and one whose vocabulary holds no token the target writes in the
    workload ("never": it cannot accept)."""
    root = tmp_path_factory.mktemp("plans")
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "good", root / "target", K, noise=0.05)
    make_good_draft(root / "perfect", root / "target", K, noise=0.0)
    prompts, params = _workload()
    written = {t for tokens in _plain(root / "target", prompts, params) for t in tokens}
    vocab = torch.tensor([t for t in range(3, 320) if t not in written][:8])
    torch.manual_seed(1)
    never = MultiLayerEagleDraft(target_config(root / "target"), K, vocab)
    save_draft(root / "never", never, target_name="target")
    return {name: root / name for name in ("target", "good", "perfect", "never")}


def _plain(target: Path, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in LLM(str(target), device="cpu", **ENGINE).generate(prompts, params)]


@pytest.fixture(scope="module")
def plain(models) -> list[list[int]]:
    return _plain(models["target"], *_workload())


def _llm(models, draft: str = "good", tree: bool = False, **kw) -> LLM:
    options = {**ENGINE, **(TREE if tree else {}), **kw}
    return LLM(
        str(models["target"]), device="cpu", speculative_algorithm=SPEC,
        draft_model=str(models[draft]), num_draft_steps=K, **options,
    )  # fmt: skip


def _check_empty(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_work() and not engine.speculative.held
    assert engine.kv_cache.is_empty() and engine.speculator.is_empty()


# --- every plan kind -------------------------------------------------------------------------

# label: (trees, emulated verify graphs, the policy that chooses it)
KINDS = {
    "chain/queued_by_device": (False, True, PlanPolicy("always")),
    "chain/queued_by_host": (False, False, PlanPolicy("always", queue_next="host")),
    "chain/device": (False, False, PlanPolicy("always", queue_next="none")),
    "chain/host/fixed": (False, False, PlanPolicy("always", device_rounds=False)),
    "tree/queued_by_device": (True, True, PlanPolicy("always")),
    "tree/device": (True, False, PlanPolicy("always", queue_next="none")),
    "tree/host/fixed": (True, False, PlanPolicy("always", device_rounds=False)),
    "plain": (False, False, PlanPolicy("always", disable_batch_size=1)),
}
GENERAL = PlanPolicy("always", device_rounds=False, fixed_extend=False)


def _run_kind(models, tree: bool, graphs: bool, policy: PlanPolicy) -> tuple[list, dict]:
    llm = _llm(models, tree=tree)
    if graphs:
        with_emulated_graphs(
            llm, max_span=1 + (TREE["num_draft_tokens"] if tree else K), trees=tree
        )
    llm.engine.speculator.set_plan_policy(policy)
    outputs = llm.generate(*_workload())
    _check_empty(llm)
    summary = [
        (o.token_ids, o.usage.spec_verify_steps, o.usage.spec_accepted_per_position)
        for o in outputs
    ]
    return summary, llm.engine.plan_counts()


@pytest.fixture(scope="module")
def general_rounds(models) -> dict[bool, list]:
    """The host's round with the general extend, the path every other one must agree with:
    its outputs and per-position accepts, for chains and trees."""
    return {tree: _run_kind(models, tree, False, GENERAL)[0] for tree in (False, True)}


@pytest.mark.parametrize("label", sorted(KINDS))
def test_each_plan_kind_decodes_what_plain_decoding_does(models, plain, general_rounds, label):
    tree, graphs, policy = KINDS[label]
    summary, plans = _run_kind(models, tree, graphs, policy)
    assert [tokens for tokens, *_ in summary] == plain
    if label == "plain":
        assert list(plans) == ["plain"]
        assert not any(steps for _, steps, _ in summary)
        return
    assert summary == general_rounds[tree]
    # A verify is queued behind a round on the device: the first round runs its own, and one
    # queued from the device needs every request to hold the next round's slots, else the
    # host queues it. A tree whose request's slots end before its last nodes is verified on
    # the host. Requests with no drafts left take a queued verify, or a plain step.
    kind = label.partition("/")[0]
    allowed = {label}
    if "queued" in label:
        allowed |= {f"{kind}/device", f"{kind}/queued_by_host"}
    if kind == "tree":
        allowed.add("tree/host/fixed")
    assert plans.get(label, 0) > 0 and set(plans) - {"plain"} <= allowed, plans


# --- adaptive speculation --------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
def test_a_draft_that_never_accepts_switches_speculation_off(models, plain, overlap):
    """From the rounds that measure the accept length on, every step is plain: a step
    commits one token a request either way, so the rounds are all it costs over plain
    decoding; and the output is plain decoding's. With overlap scheduling those plain steps
    are launched ahead as a plain engine's are, and measured so (spec/runtime/round_costs.py)."""
    llm = _llm(models, "never", speculative_plan="adaptive", overlap_schedule=overlap)
    prompts, params = _workload()
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == plain
    _check_empty(llm)
    plans = llm.engine.plan_counts()
    rounds = sum(n for plan, n in plans.items() if not plan.startswith("plain"))
    # All four requests decode together from the first step: one round measures four.
    assert 1 <= rounds <= -(-MIN_ACCEPT_SAMPLES // len(prompts)), plans
    assert sum(plans.values()) == max(p.max_tokens for p in params) - 1
    assert all(o.usage.spec_accepted_per_position in ([0] * K, None) for o in outputs)
    if overlap:
        # Every plain step but the first of a run of them, and the one after the batch
        # shrinks to another bucket or a request finished, is launched while the one before
        # runs; the costs the plan weighs hold those steps.
        overlapped = llm.engine.overlap.num_overlapped_steps
        assert overlapped >= plans["plain"] - len(prompts) - 1, (overlapped, plans)
        assert llm.engine.speculator.costs.measured(len(prompts))[0] is not None


@pytest.mark.parametrize("overlap", [False, True])
def test_a_draft_that_always_accepts_keeps_speculation_on(models, plain, overlap):
    """Where a round costs 1.5 plain steps (given: this host's timings must not decide a
    test), a draft that accepts everything pays at every step."""
    llm = _llm(models, "perfect", speculative_plan="adaptive", overlap_schedule=overlap)
    llm.engine.speculator.set_plan_policy(PlanPolicy("adaptive"), StepCosts.fixed(0.010, 0.015))
    outputs = llm.generate(*_workload())
    assert [o.token_ids for o in outputs] == plain
    _check_empty(llm)
    plans = llm.engine.plan_counts()
    assert not [plan for plan in plans if plan.startswith("plain")], plans
    assert all(o.usage.spec_accept_length > 3 for o in outputs)


ON = PlanPolicy("always")
OFF = PlanPolicy("always", disable_batch_size=1)


def _stepped(llm: LLM, groups, policy_at) -> tuple[list, dict]:
    """Run `groups` (a prompt and its params, n samples each) step by hand, each step under
    the policy `policy_at(step)`. Returns the requests, in order, and the drafts of each
    request still running after each step that drafted: {(request id, tokens): drafts}."""
    engine = llm.engine
    requests = []
    for i, (prompt, params) in enumerate(groups):
        samples = [
            engine.make_request(f"{i}.{s}", prompt, params.for_sample(s)) for s in range(params.n)
        ]
        engine.add_samples(samples)
        requests += samples
    drafts, step = {}, 0
    while engine.has_work():
        engine.speculator.set_plan_policy(policy_at(step))
        before = engine.plan_counts()
        engine.step()
        step += 1
        after = engine.plan_counts()
        steps = {plan: n - before.get(plan, 0) for plan, n in after.items()}
        if steps.get("plain", 0) or not any(steps.values()):
            continue  # drafted nothing (a prefill drafts too, but never decodes)
        for req in requests:
            state = req.spec_state
            if state is not None and not req.finished and req.lookahead:
                tree = state.tree
                drafted = tuple(tree.tokens) if tree is not None else tuple(state.chain)
                drafts[(req.request_id, req.num_tokens)] = (drafted, steps)
    return requests, drafts


@pytest.mark.parametrize("tree, overlap", [(False, False), (True, False), (False, True)])
def test_switching_speculation_on_and_off_mid_request_loses_nothing(models, tree, overlap):
    """Plain steps and rounds alternate every few steps, over greedy requests, a penalized
    one, one with logprobs, one under a grammar and a prompt's parallel samples: the tokens
    (and logprobs) are plain decoding's; the drafts caught up after plain steps are the ones
    an engine that speculated all along drafted at the same positions; every slot of the
    target and the depths comes back. With overlap scheduling, the plain steps of requests
    that sample from their logits alone are launched ahead (once the others finished), the
    draft state kept across them as across the others."""
    prompts, _ = _workload(seed=3, n=5)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = json_schema_grammar(schema, "response_format")
    groups = [
        (prompts[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)),
        (prompts[1], SamplingParams(max_tokens=33, temperature=0, repetition_penalty=1.3)),
        (prompts[2], SamplingParams(max_tokens=27, temperature=0, logprobs=2, ignore_eos=True)),
        (prompts[3], SamplingParams(n=2, max_tokens=30, temperature=0, ignore_eos=True)),
        (prompts[4], SamplingParams(max_tokens=24, temperature=0, grammar=grammar)),
    ]
    reference = LLM(str(models["target"]), device="cpu", **ENGINE)
    expected = reference.generate([p for p, _ in groups], [sp for _, sp in groups])
    _, always = _stepped(_llm(models, tree=tree), groups, lambda step: ON)
    llm = _llm(models, tree=tree, overlap_schedule=overlap)
    requests, switching = _stepped(llm, groups, lambda step: OFF if (step // 3) % 2 else ON)
    got = [llm.engine.output(req) for req in requests]
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for ours, theirs in zip(got, expected):
        if theirs.logprobs is not None:
            assert [lp.logprob for lp in ours.logprobs] == pytest.approx(
                [lp.logprob for lp in theirs.logprobs], abs=1e-5
            )
    _check_empty(llm)
    plans = llm.engine.plan_counts()
    assert plans.get("plain", 0) > 0 and plans.get("plain/catch_up", 0) > 0
    if overlap:
        assert llm.engine.overlap.num_overlapped_steps > 0
    caught_up = {
        key: drafted for key, (drafted, steps) in switching.items() if steps.get("plain/catch_up")
    }
    same = [key for key in caught_up if key in always]
    assert len(same) >= 3, (caught_up.keys(), always.keys())
    assert all(caught_up[key] == always[key][0] for key in same)


@pytest.mark.parametrize("tree", [False, True])
def test_plain_steps_launched_ahead_between_rounds_lose_nothing(models, plain, tree):
    """Overlap scheduling in a speculating engine: rounds and runs of plain steps alternate,
    each run's steps after its first launched while the one before still runs
    (engine/executor/overlap.py) and the drafts caught up over them once it was read; the output is
    plain decoding's and every slot comes back."""
    llm = _llm(models, tree=tree, overlap_schedule=True)
    prompts, params = _workload()
    groups = list(zip(prompts, params))
    requests, _ = _stepped(llm, groups, lambda step: OFF if (step // 4) % 2 else ON)
    assert [req.output_token_ids for req in requests] == plain
    _check_empty(llm)
    plans = llm.engine.plan_counts()
    rounds = sum(n for plan, n in plans.items() if not plan.startswith("plain"))
    assert rounds > 0 and plans.get("plain/catch_up", 0) > 0
    # Of the four plain steps of each run, the first is launched when it is planned and the
    # three after it while the one before runs.
    assert llm.engine.overlap.num_overlapped_steps >= plans["plain"] // 2, plans


# --- the plan in the trace ---------------------------------------------------------------------


def test_the_disable_batch_size_makes_steps_plain_and_each_steps_trace_names_its_plan(models):
    """Four requests, plain steps while three or more run (--speculative-disable-batch-size
    3); then the drafts catch up and rounds resume. Each decode step's first event carries
    its plan, and so does its span in the Chrome trace."""
    llm = _llm(models, speculative_disable_batch_size=3, enable_tracing=True)
    prompts, params = _workload()
    outputs = llm.generate(prompts, params)
    _check_empty(llm)
    for out in outputs:
        steps = [e for e in out.trace if e[0] in ("draft_start", "decode_start")]
        assert steps and all(len(e) == 3 and "plan" in e[2] for e in steps)
        # Every step before the batch fell under 3 was plain, and said why.
        assert steps[0][2] == {"plan": "plain", "extend": "none", "why": "batch of 3 or more"}
    longest = [e[2]["plan"] for e in outputs[-1].trace if e[0] in ("draft_start", "decode_start")]
    first_round = next(i for i, plan in enumerate(longest) if plan.startswith("chain/"))
    assert longest[first_round - 1] == "plain/catch_up"
    assert set(longest[:first_round]) == {"plain", "plain/catch_up"}
    plans = llm.engine.plan_counts()
    assert plans["plain"] > 0 and plans["plain/catch_up"] > 0
    assert sum(n for plan, n in plans.items() if plan.startswith("chain/")) > 0

    router = RequestTimeline("r", [("arrival", outputs[-1].trace[0][1])])
    trace = chrome_trace(router, [NodeTimeline("decode-0", outputs[-1].trace)], {})
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] in ("draft", "decode")]
    assert [span["args"]["plan"] for span in spans] == longest
