"""Speculative decoding in a tensor parallel engine (CPU, gloo): the draft runs on rank 0 over the
target's whole embedding and LM head (engine/tensor_parallel/whole_vocabulary.py), and the
target's forwards (prefill with its hidden states, the verify of chains and trees) run on every
rank. Greedy output at 2 ranks equals one rank's and transformers', chains and a tree, with
chunked prefill, penalties and a grammar; the drafts are accepted at the same positions as with
one rank, so the ranks change nothing the draft sees."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from family_checks import hf_greedy
from tiny_drafts import make_good_draft, make_predictable_llama
from transformers import LlamaForCausalLM

from engine import LLM, SamplingParams
from engine.sampling.grammar import grammar_library_available, json_schema_grammar

K = 2
# Longer than CHUNK: prefilled in chunks, the draft's extend with them.
PROMPTS = [[5, 17, 99, 5, 40], [200, 201, 202, 7], [77] * 9 + [12, 13, 14, 15, 16, 17, 18, 19, 20]]
CHUNK = 8
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
ENGINE = dict(device="cpu", kv_cache_tokens=1024, max_num_seqs=8, chunked_prefill_size=CHUNK)
# Each (name, options): a chain of K drafts, and a tree of top-2 with 4 drafted tokens.
SHAPES = {"chain": {}, "tree": {"speculative_topk": 2, "num_draft_tokens": 4}}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tp_spec")
    # Heads 4 and KV heads 2 (tiny_models' defaults): each of 2 ranks holds half of both.
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "draft", root / "target", K, noise=0.01)
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def engines(models: tuple[Path, Path]):
    """One speculating engine per (shape, ranks), shared by the module's tests."""
    target, draft = models
    built = {
        (shape, ranks): LLM(
            str(target),
            tensor_parallel_size=ranks,
            speculative_algorithm="multi-layer-eagle",
            draft_model=str(draft),
            num_draft_steps=K,
            **options,
            **ENGINE,
        )
        for shape, options in SHAPES.items()
        for ranks in (1, 2)
    }
    yield built
    for llm in built.values():
        llm.close()


def _run(llm: LLM, params: SamplingParams) -> tuple[list[list[int]], list]:
    outputs = llm.generate(PROMPTS, params)
    return [o.token_ids for o in outputs], [o.usage.spec_accepted_per_position for o in outputs]


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_and_acceptance_match_one_rank_and_transformers(engines, models, shape) -> None:
    hf = LlamaForCausalLM.from_pretrained(models[0]).eval()
    expected = hf_greedy(hf, PROMPTS, MAX_TOKENS)
    one_tokens, one_accepted = _run(engines[shape, 1], GREEDY)
    two_tokens, two_accepted = _run(engines[shape, 2], GREEDY)
    assert one_tokens == expected
    assert two_tokens == expected
    assert two_accepted == one_accepted
    # The drafts were verified and some accepted: the comparison covers rounds, not only
    # plain steps.
    assert sum(sum(per_position) for per_position in two_accepted) > 0


def test_draft_reads_the_whole_vocabulary(engines, models) -> None:
    """Rank 0's model holds half the vocabulary's rows; the draft's embedding and head all."""
    hf_vocab = LlamaForCausalLM.from_pretrained(models[0]).config.vocab_size
    worker = engines["chain", 2].engine.speculator
    runner = worker.runner
    assert runner.model.model.embed_tokens.embedding.weight.shape[0] < hf_vocab
    assert worker.target.model.embed_tokens.weight.shape[0] == hf_vocab
    assert worker.target is not runner.model and len(worker.target.model.layers) == 0


@pytest.mark.parametrize("shape", SHAPES)
def test_penalties_match_one_rank(engines, shape) -> None:
    params = dataclasses.replace(
        GREEDY, repetition_penalty=1.3, presence_penalty=0.5, logit_bias={5: 3.0}
    )
    expected, _ = _run(engines[shape, 1], params)
    assert expected != _run(engines[shape, 1], GREEDY)[0]  # the penalties change the output
    assert _run(engines[shape, 2], params)[0] == expected


@pytest.mark.skipif(not grammar_library_available(), reason="needs llguidance")
def test_grammar_matches_one_rank(engines) -> None:
    schema = {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        max_tokens=30, temperature=0.0, grammar=json_schema_grammar(schema, "response_format")
    )
    expected = [out.text for out in engines["chain", 1].generate(PROMPTS, params)]
    for text in expected:
        assert set(json.loads(text)) == {"x"}
    assert [out.text for out in engines["chain", 2].generate(PROMPTS, params)] == expected
