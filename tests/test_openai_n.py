"""Several choices per request through the official `openai` client: `n` samples of a prompt,
each with its own seed stream, and batched prompts, indexed prompt-major as OpenAI does, in
full and streamed answers with usage summed; penalties and biases through the API. Over a
LocalBackend and over the disaggregated cluster, both giving the offline engine's tokens."""

from __future__ import annotations

import json

import openai
import pytest
from cluster_helpers import launch, serve
from conftest import TINY_BACKEND_MODEL
from tiny_models import make_tiny_llama

from cluster.frontend.openai_api import BackgroundServer, create_app
from engine import LLM, SamplingParams

PROMPTS = ["hello there", "a", "the quick brown fox", "1 2 3 4"]
PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.6)
EXTENSIONS = dict(repetition_penalty=1.4, min_tokens=3, stop_token_ids=[7])
BIAS = {"77": 2.5, "101": -100}


def _offline_params(**fields) -> SamplingParams:
    bias = {int(k): v for k, v in fields.pop("logit_bias", {}).items()}
    return SamplingParams(logit_bias=bias, **fields)


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


@pytest.fixture(scope="module")
def local(backend):
    with BackgroundServer(create_app(backend)) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def local_offline(tiny_model_path) -> LLM:
    """The engine the `backend` fixture wraps, built alike (outputs do not depend on the pool
    size for greedy and seeded requests)."""
    return LLM(str(tiny_model_path), device="cpu", max_model_len=256, kv_cache_tokens=2048)


def test_n_gives_distinct_choices_that_a_seed_reproduces(local, local_offline):
    ask = dict(model=TINY_BACKEND_MODEL, max_tokens=12, temperature=1.0, seed=42)
    first = local.completions.create(prompt=PROMPTS[0], n=3, **ask)
    again = local.completions.create(prompt=PROMPTS[0], n=3, **ask)
    assert [c.index for c in first.choices] == [0, 1, 2]
    tokens = [_ids(c) for c in first.choices]
    assert tokens == [_ids(c) for c in again.choices]
    assert len({tuple(t) for t in tokens}) == 3
    # Sample 0 is the request with n=1; the others are the offline engine's samples.
    alone = local.completions.create(prompt=PROMPTS[0], n=1, **ask)
    assert _ids(alone.choices[0]) == tokens[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=42, n=3)
    assert [o.token_ids for o in local_offline.generate(PROMPTS[0], params)] == tokens
    assert first.usage.completion_tokens == sum(len(t) for t in tokens)
    assert first.usage.prompt_tokens == len(local_offline.tokenizer.encode(PROMPTS[0]))


def test_the_local_backends_samples_share_one_prefill(local, backend):
    """The n samples of a prompt prefill it once (EngineCore.add_samples)."""
    engine = backend.engine
    prompt_len = len(backend.tokenizer.encode(PROMPTS[2]))
    before = engine.prefill_tokens
    ask = dict(model=TINY_BACKEND_MODEL, max_tokens=10, temperature=0.8, seed=5)
    answer = local.completions.create(prompt=PROMPTS[2], n=4, **ask)
    assert len(answer.choices) == 4
    assert engine.prefill_tokens - before == prompt_len


def test_chat_n_gives_indexed_choices(local):
    answer = local.chat.completions.create(
        model=TINY_BACKEND_MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=5,
    )
    assert [c.index for c in answer.choices] == [0, 1]
    assert _ids(answer.choices[0]) != _ids(answer.choices[1])
    assert answer.usage.completion_tokens == sum(len(_ids(c)) for c in answer.choices)


def test_a_batch_of_prompts_answers_in_order(local, local_offline):
    answer = local.completions.create(
        model=TINY_BACKEND_MODEL, prompt=PROMPTS, max_tokens=8, temperature=0
    )
    expected = local_offline.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0))
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert [_ids(c) for c in answer.choices] == [o.token_ids for o in expected]
    assert [c.text for c in answer.choices] == [o.text for o in expected]
    assert answer.usage.prompt_tokens == sum(o.usage.prompt_tokens for o in expected)
    assert answer.usage.completion_tokens == sum(o.usage.completion_tokens for o in expected)
    token_prompts = [local_offline.tokenizer.encode(p) for p in PROMPTS[:2]]
    by_ids = local.completions.create(
        model=TINY_BACKEND_MODEL, prompt=token_prompts, max_tokens=8, temperature=0
    )
    assert [_ids(c) for c in by_ids.choices] == [o.token_ids for o in expected[:2]]


def test_n_times_a_batch_is_prompt_major(local, local_offline):
    ask = dict(model=TINY_BACKEND_MODEL, max_tokens=8, temperature=0.9, seed=9)
    answer = local.completions.create(prompt=PROMPTS[:2], n=2, **ask)
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=9, n=2)
    expected = local_offline.generate(PROMPTS[:2], params)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert [_ids(c) for c in answer.choices] == [o.token_ids for o in expected]
    assert answer.usage.prompt_tokens == sum(
        len(local_offline.tokenizer.encode(p)) for p in PROMPTS[:2]
    )


