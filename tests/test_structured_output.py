"""Structured output on the default model: answers constrained by a JSON schema parse and
validate, with and without speculation; a forbidden draft token is rejected, never emitted;
grammars are compiled once per schema; the mask reaches every sampling path."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.request import Request
from engine.sampling.grammar import GrammarCompiler, json_schema_grammar
from engine.sampling.grammar_mask import apply_bitmask, mask_verify_logits, new_bitmask

pytest.importorskip("llguidance")

NAME = {"type": "string", "maxLength": 16}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": NAME,
            "country": NAME,
            "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        },
        "required": ["city", "country", "population"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "answer": {"type": "boolean"},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "mood": {"enum": ["happy", "sad", "angry", "calm"]},
            "reason": NAME,
        },
        "required": ["mood", "reason"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": NAME,
            "author": {
                "type": "object",
                "properties": {"first": NAME, "last": NAME},
                "required": ["first", "last"],
                "additionalProperties": False,
            },
            "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        },
        "required": ["title", "author", "year"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 100},
        "minItems": 2,
        "maxItems": 5,
    },
    {
        "type": "object",
        "properties": {
            "item": NAME,
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "in_stock": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["new", "sale", "used"]}, "maxItems": 2},
        },
        "required": ["item", "price", "in_stock", "tags"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
    {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50}, "y": {"const": 1}},
        "required": ["x", "y"],
        "additionalProperties": False,
    },
]
QUESTIONS = [
    "Describe a person as JSON.",
    "Tell me about a big city, as JSON.",
    "Is the sky green? Answer as JSON.",
    "Name some colors, as JSON.",
    "How do you feel today? Answer in JSON.",
]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    return LLM(device="cpu", max_num_seqs=16)


@pytest.fixture(scope="module")
def speculative_llm() -> LLM:
    return LLM(device="cpu", max_num_seqs=16, speculative_algorithm="multi-layer-eagle")


def _cases(llm: LLM) -> tuple[list[list[int]], list[SamplingParams], list[dict]]:
    """50 answers: each of 10 schemas asked 5 questions, greedy and sampled in turn."""
    prompts, params, schemas = [], [], []
    for s, schema in enumerate(SCHEMAS):
        grammar = json_schema_grammar(schema, "response_format")
        for q, question in enumerate(QUESTIONS):
            prompts.append(llm.apply_chat_template([{"role": "user", "content": question}]))
            temperature = 0.0 if (s + q) % 2 == 0 else 0.8
            params.append(
                SamplingParams(
                    max_tokens=MAX_TOKENS, temperature=temperature, seed=s * 10 + q, grammar=grammar
                )
            )
            schemas.append(schema)
    return prompts, params, schemas


def _assert_all_valid(outputs, schemas) -> None:
    assert len(outputs) == 50
    for output, schema in zip(outputs, schemas):
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), schema)


def test_fifty_answers_to_varied_schemas_parse_and_validate(default_llm):
    prompts, params, schemas = _cases(default_llm)
    _assert_all_valid(default_llm.generate(prompts, params), schemas)


def test_fifty_answers_with_speculation_parse_validate_and_report_accept_length(
    speculative_llm, default_llm
):
    prompts, params, schemas = _cases(speculative_llm)
    outputs = speculative_llm.generate(prompts, params)
    _assert_all_valid(outputs, schemas)
    steps = sum(o.usage.spec_verify_steps or 0 for o in outputs)
    assert steps > 0
    accept = sum(
        (o.usage.spec_accept_length or 0) * (o.usage.spec_verify_steps or 0) for o in outputs
    )
    print(f"structured output with speculation: accept length {accept / steps:.2f}")
    assert 1.0 <= accept / steps
    # Greedy verify is lossless under the grammar too: the tokens plain decoding gives.
    greedy = [i for i, p in enumerate(params) if p.greedy][:5]
    plain = default_llm.generate([prompts[i] for i in greedy], [params[i] for i in greedy])
    assert [o.token_ids for o in plain] == [outputs[i].token_ids for i in greedy]


def test_without_a_grammar_the_model_does_not_answer_json(default_llm):
    """The test above would pass vacuously if the model answered JSON anyway."""
    prompt = default_llm.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}])
    [output] = default_llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0))
    with pytest.raises(ValueError):
        json.loads(output.text)


def _matcher(llm: LLM, schema: dict) -> GrammarCompiler:
    config = llm.engine.runner.model_config
    compiler = GrammarCompiler(llm.tokenizer, config.vocab_size, config.eos_token_ids)
    return compiler.start(json_schema_grammar(schema, "response_format"))


def test_verify_masks_each_position_with_the_state_after_its_drafts(default_llm):
    """Drafts `{"`, `name`, then `}`, which the grammar forbids there: each position allows
    what the grammar allows after the drafts before it, the forbidden draft's position gets
    probability 0 (it is rejected), the position after it is never all -inf, and the matcher
    is left where it was (the tentative advances rolled back)."""
    tokenizer = default_llm.tokenizer
    matcher = _matcher(default_llm, SCHEMAS[0])
    matcher.wait(30)
    valid = tokenizer.encode('{"name":"Bob","age":3}')
    brace_quote, name, after_name = valid[:3]
    forbidden = tokenizer.convert_tokens_to_ids("}")
    vocab = default_llm.engine.runner.model_config.vocab_size
    drafts = [brace_quote, name, forbidden]
    logits = torch.zeros(len(drafts) + 1, vocab)
    masked = mask_verify_logits(logits, [matcher], [(drafts, 0)])
    allowed = [set(torch.nonzero(row > -torch.inf).flatten().tolist()) for row in masked]
    assert brace_quote in allowed[0] and name not in allowed[0]
    assert name in allowed[1] and forbidden not in allowed[1]
    assert after_name in allowed[2] and forbidden not in allowed[2]
    assert allowed[3] == allowed[2]
    row = new_bitmask(1, vocab)
    matcher.fill(row[0])
    assert _allowed(row, vocab) == allowed[0]


def _allowed(bitmask: torch.Tensor, vocab: int) -> set[int]:
    masked = apply_bitmask(torch.zeros(1, vocab), bitmask)
    return set(torch.nonzero(masked[0] > -torch.inf).flatten().tolist())


def test_forbidden_draft_is_rejected_by_acceptance(default_llm):
    from engine.sampling.sampler import sample
    from spec.runtime.acceptance import accept_on_host
    from spec.runtime.tree import DraftTree

    tokenizer = default_llm.tokenizer
    matcher = _matcher(default_llm, SCHEMAS[0])
    matcher.wait(30)
    vocab = default_llm.engine.runner.model_config.vocab_size
    forbidden = tokenizer.convert_tokens_to_ids("}")  # the answer must start with `{"`
    # A target that loves the forbidden token everywhere: the mask still wins.
    logits = torch.zeros(2, vocab)
    logits[:, forbidden] = 50.0
    masked = mask_verify_logits(logits, [matcher], [([forbidden], 0)])
    (greedy,) = accept_on_host([DraftTree.chain([forbidden])], [masked.argmax(-1).tolist()])
    assert greedy.num_accepted == 0 and greedy.tokens[0] != forbidden
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0)
    draws = sample(masked, [params] * 2, [generator, generator], generator).tolist()
    (sampled,) = accept_on_host([DraftTree.chain([forbidden])], [draws])
    assert sampled.num_accepted == 0 and sampled.tokens[0] != forbidden


def test_compilation_is_cached_per_schema(default_llm):
    config = default_llm.engine.runner.model_config
    compiler = GrammarCompiler(default_llm.tokenizer, config.vocab_size, config.eos_token_ids)
    grammar = json_schema_grammar(SCHEMAS[0], "response_format")
    first, second = compiler.start(grammar), compiler.start(grammar)
    assert first._compiled is second._compiled
    other = compiler.start(json_schema_grammar(SCHEMAS[1], "response_format"))
    assert other._compiled is not first._compiled
    # Each request advances its own copy of the compiled grammar.
    first.wait(30)
    first.advance(default_llm.tokenizer.convert_tokens_to_ids("{"))
    vocab = config.vocab_size
    rows = new_bitmask(2, vocab)
    first.fill(rows[0])
    second.fill(rows[1])
    assert not torch.equal(rows[0], rows[1])


def test_a_grammar_that_does_not_compile_fails_its_request_only(default_llm):
    engine = default_llm.engine
    prompt = default_llm.tokenizer.encode("Hello")
    bad = engine.make_request("bad", prompt, SamplingParams(max_tokens=4, grammar="start: nope"))
    good = engine.make_request("good", prompt, SamplingParams(max_tokens=4, temperature=0))
    engine.add_request(bad)
    engine.add_request(good)
    while engine.has_work():
        engine.step()
    assert bad.finish_reason == "error" and "grammar" in (bad.error or "")
    assert good.finish_reason == "length"


def test_request_commit_advances_the_grammar(default_llm):
    matcher = _matcher(default_llm, {"const": 7})
    req = Request("r", [1], SamplingParams(max_tokens=4))
    req.grammar = matcher
    seven = default_llm.tokenizer.encode("7")
    for token in seven:
        req.commit(token)
    assert req.output_token_ids == seven and matcher.finished


DIGIT_OBJECT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x"],
    "additionalProperties": False,
}


def _digit_answers(llm: LLM, **extra) -> list[tuple]:
    """(the answer, the answer with `extra` in its params) to "Give x as JSON." under
    DIGIT_OBJECT, greedy then sampled."""
    prompt = llm.apply_chat_template([{"role": "user", "content": "Give x as JSON."}])
    grammar = json_schema_grammar(DIGIT_OBJECT, "response_format")
    pairs = []
    for temperature in (0.0, 0.8):
        ask = dict(max_tokens=30, temperature=temperature, seed=1, grammar=grammar)
        [free] = llm.generate(prompt, SamplingParams(**ask))
        [constrained] = llm.generate(prompt, SamplingParams(**ask, **extra))
        pairs.append((free, constrained))
    return pairs


@pytest.mark.parametrize("llm_name", ["default_llm", "speculative_llm"])
def test_a_complete_grammar_ends_the_answer_before_min_tokens(request, llm_name):
    """Once the JSON is complete the grammar allows end-of-sequence only, which min_tokens
    still bans: the grammar wins, and the answer ends there as it would without min_tokens
    (not padded with tokens no mask allowed), greedy and sampled, with speculation too."""
    llm = request.getfixturevalue(llm_name)
    eos = llm.engine.runner.model_config.eos_token_ids
    for free, bounded in _digit_answers(llm, min_tokens=20):
        assert bounded.finish_reason == "stop" and bounded.token_ids[-1] in eos
        assert len(bounded.token_ids) < 20
        assert bounded.token_ids == free.token_ids
        jsonschema.validate(json.loads(bounded.text), DIGIT_OBJECT)


@pytest.mark.parametrize("llm_name", ["default_llm", "speculative_llm"])
def test_ignore_eos_ends_the_answer_where_the_grammar_ends(request, llm_name):
    """ignore_eos lets generation go past end-of-sequence, but a grammar that took its end
    allows nothing more: the answer stops there, with the end-of-sequence token, the answer
    it gives without ignore_eos, rather than repeating that token up to max_tokens."""
    llm = request.getfixturevalue(llm_name)
    eos = llm.engine.runner.model_config.eos_token_ids
    for free, ignoring in _digit_answers(llm, ignore_eos=True):
        assert ignoring.finish_reason == "stop" and ignoring.token_ids[-1] in eos
        assert ignoring.token_ids == free.token_ids
        jsonschema.validate(json.loads(ignoring.text), DIGIT_OBJECT)
