"""Request handling: rejections with a reason, continuous batching under preemption, output
order and usage, and chat templates."""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest
import torch

from engine import LLM, RequestRejectedError, SamplingParams
from engine.request import Request

VOCAB_SIZE = 320  # tiny_models.TINY_DEFAULTS


def _assert_nothing_ran(llm: LLM) -> None:
    assert not llm.engine.has_work()
    assert llm.engine.kv_cache.is_empty()


# --- rejections ----------------------------------------------------------------------------------


def test_rejected_request_is_a_value_error() -> None:
    assert issubclass(RequestRejectedError, ValueError)


def test_prompt_plus_max_tokens_over_context_is_rejected(tiny_model_path: Path) -> None:
    llm = LLM(str(tiny_model_path), device="cpu", max_model_len=32, max_num_seqs=2)
    with pytest.raises(RequestRejectedError, match="context") as error:
        llm.generate([list(range(3, 24))], SamplingParams(max_tokens=12))  # 21 + 12 = 33
    assert "33" in str(error.value) and "32" in str(error.value)
    _assert_nothing_ran(llm)


def test_prompt_plus_max_tokens_over_kv_cache_is_rejected(tiny_model_path: Path) -> None:
    llm = LLM(str(tiny_model_path), device="cpu", kv_cache_tokens=64, max_num_seqs=2)
    with pytest.raises(RequestRejectedError, match="KV cache") as error:
        llm.generate([list(range(3, 53))], SamplingParams(max_tokens=15))  # 50 + 15 = 65
    assert "64" in str(error.value)
    _assert_nothing_ran(llm)
    # One token less fits exactly, and runs.
    out = llm.generate([list(range(3, 53))], SamplingParams(max_tokens=14, ignore_eos=True))
    assert len(out[0].token_ids) == 14


@pytest.mark.parametrize("prompt", ["", [[]]], ids=["empty-string", "empty-token-list"])
def test_empty_prompt_is_rejected(tiny_llm: LLM, prompt: object) -> None:
    with pytest.raises(RequestRejectedError, match="empty"):
        tiny_llm.generate(prompt, SamplingParams(max_tokens=4))
    _assert_nothing_ran(tiny_llm)


@pytest.mark.parametrize("bad_token", [VOCAB_SIZE, VOCAB_SIZE + 100, -1])
def test_token_id_outside_vocab_is_rejected(tiny_llm: LLM, bad_token: int) -> None:
    with pytest.raises(RequestRejectedError, match=rf"token ids.*{VOCAB_SIZE}"):
        tiny_llm.generate([[5, 6, bad_token, 7]], SamplingParams(max_tokens=4))
    _assert_nothing_ran(tiny_llm)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_params_are_rejected(kwargs: dict, name: str) -> None:
    with pytest.raises(RequestRejectedError, match=name):
        SamplingParams(**kwargs)


def test_every_problem_of_sampling_params_is_named() -> None:
    with pytest.raises(RequestRejectedError) as error:
        SamplingParams(max_tokens=0, temperature=-1.0, top_p=2.0)
    message = str(error.value)
    assert all(name in message for name in ("max_tokens", "temperature", "top_p"))


def test_boundary_sampling_params_are_accepted() -> None:
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, logprobs=20)
    SamplingParams(top_p=1e-6, logprobs=0)


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": float("nan")}, {"top_k": 2.5}],
    ids=["nan-temperature", "fractional-top_k"],
)
def test_unusable_sampling_params_are_refused_before_running(
    tiny_model_path: Path, kwargs: dict
) -> None:
    """Parameters the sampler cannot use must be refused up front, not fail inside a step after
    the request took KV slots (own engine: a failure here would leak slots of the shared one)."""
    llm = LLM(str(tiny_model_path), device="cpu", kv_cache_tokens=256, max_num_seqs=2)
    with pytest.raises(RequestRejectedError, match=next(iter(kwargs))):
        llm.generate("Hello", SamplingParams(max_tokens=4, **kwargs))
    _assert_nothing_ran(llm)


@pytest.mark.parametrize("count", [1, 3])
def test_sampling_params_list_of_wrong_length(tiny_llm: LLM, count: int) -> None:
    with pytest.raises(ValueError, match="SamplingParams"):
        tiny_llm.generate(["ab", "cd"], [SamplingParams(max_tokens=2)] * count)
    _assert_nothing_ran(tiny_llm)