def test_a_stream_interleaves_every_choice_and_sums_usage(local):
    ask = dict(model=TINY_BACKEND_MODEL, max_tokens=10, temperature=0.9, seed=3)
    whole = local.completions.create(prompt=PROMPTS[:2], n=2, **ask)
    stream = local.completions.create(
        prompt=PROMPTS[:2], n=2, stream=True, stream_options={"include_usage": True}, **ask
    )
    texts: dict[int, str] = {}
    tokens: dict[int, list[int]] = {}
    finished: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            tokens.setdefault(choice.index, []).extend(_ids(choice))
            if choice.finish_reason is not None:
                assert choice.index not in finished
                finished[choice.index] = choice.finish_reason
    assert sorted(finished) == [0, 1, 2, 3]
    assert [tokens[i] for i in range(4)] == [_ids(c) for c in whole.choices]
    assert [texts[i] for i in range(4)] == [c.text for c in whole.choices]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_stream_gives_each_choice_its_role(local):
    stream = local.chat.completions.create(
        model=TINY_BACKEND_MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        n=3,
        max_tokens=4,
        temperature=1.0,
        seed=1,
        stream=True,
    )
    roles = {}
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role is not None:
                roles[choice.index] = choice.delta.role
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}


def test_penalties_and_biases_through_the_api_equal_the_offline_engine(local, local_offline):
    fields = dict(max_tokens=12, temperature=0.8, seed=11, **PENALTIES, logit_bias=BIAS)
    answer = local.completions.create(
        model=TINY_BACKEND_MODEL, prompt=PROMPTS, extra_body=EXTENSIONS, **fields
    )
    expected = local_offline.generate(PROMPTS, _offline_params(**fields, **EXTENSIONS))
    assert [_ids(c) for c in answer.choices] == [o.token_ids for o in expected]
    plain = local_offline.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.8, seed=11))
    assert [o.token_ids for o in expected] != [o.token_ids for o in plain]


def test_logit_bias_forces_a_token_through_the_api(local):
    answer = local.completions.create(
        model=TINY_BACKEND_MODEL, prompt="x", max_tokens=5, temperature=0.7, logit_bias={"88": 100}
    )
    assert _ids(answer.choices[0]) == [88] * 5


def test_tools_are_refused_by_name_on_completions(local):
    for field, value in (("tools", [{"x": 1}]), ("tool_choice", "auto")):
        with pytest.raises(openai.BadRequestError) as refused:
            local.completions.create(
                model=TINY_BACKEND_MODEL, prompt="x", max_tokens=2, extra_body={field: value}
            )
        assert refused.value.body["param"] == field


# ---- the disaggregated cluster -------------------------------------------------------------

ENGINE = dict(max_model_len=256, kv_cache_tokens=2048, max_num_seqs=16)


@pytest.fixture(scope="module")
def cluster_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-n")
    make_tiny_llama(path)
    return str(path)


@pytest.fixture(scope="module")
def remote(cluster_model):
    pytest.importorskip("ray")
    cluster = launch(cluster_model, prefill=1, decode=1, **ENGINE)
    server = serve(cluster)
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    server.stop()
    cluster.shutdown()


def test_the_cluster_gives_the_offline_engines_choices(remote, cluster_model):
    offline = LLM(cluster_model, device="cpu", **ENGINE)
    model = remote.models.list().data[0].id
    fields = dict(max_tokens=10, temperature=0.9, seed=21, **PENALTIES, logit_bias=BIAS)
    answer = remote.completions.create(
        model=model, prompt=PROMPTS[:2], n=2, extra_body=EXTENSIONS, **fields
    )
    expected = offline.generate(PROMPTS[:2], _offline_params(n=2, **fields, **EXTENSIONS))
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert [_ids(c) for c in answer.choices] == [o.token_ids for o in expected]
    greedy = dict(max_tokens=10, temperature=0, repetition_penalty=1.8)
    answer = remote.completions.create(
        model=model,
        prompt=PROMPTS,
        max_tokens=10,
        temperature=0,
        extra_body={"repetition_penalty": 1.8},
    )
    expected = offline.generate(PROMPTS, SamplingParams(**greedy))
    assert [_ids(c) for c in answer.choices] == [o.token_ids for o in expected]
    streamed = remote.completions.create(
        model=model, prompt=PROMPTS[:2], n=2, stream=True, extra_body=EXTENSIONS, **fields
    )
    indices = {c.index for chunk in streamed for c in chunk.choices if c.finish_reason}
    assert indices == {0, 1, 2, 3}
    assert json.loads(answer.model_dump_json())["usage"]["completion_tokens"] == sum(
        len(o.token_ids) for o in expected
    )


def test_the_python_client_sends_penalties_and_biases(backend, local_offline):
    from cluster.client import Client

    fields = dict(max_tokens=10, temperature=0.7, seed=13, **PENALTIES, **EXTENSIONS)
    with BackgroundServer(create_app(backend)) as server, Client(server.url) as client:
        out = client.generate(PROMPTS[2], logit_bias={77: 2.5, 101: -100}, **fields)
    params = SamplingParams(logit_bias={77: 2.5, 101: -100}, **fields)
    assert out.token_ids == local_offline.generate(PROMPTS[2], params)[0].token_ids
