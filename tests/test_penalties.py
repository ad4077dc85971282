"""Penalties, biases and min_tokens (engine.sampling.logits_processors): greedy output token-exact
against transformers' RepetitionPenaltyLogitsProcessor and a reference for OpenAI's presence and
frequency penalties written here, with and without speculative decoding (which must stay lossless
with them); logit_bias forcing and forbidding tokens; min_tokens keeping EOS away."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_drafts import make_good_draft, make_predictable_llama, make_random_draft
from tiny_models import make_tiny_llama
from transformers import LlamaForCausalLM, RepetitionPenaltyLogitsProcessor

from engine import LLM, SamplingParams
from engine.errors import RequestRejectedError

SPEC = "multi-layer-eagle"
K = 3
EOS = 2
PROMPTS = [[5, 17, 99, 5, 40], [200, 201, 202], [77] * 9 + [12, 13]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """draft kind -> (target, draft): a random draft (rejects most), a good draft (accepts
    most) on a target it nearly reproduces, as in test_spec_lossless."""
    root = tmp_path_factory.mktemp("penalties")
    make_tiny_llama(root / "target", seed=0)
    make_random_draft(root / "random", root / "target", K, seed=1)
    make_predictable_llama(root / "predictable", seed=0)
    make_good_draft(root / "good", root / "predictable", K, noise=0.01)
    return {
        "random": (root / "target", root / "random"),
        "good": (root / "predictable", root / "good"),
    }


def _llm(target: Path, draft: Path | None = None, **kw) -> LLM:
    if draft is not None:
        kw.update(speculative_algorithm=SPEC, draft_model=str(draft), num_draft_steps=K)
    return LLM(str(target), device="cpu", kv_cache_tokens=4096, max_num_seqs=8, **kw)


def _openai_penalties(
    scores: torch.Tensor, generated: list[int], presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's documented formula: mu[j] - c[j] * frequency - (c[j] > 0) * presence, with c
    counting token j among the tokens generated so far."""
    out = scores.clone()
    for token in set(generated):
        count = generated.count(token)
        out[0, token] -= count * frequency + presence
    return out


@torch.no_grad()
def _reference_greedy(
    hf: LlamaForCausalLM,
    prompt: list[int],
    max_tokens: int,
    repetition: float = 1.0,
    presence: float = 0.0,
    frequency: float = 0.0,
) -> list[int]:
    """Greedy decoding by transformers' forward (with its KV cache), one token at a time."""
    ids = torch.tensor([prompt])
    repetition_processor = RepetitionPenaltyLogitsProcessor(repetition)
    generated: list[int] = []
    past, new = None, ids
    for _ in range(max_tokens):
        out = hf(new, past_key_values=past, use_cache=True)
        past = out.past_key_values
        scores = out.logits[:, -1, :].float()
        if repetition != 1.0:
            scores = repetition_processor(ids, scores)
        scores = _openai_penalties(scores, generated, presence, frequency)
        token = int(scores.argmax(-1))
        generated.append(token)
        new = torch.tensor([[token]])
        ids = torch.cat([ids, new], dim=1)
    return generated


CASES = {
    "none": {},
    "repetition": dict(repetition_penalty=1.8),
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=2.0),
    "all": dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.9),
    # A penalty below 1 favours repeats: the predictable target soon loops, and frequency and
    # presence penalties, which count generated tokens only, then have repeats to act on.
    "loop": dict(repetition_penalty=0.5),
    "loop_frequency": dict(repetition_penalty=0.5, frequency_penalty=1.5),
    "loop_presence": dict(repetition_penalty=0.5, presence_penalty=2.0),
}
# (case, baseline) pairs whose greedy outputs differ, per target: each penalty changes what
# the model says, or matching the references would prove nothing. The predictable target
# repeats nothing within MAX_TOKENS unless a penalty below 1 makes it loop.
LOOPS = [("loop", "none"), ("loop_frequency", "loop"), ("loop_presence", "loop")]
CHANGES = {
    "random": [("repetition", "none"), ("frequency", "none"), ("presence", "none"), *LOOPS],
    "good": LOOPS,
}
_REFERENCE_NAMES = {
    "repetition_penalty": "repetition",
    "presence_penalty": "presence",
    "frequency_penalty": "frequency",
}


@pytest.fixture(scope="module")
def references(models) -> dict[tuple[str, str], list[list[int]]]:
    """(target kind, case) -> transformers' greedy tokens for each prompt."""
    out = {}
    for kind in ("random", "good"):
        hf = LlamaForCausalLM.from_pretrained(models[kind][0]).eval()
        for case, fields in CASES.items():
            named = {_REFERENCE_NAMES[k]: v for k, v in fields.items()}
            out[kind, case] = [_reference_greedy(hf, p, MAX_TOKENS, **named) for p in PROMPTS]
    return out


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("kind", ["random", "good"])
def test_greedy_penalties_match_the_references(models, references, kind, speculate):
    target, draft = models[kind]
    llm = _llm(target, draft if speculate else None)
    accepted = 0
    for case, fields in CASES.items():
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **fields)
        outputs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outputs] == references[kind, case], case
        if speculate:
            details = [o.usage.completion_tokens_details for o in outputs]
            accepted += sum(d.accepted_prediction_tokens for d in details)
    for case, baseline in CHANGES[kind]:
        assert references[kind, case] != references[kind, baseline], (case, baseline)
    if speculate and kind == "good":
        # Drafts were accepted under penalties: verify positions after accepted drafts ran.
        assert accepted > 0