def test_one_rejected_request_means_nothing_ran(tiny_llm: LLM, tiny_model_path: Path) -> None:
    llm = LLM(str(tiny_model_path), device="cpu", max_model_len=64, max_num_seqs=4)
    prompts = [[5, 6, 7], list(range(3, 63)), [8, 9]]  # the middle one cannot fit 60 + 10
    with pytest.raises(RequestRejectedError, match="context"):
        llm.generate(prompts, SamplingParams(max_tokens=10))
    _assert_nothing_ran(llm)
    # The engine is still usable, and unaffected by the refused batch.
    good = [prompts[0], prompts[2]]
    params = SamplingParams(max_tokens=10, seed=3, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(good, params)] == [
        o.token_ids for o in tiny_llm.generate(good, params)
    ]


# --- continuous batching and preemption ----------------------------------------------------------


def _varied_prompts(count: int = 12) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 60, 23, 41, 9, 52, 31, 17, 47, 12, 36, 27][:count]
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist() for n in lengths]


def _drive(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
    """Run requests through the engine's step loop, keeping the Request objects."""
    engine = llm.engine
    requests = [engine.make_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    for req in requests:
        engine.add_request(req)
    max_running = 0
    while engine.has_work():
        engine.step()
        max_running = max(max_running, len(engine.scheduler.running))
        assert max_running <= llm.config.max_num_seqs
        engine.kv_cache.kv_pool.allocator.check_integrity()
    assert all(req.finished for req in requests)
    return requests


def test_preemption_gives_the_same_tokens(tiny_llm: LLM, tiny_model_path: Path) -> None:
    prompts = _varied_prompts()
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    small = LLM(str(tiny_model_path), device="cpu", kv_cache_tokens=128, max_num_seqs=4)
    assert small.config.kv_cache_tokens == 128

    preempted = _drive(small, prompts, params)
    batched = tiny_llm.generate(prompts, params)
    one_by_one = [tiny_llm.generate([p], params)[0] for p in prompts]

    assert sum(req.num_preemptions for req in preempted) >= 1
    assert small.engine.kv_cache.is_empty()
    assert not small.engine.has_work()
    for i, req in enumerate(preempted):
        assert len(req.output_token_ids) == 40
        assert req.output_token_ids == batched[i].token_ids == one_by_one[i].token_ids, i
        assert small.engine.output(req).finish_reason == "length"
    assert tiny_llm.engine.kv_cache.is_empty()


def test_preemption_keeps_seeded_sampling(tiny_llm: LLM, tiny_model_path: Path) -> None:
    prompts = _varied_prompts()
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=11, ignore_eos=True)
    small = LLM(str(tiny_model_path), device="cpu", kv_cache_tokens=128, max_num_seqs=4)
    preempted = _drive(small, prompts, params)
    assert sum(req.num_preemptions for req in preempted) >= 1
    batched = tiny_llm.generate(prompts, params)
    assert [req.output_token_ids for req in preempted] == [o.token_ids for o in batched]
    assert small.engine.kv_cache.is_empty()


def test_admission_does_not_force_a_preemption_on_the_next_decode(tiny_model_path: Path) -> None:
    """The scheduler reserves decode room when it admits a prompt, so the request it just
    prefilled is not thrown out (and its prefill wasted) on the very next step."""
    llm = LLM(str(tiny_model_path), device="cpu", kv_cache_tokens=64, max_num_seqs=2)
    engine = llm.engine
    long_answer = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = engine.make_request("first", list(range(3, 13)), long_answer)
    engine.add_request(first)
    engine.step()  # prefill: 10 of 64 slots taken
    # A prompt that fills the free slots but one: room for one decode token, not for two.
    second = engine.make_request(
        "second",
        list(range(3, 3 + engine.kv_cache.num_free_slots - 1)),
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
    )
    engine.add_request(second)
    while engine.has_work():
        engine.step()
    assert (first.num_preemptions, second.num_preemptions) == (0, 0)
    assert len(second.output_token_ids) == 5 and len(first.output_token_ids) == 40
    assert engine.kv_cache.is_empty()


def test_a_prefill_step_admits_while_slots_and_reserve_last_in_one_row_table_write(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Admission takes the slots of every request it admits at once, after choosing them:
    each request still counts the slots of those admitted before it and the decode step each
    of them reserves, so 4 prompts of 12 tokens fit a pool of 64 (4 * 12 + 4 * 1 reserved)
    and a fifth waits; and the admitted requests' rows are written in one go."""
    llm = LLM(str(tiny_model_path), device="cpu", kv_cache_tokens=64, max_num_seqs=8)
    engine = llm.engine
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    requests = [engine.make_request(str(i), list(range(3, 15)), params) for i in range(5)]
    for req in requests:
        engine.add_request(req)
    pool = engine.kv_cache.req_to_token_pool
    writes = []
    write_runs = pool.write_runs
    monkeypatch.setattr(pool, "write_runs", lambda *args: writes.append(1) or write_runs(*args))
    batch = engine.scheduler.schedule()
    assert batch is not None and batch.is_prefill
    assert batch.requests == requests[:4] and list(engine.scheduler.waiting) == requests[4:]
    assert len(writes) == 1
    assert [len(req.slots) for req in requests] == [12, 12, 12, 12, 0]
    rows = pool.req_to_token[[req.row for req in requests[:4]], :12].tolist()
    assert rows == [req.slots for req in requests[:4]]
    monkeypatch.undo()
    engine._run(batch)  # the step that scheduled it
    while engine.has_work():
        engine.step()
    assert all(len(req.output_token_ids) == 2 and not req.num_preemptions for req in requests)
    assert engine.kv_cache.is_empty()


def test_outputs_in_input_order_with_their_own_usage(tiny_llm: LLM) -> None:
    prompts = _varied_prompts(6)
    # Long prompts with short answers and short prompts with long ones finish out of order.
    max_tokens = [3, 30, 7, 1, 22, 12]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
    # One request stops on its first token, well before its max_tokens.
    params[4] = SamplingParams(max_tokens=22, stop_token_ids=range(VOCAB_SIZE))
    completions = [3, 30, 7, 1, 1, 12]
    outputs = tiny_llm.generate(prompts, params)
    assert len(outputs) == len(prompts)
    assert len({o.request_id for o in outputs}) == len(prompts)
    for prompt, n, out in zip(prompts, completions, outputs):
        assert out.prompt_token_ids == prompt
        assert len(out.token_ids) == n
        assert out.usage.prompt_tokens == len(prompt)
        assert out.usage.completion_tokens == n
        assert out.usage.total_tokens == len(prompt) + n
        assert out.text == tiny_llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert outputs[4].finish_reason == "stop"


def test_string_and_token_prompts_agree(tiny_llm: LLM) -> None:
    text = "Tokens or text"
    params = SamplingParams(max_tokens=8, temperature=0)
    from_text = tiny_llm.generate(text, params)[0]
    from_tokens = tiny_llm.generate(tiny_llm.tokenizer.encode(text), params)[0]
    assert from_text.prompt_token_ids == tiny_llm.tokenizer.encode(text)
    assert from_text.token_ids == from_tokens.token_ids


# --- chat ----------------------------------------------------------------------------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_chat_applies_the_chat_template(tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiny_llm.tokenizer, "chat_template", CHAT_TEMPLATE, raising=False)
    conversations = [
        [{"role": "user", "content": "Hi there"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2?"},
        ],
    ]
    params = SamplingParams(max_tokens=6, temperature=0)
    outputs = tiny_llm.chat(conversations, params)
    assert len(outputs) == 2
    for conversation, out in zip(conversations, outputs):
        rendered = jinja2.Template(CHAT_TEMPLATE).render(
            messages=conversation, add_generation_prompt=True
        )
        assert rendered.endswith("<|assistant|>")
        expected = tiny_llm.tokenizer.encode(rendered, add_special_tokens=False)
        assert out.prompt_token_ids == expected
        assert len(expected) == len(rendered.encode())  # one token per byte
        assert out.token_ids == tiny_llm.generate([expected], params)[0].token_ids

    single = tiny_llm.chat(conversations[1], params)
    assert len(single) == 1 and single[0].prompt_token_ids == outputs[1].prompt_token_ids
