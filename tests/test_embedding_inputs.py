"""Inputs given as embeddings: a request may give vectors for some prompt positions in place of
their tokens' embeddings. The target reads them, speculation stays lossless, the draft's prefill
reads the target's input rows at those positions (not the placeholder ids' embeddings), also
after a preemption re-prefills the request, and the HTTP extension gives what LLM.generate
gives. Bad vectors are refused at the boundary."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from tiny_drafts import make_good_draft, make_predictable_llama

from cluster.control.local_backend import LocalBackend
from cluster.frontend.openai_api import create_app
from engine import LLM, RequestRejectedError, SamplingParams
from engine.executor.prompt_embeds import InputEmbeds, PromptEmbeds

SPEC = "multi-layer-eagle"
MAX_K = 3
HIDDEN = 64
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.Tensor]:
    """(target, good draft, the target's embedding table)."""
    root = tmp_path_factory.mktemp("embedding_inputs")
    hf = make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "draft", root / "target", MAX_K, noise=0.01)
    return root / "target", root / "draft", hf.model.embed_tokens.weight.detach().clone()


def _llm(models, k: int | None = None, **kw) -> LLM:
    target, draft, _ = models
    kw.setdefault("kv_cache_tokens", 4096)
    if k is not None:
        kw.update(speculative_algorithm=SPEC, draft_model=str(draft), num_draft_steps=k)
    return LLM(str(target), device="cpu", **kw)


@pytest.fixture(scope="module")
def plain(models) -> LLM:
    return _llm(models)


def _unit_rms(seed: int) -> torch.Tensor:
    vector = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed))
    return vector / vector.pow(2).mean().sqrt()


def _workload(table: torch.Tensor) -> tuple[list[list[int]], list[dict | None]]:
    """Three prompts: vectors in the middle and at the end (another token's embedding, random
    vectors), none at all, and one at position 0 and the end."""
    prompts = [list(range(10, 40)), list(range(100, 117)), [5, 250, 251, 252, 253, 7, 8, 9]]
    embeds = [
        {4: table[200].clone(), 11: _unit_rms(1), 12: _unit_rms(2), 29: table[77].clone()},
        None,
        {0: _unit_rms(3), 3: table[31].clone(), 7: _unit_rms(4)},
    ]
    return prompts, embeds


def _assert_clean(llm: LLM) -> None:
    assert not llm.engine.has_work()
    assert llm.engine.kv_cache.is_empty()
    assert llm.engine.speculator is None or llm.engine.speculator.is_empty()


@pytest.mark.parametrize("k", [2, 3])
def test_speculative_output_equals_plain_output(models, plain, k: int):
    prompts, embeds = _workload(models[2])
    expected = plain.generate(prompts, GREEDY, prompt_embeds=embeds)
    placeholders = plain.generate(prompts, GREEDY)
    llm = _llm(models, k)
    outputs = llm.generate(prompts, GREEDY, prompt_embeds=embeds)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    # The vectors are really read: the placeholder ids' own embeddings answer otherwise.
    assert expected[0].token_ids != placeholders[0].token_ids
    assert expected[2].token_ids != placeholders[2].token_ids
    assert expected[1].token_ids == placeholders[1].token_ids
    assert all(o.usage.spec_verify_steps for o in outputs)
    _assert_clean(llm)


def _record_draft_inputs(llm: LLM) -> list[list[torch.Tensor]]:
    """Per depth, the embeddings each forward of that depth read (its enorm's input)."""
    calls: list[list[torch.Tensor]] = []
    for runner in llm.engine.speculator.depths:
        calls.append([])

        def hook(module, args, output, seen=calls[-1]) -> None:
            seen.append(args[0].clone())

        runner.module.enorm.register_forward_hook(hook)
    return calls


def test_every_depth_reads_the_given_vectors(models):
    """Depth d at position i reads token x_{i+d+1}: in the prefill's draft extend, its row
    p-d-1 must be exactly the vector given for position p, and every other row the embedding
    of the token there."""
    table = models[2]
    prompts, embeds = _workload(table)
    llm = _llm(models, MAX_K)
    calls = _record_draft_inputs(llm)
    outputs = llm.generate(prompts, GREEDY, prompt_embeds=embeds)
    for depth, seen in enumerate(calls):
        prefill = seen[0]  # one batch: every request's positions [0, n), in order
        assert prefill.shape[0] == sum(len(p) for p in prompts)
        offset = 0
        for prompt, given, out in zip(prompts, embeds, outputs):
            tokens = prompt + out.token_ids
            rows = prefill[offset : offset + len(prompt)]
            offset += len(prompt)
            for i, row in enumerate(rows):
                position = i + depth + 1
                if given is not None and position in given:
                    assert torch.equal(row, given[position]), (depth, position)
                    assert not torch.equal(row, table[tokens[position]])
                elif position <= len(prompt):  # beyond x_n: this extend's drafts
                    assert torch.equal(row, table[tokens[position]]), (depth, position)