def test_speculation_with_alternative_chains_stays_lossless(models):
    target, draft = models["good"]
    llm = _llm(target, draft, num_draft_chains=3)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **CASES["all"])
    outputs = llm.generate(PROMPTS, params)
    plain = _llm(target).generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]


def test_seeded_sampling_with_penalties_is_the_same_with_speculation(models):
    target, draft = models["good"]
    params = [
        SamplingParams(max_tokens=12, temperature=0.8, seed=s, **CASES["all"])
        for s in range(len(PROMPTS))
    ]
    first = _llm(target, draft).generate(PROMPTS, params)
    again = _llm(target, draft).generate(PROMPTS, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]


def test_logit_bias_forces_and_forbids_tokens(models):
    target, draft = models["random"]
    for llm in (_llm(target), _llm(target, draft)):
        forced = SamplingParams(max_tokens=8, temperature=0, logit_bias={77: 100})
        assert llm.generate(PROMPTS[:1], forced)[0].token_ids[:7] == [77] * 7
        sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=3, logit_bias={77: 100})
        assert set(llm.generate(PROMPTS[:1], sampled)[0].token_ids) == {77}
    plain = _llm(target)
    usual = plain.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    banned = sorted({t for o in usual for t in o.token_ids})
    forbid = SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, logit_bias={t: -100 for t in banned}
    )
    for output in plain.generate(PROMPTS, forbid):
        assert not set(output.token_ids) & set(banned)


def test_min_tokens_keeps_eos_and_stop_tokens_away(models):
    target, _ = models["random"]
    llm = _llm(target)
    ends_at_once = SamplingParams(max_tokens=10, temperature=0, logit_bias={EOS: 100})
    assert llm.generate(PROMPTS[:1], ends_at_once)[0].token_ids == [EOS]
    held = SamplingParams(max_tokens=10, temperature=0, logit_bias={EOS: 100}, min_tokens=4)
    output = llm.generate(PROMPTS[:1], held)[0]
    assert output.token_ids[4] == EOS and EOS not in output.token_ids[:4]
    assert output.finish_reason == "stop"
    stop = SamplingParams(
        max_tokens=10, temperature=0, logit_bias={9: 100}, stop_token_ids=[9], min_tokens=3
    )
    output = llm.generate(PROMPTS[:1], stop)[0]
    assert output.token_ids[3] == 9 and 9 not in output.token_ids[:3]


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias={5: 101}), "logit_bias"),
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(n=0), "n"),
    ],
)
def test_out_of_range_values_are_refused(fields, names):
    with pytest.raises(RequestRejectedError, match=names):
        SamplingParams(**fields)


def test_logit_bias_outside_the_vocabulary_is_refused(models):
    llm = _llm(models["random"][0])
    with pytest.raises(RequestRejectedError, match="logit_bias"):
        llm.generate(PROMPTS[:1], SamplingParams(logit_bias={320: 5}))


def test_the_fields_cross_the_wire_and_older_senders_still_decode():
    import msgpack

    from cluster.control.router_messages import sampling_spec
    from metadata.messages import PROTOCOL_VERSION, SamplingSpec, decode, encode

    params = SamplingParams(
        max_tokens=9,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.2,
        logit_bias={7: 3.0, 9: -100},
        min_tokens=2,
        stop_token_ids=[4],
    )
    landed = SamplingParams(**decode(encode(sampling_spec(params))).__dict__)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
        assert getattr(landed, name) == getattr(params, name), name
    assert list(landed.stop_token_ids) == [4]
    assert landed.logit_bias_items == params.logit_bias_items
    older = {
        "max_tokens": 4,
        "temperature": 0.0,
        "top_k": 0,
        "top_p": 1.0,
        "seed": None,
        "stop": [],
        "stop_token_ids": [],
        "ignore_eos": False,
        "logprobs": None,
    }
    raw = msgpack.packb({"type": "SamplingSpec", "version": PROTOCOL_VERSION, "body": older})
    assert not SamplingParams(**decode(raw).__dict__).penalized
    assert isinstance(decode(raw), SamplingSpec)


def test_a_speculative_cluster_with_penalties_equals_plain_decoding(models):
    """The prefill node samples the first token under the processors, the decode node verifies
    each later position with them: greedy output is the offline engine's without speculation."""
    import asyncio

    pytest.importorskip("ray")
    from cluster_helpers import launch

    target, draft = models["good"]
    engine = dict(max_model_len=128, kv_cache_tokens=1024, max_num_seqs=8)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logit_bias={9: 1.5}, **CASES["all"]
    )
    expected = [o.token_ids for o in _llm(target).generate(PROMPTS, params)]
    cluster = launch(
        str(target),
        prefill=1,
        decode=1,
        speculative_algorithm=SPEC,
        draft_model=str(draft),
        num_draft_steps=K,
        **engine,
    )

    async def one(i: int, prompt: list[int]) -> tuple[list[int], dict]:
        tokens, usage = [], {}
        async for delta in cluster.router.generate(f"p{i}", prompt, params):
            tokens += delta.token_ids
            usage = delta.usage or usage
        return tokens, usage

    async def every() -> list[tuple[list[int], dict]]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

    try:
        answers = asyncio.run(every())
    finally:
        cluster.shutdown()
    assert [tokens for tokens, _ in answers] == expected
    accepted = sum(u["completion_tokens_details"]["accepted_prediction_tokens"] for _, u in answers)
    assert accepted > 0