def test_preemption_reprefill_reads_the_vectors_again(models, plain):
    table = models[2]
    prompts, embeds = _workload(table)
    prompts, embeds = prompts * 2, embeds * 2
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(prompts, params, prompt_embeds=embeds)]
    llm = _llm(models, MAX_K, kv_cache_tokens=180, max_num_seqs=6)
    engine, worker = llm.engine, llm.engine.speculator
    received: dict[str, list[InputEmbeds | None]] = {}
    extend_prefill = worker.draft_extend_prefill

    def recording(requests, hidden, input_embeds=None, prompt_sources=None):
        for req, rows in zip(requests, input_embeds or [None] * len(requests)):
            received.setdefault(req.request_id, []).append(rows)
        return extend_prefill(requests, hidden, input_embeds, prompt_sources)

    worker.draft_extend_prefill = recording
    requests = [
        engine.make_request(str(i), p, params, prompt_embeds=PromptEmbeds.of(e) if e else None)
        for i, (p, e) in enumerate(zip(prompts, embeds))
    ]
    for req in requests:
        engine.add_request(req)
    while engine.has_work():
        engine.step()
    assert [req.output_token_ids for req in requests] == expected
    preempted = [req for req in requests if req.num_preemptions and embeds[int(req.request_id)]]
    assert preempted, "the pool is meant to be too small for all of them"
    for req in preempted:
        given = embeds[int(req.request_id)]
        assert len(received[req.request_id]) == 1 + req.num_preemptions
        for rows in received[req.request_id]:
            assert rows.mask.nonzero().flatten().tolist() == sorted(given)
            for position, vector in given.items():
                assert torch.equal(rows.values[position], vector)
    _assert_clean(llm)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({3: [0.5] * 32}, "hidden size is 64"),
        ({30: [0.5] * HIDDEN}, "position 30 is outside the prompt of 30 tokens"),
        ({-1: [0.5] * HIDDEN}, "position -1 is outside"),
        ({2: [math.nan] + [0.5] * (HIDDEN - 1)}, "position 2 is not finite"),
        ({2: [math.inf] * HIDDEN}, "position 2 is not finite"),
        ({2: ["a"] * HIDDEN}, "list of numbers"),
        ({2: [0.5] * HIDDEN, 3: [0.5] * (HIDDEN - 1)}, "has 63 values"),
        ({}, "empty"),
    ],
)
def test_bad_vectors_are_refused_before_anything_runs(plain, given, message: str):
    prompts = [list(range(10, 40)), list(range(10, 20))]
    with pytest.raises(RequestRejectedError, match=message):
        plain.generate(prompts, GREEDY, prompt_embeds=[given, None])
    assert not plain.engine.has_work()


def test_malformed_prompt_embeds_arguments(plain):
    vector = [0.5] * HIDDEN
    with pytest.raises(RequestRejectedError, match="position 1 twice"):
        PromptEmbeds.of([(1, vector), (1, vector)])
    with pytest.raises(ValueError, match="2 prompt_embeds for 1 prompts"):
        plain.generate([3, 4, 5], GREEDY, prompt_embeds=[{0: vector}, None])
    with pytest.raises(RequestRejectedError, match="one non-empty vector"):
        plain.generate([3, 4, 5], GREEDY, prompt_embeds={0: torch.ones(2, HIDDEN)})
    assert not plain.engine.has_work()


# ---- the HTTP extension ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(models):
    backend = LocalBackend(_llm(models, 2), model_name="tiny")
    with TestClient(create_app(backend)) as client:
        yield client
    backend.close()


def _wire(given: dict[int, torch.Tensor]) -> list[dict]:
    return [{"position": p, "embedding": v.tolist()} for p, v in given.items()]


def test_http_extension_gives_what_generate_gives(models, plain, client):
    prompts, embeds = _workload(models[2])
    text = "Hello, embeddings!"
    text_embeds = {1: models[2][42].clone(), len(plain.tokenizer.encode(text)) - 1: _unit_rms(9)}
    cases = [(prompts[0], embeds[0]), (prompts[2], embeds[2]), (text, text_embeds)]
    for prompt, given in cases:
        expected = plain.generate(prompt, GREEDY, prompt_embeds=given)[0]
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        response = client.post("/v1/completions", json=body | {"prompt_embeds": _wire(given)})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["token_ids"] == expected.token_ids
        assert response.json()["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)


@pytest.mark.parametrize(
    ("prompt_embeds", "message"),
    [
        ([{"position": 1, "embedding": [0.5] * 8}], "hidden size is 64"),
        ([{"position": 9, "embedding": [0.5] * HIDDEN}], "position 9 is outside the prompt"),
        ([{"position": 1, "embedding": ["x"] * HIDDEN}], "valid number"),
        ([{"position": "1", "embedding": [0.5] * HIDDEN}], "valid integer"),
        ([{"position": 1, "embedding": [math.nan] * HIDDEN}], "not finite"),
        ([{"position": 1, "embedding": [0.5] * HIDDEN}] * 2, "position 1 twice"),
        ([{"position": 1}], "embedding"),
    ],
)
def test_http_extension_refuses_bad_vectors(client, prompt_embeds, message: str):
    body = {"prompt": list(range(10, 19)), "max_tokens": 4, "prompt_embeds": prompt_embeds}
    # json.dumps writes NaN as Python's json module reads it (httpx refuses to).
    headers = {"content-type": "application/json"}
    response = client.post("/v1/completions", content=json.dumps(body), headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"]
    assert "prompt_embeds" in (error["param"] or error["message"])
