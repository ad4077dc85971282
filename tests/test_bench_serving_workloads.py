"""`pdcluster bench serving`'s prefix-reuse workloads: shared-prefix (groups of random questions
sharing a random system prompt) and multiturn (the built-in conversations replayed turn by turn,
each turn carrying the server's own answers so far), the cached share of prompt tokens where a
server reports `prompt_tokens_details.cached_tokens`, and both workloads against the project's
own HTTP server over a tiny engine."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from tiny_models import CHAT_TEMPLATE, byte_tokenizer, make_tiny_llama

from cluster.bench_serving.chat_conversations import CONVERSATIONS
from cluster.bench_serving.cli import add_bench_serving_args, run_bench_serving
from cluster.bench_serving.client import Target, open_http_client, send_request
from cluster.bench_serving.conversation_runner import run_conversations
from cluster.bench_serving.datasets import (
    BenchRequest,
    ConversationScript,
    DatasetSpec,
    load_requests,
    multiturn_scripts,
)
from cluster.bench_serving.metrics import Slo, summarize
from cluster.bench_serving.report import format_summaries
from cluster.bench_serving.results import Outcome, RequestResult, RunResult
from cluster.bench_serving.stream_events import parse_stream_line
from cluster.frontend.openai_api import BackgroundServer, create_app
from engine import LLM


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# ---- shared-prefix -------------------------------------------------------------------------


SHARED = dict(groups=3, prompts_per_group=4, system_len=40, question_len=10, output_len=7)


def shared_prefix(tokenizer, seed: int = 0) -> list[BenchRequest]:
    return load_requests(DatasetSpec("shared-prefix", 12, seed=seed, **SHARED), tokenizer)


def test_shared_prefix_groups_share_their_system_prompt(tokenizer):
    requests = shared_prefix(tokenizer)
    assert len(requests) == 12
    systems = [r.messages[0].content for r in requests]
    assert [r.messages[0].role for r in requests] == ["system"] * 12
    assert sorted(systems.count(s) for s in set(systems)) == [4, 4, 4]
    assert len({r.messages[1].content for r in requests}) == 12  # every question its own
    for request in requests:
        system, question = (m.content for m in request.messages)
        assert len(encode(tokenizer, system)) == 40 and len(encode(tokenizer, question)) == 10
        assert request.prompt == f"{system}\n\n{question}" and request.output_len == 7
        assert request.prompt_len == len(encode(tokenizer, request.prompt))
    # The groups arrive interleaved, not one after another.
    first_seen = sorted(set(systems), key=systems.index)
    assert [first_seen.index(s) for s in systems] != sorted(first_seen.index(s) for s in systems)


def test_shared_prefix_is_the_same_for_a_seed(tokenizer):
    assert shared_prefix(tokenizer, seed=3) == shared_prefix(tokenizer, seed=3)
    assert shared_prefix(tokenizer, seed=3) != shared_prefix(tokenizer, seed=4)


def test_shared_prefix_sends_groups_times_prompts_per_group(tokenizer):
    with pytest.raises(ValueError, match="groups \\* prompts_per_group = 12"):
        load_requests(DatasetSpec("shared-prefix", 10, **SHARED), tokenizer)


# ---- multiturn scripts ---------------------------------------------------------------------


def test_multiturn_scripts_replay_the_built_in_conversations(tokenizer):
    spec = DatasetSpec("multiturn", len(CONVERSATIONS) + 2, seed=1)
    scripts = multiturn_scripts(spec, tokenizer, np.random.default_rng(1))
    assert scripts == multiturn_scripts(spec, tokenizer, np.random.default_rng(1))
    assert scripts != multiturn_scripts(spec, tokenizer, np.random.default_rng(2))
    assert len({s.topic for s in scripts[: len(CONVERSATIONS)]}) == len(CONVERSATIONS)
    by_topic = {c.topic: c for c in CONVERSATIONS}
    for script in scripts:
        conversation = by_topic[script.topic]
        assert script.user_turns == conversation.turns[0::2]
        assert script.reference_answers == conversation.turns[1::2]
        answer_lens = [len(encode(tokenizer, a)) for a in script.reference_answers]
        assert script.output_lens == (*answer_lens, conversation.output_len)


def test_a_turn_carries_the_answers_it_is_given(tokenizer):
    script = ConversationScript("t", ("one", "two", "three"), ("a", "b"), (5, 6, 7))
    request = script.turn_request(2, ["first real", "second real"], tokenizer)
    assert request.chat_messages() == [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "first real"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "second real"},
        {"role": "user", "content": "three"},
    ]
    assert request.output_len == 7 and "Assistant: second real" in request.prompt
    assert script.turn_request(0, [], tokenizer).chat_messages() == [
        {"role": "user", "content": "one"}
    ]
    with pytest.raises(ValueError, match="turn 2 follows 2 answers, got 1"):
        script.turn_request(2, ["only one"], tokenizer)


def test_a_completion_turn_continues_the_previous_prompt_and_answer_exactly(tokenizer):
    """A server's answer to "...Assistant:" begins where that prompt ended: the next turn's
    transcript is that prompt and answer as they were, which a prefix cache then finds."""
    script = ConversationScript("t", ("one", "two"), ("a",), (5, 6))
    first = script.turn_request(0, [], tokenizer)
    answer = " The answer, as a server streams it."
    second = script.turn_request(1, [answer], tokenizer)
    assert second.prompt.startswith(first.prompt + answer + "\n\nUser: two")
    # A built-in answer, which begins with its first word, is set off by a space.
    assert "Assistant: a" in script.turn_request(1, ["a"], tokenizer).prompt


def test_multiturn_dataset_lists_every_turn_with_the_built_in_answers(tokenizer):
    spec = DatasetSpec("multiturn", 3)
    scripts = multiturn_scripts(spec, tokenizer, np.random.default_rng(0))
    requests = load_requests(spec, tokenizer)
    assert len(requests) == sum(len(s.user_turns) for s in scripts)
    last = requests[len(scripts[0].user_turns) - 1]
    assert last.messages[1].content == scripts[0].reference_answers[0]


# ---- the conversation runner ---------------------------------------------------------------


def scripts_of(turns: list[int]) -> list[ConversationScript]:
    return [
        ConversationScript(
            f"c{c}",
            tuple(f"c{c} question {t}" for t in range(n)),
            tuple(f"c{c} reference {t}" for t in range(n - 1)),
            (3,) * n,
        )
        for c, n in enumerate(turns)
    ]


def answered(index: int, text: str) -> RequestResult:
    return RequestResult(index, Outcome.COMPLETED, 0.0, 10, 3, 0.01, (), 0.02, output_text=text)


def replay(scripts, send, tokenizer, **options) -> RunResult:
    options = {"concurrency": 2, "show_progress": False} | options
    return asyncio.run(run_conversations(scripts, np.inf, send, tokenizer, **options))


def test_each_turn_carries_the_servers_previous_answers(tokenizer):
    sent: dict[int, list[dict]] = {}
    in_flight, most_in_flight = set(), [0]

    async def send(request: BenchRequest, index: int) -> RequestResult:
        in_flight.add(index)
        most_in_flight[0] = max(most_in_flight[0], len(in_flight))
        sent[index] = request.chat_messages()
        await asyncio.sleep(0.01)
        in_flight.discard(index)
        return answered(index, f"real answer {index}")

    scripts = scripts_of([3, 1, 2, 3])
    run = replay(scripts, send, tokenizer)
    assert run.scheduled == run.sent == 9 and not run.interrupted
    assert [r.index for r in run.results] == list(range(9))
    # Conversation 0 is turns 0-2, 1 is turn 3, 2 is turns 4-5, 3 is turns 6-8.
    assert [m["content"] for m in sent[2]] == [
        "c0 question 0", "real answer 0", "c0 question 1", "real answer 1", "c0 question 2",
    ]  # fmt: skip
    assert [m["content"] for m in sent[5] if m["role"] == "assistant"] == ["real answer 4"]
    assert [m["content"] for m in sent[8] if m["role"] == "assistant"] == [
        "real answer 6",
        "real answer 7",
    ]
    assert most_in_flight[0] == 2  # --concurrent-conversations


def test_turns_are_numbered_and_their_ttft_is_summarized_first_and_later_apart(tokenizer):
    async def send(request: BenchRequest, index: int) -> RequestResult:
        # Conversations are turns 0-2, 3, and 4-5: first turns take 0.5 s, later ones 0.1 s.
        ttft = 0.5 if index in (0, 3, 4) else 0.1
        return RequestResult(index, Outcome.COMPLETED, 0.0, 10, 3, ttft, (), 0.6, output_text="a")

    run = replay(scripts_of([3, 1, 2]), send, tokenizer)
    assert [r.turn for r in run.results] == [0, 1, 2, 0, 0, 1]
    summary = summarize(run, Slo())
    assert summary.first_turns_ttft_ms.p50 == pytest.approx(500)
    assert summary.later_turns_ttft_ms.p50 == pytest.approx(100)
    assert summary.to_json()["later_turns_ttft_ms"]["p50"] == pytest.approx(100)
    # Single requests have no turns: nothing is split.
    single = RunResult(np.inf, 1, 0.0, 1.0, [answered(0, "a")])
    assert "later_turns_ttft_ms" not in summarize(single, Slo()).to_json()


def test_a_conversation_keeps_its_place_between_its_turns(tokenizer):
    order = []

    async def send(request: BenchRequest, index: int) -> RequestResult:
        order.append(index)
        await asyncio.sleep(0.01)
        return answered(index, "fine")

    replay(scripts_of([2, 3]), send, tokenizer, concurrency=1)
    assert order == [0, 1, 2, 3, 4]  # the second conversation starts once the first ended


def test_a_turn_that_fails_ends_its_conversation(tokenizer):
    async def send(request: BenchRequest, index: int) -> RequestResult:
        if index == 1:
            return RequestResult(index, Outcome.FAILED, 0.0, 10, 0, error="400: too long")
        if index == 4:
            raise RuntimeError("bug in the sender")
        return answered(index, "fine")

    run = replay(scripts_of([3, 2]), send, tokenizer, concurrency=1)
    # Turn 2 of conversation 0 is never sent; conversation 1's second turn is (index 4).
    assert run.scheduled == 5 and [r.index for r in run.results] == [0, 1, 3, 4]
    assert [r.outcome for r in run.results] == [Outcome.COMPLETED, Outcome.FAILED] * 2
    assert "bug in the sender" in run.results[3].error


def test_an_interrupted_replay_counts_turns_in_flight_as_lost(tokenizer):
    started = asyncio.Event()

    async def send(request: BenchRequest, index: int) -> RequestResult:
        if index == 0:
            return answered(index, "done")
        started.set()
        await asyncio.Event().wait()  # a generation that never ends

    async def scenario() -> RunResult:
        run = asyncio.create_task(
            run_conversations(
                scripts_of([2, 2, 2]), np.inf, send, tokenizer, concurrency=2, show_progress=False
            )  # fmt: skip
        )
        await asyncio.wait_for(started.wait(), timeout=10)
        await asyncio.sleep(0.05)
        run.cancel()
        return await run

    run = asyncio.run(scenario())
    assert run.interrupted and run.scheduled == 6
    # Conversation 2 waited for a place and sent nothing.
    assert [(r.index, r.outcome) for r in run.results] == [
        (0, Outcome.COMPLETED), (1, Outcome.LOST), (2, Outcome.LOST),
    ]  # fmt: skip
    assert all("interrupted" in r.error for r in run.results[1:])


# ---- cached prompt tokens ------------------------------------------------------------------


def test_cached_tokens_are_read_from_usage_and_reported_as_a_share():
    usage = parse_stream_line(
        'data: {"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 3, '
        '"prompt_tokens_details": {"cached_tokens": 40}}}'
    ).usage
    assert usage.cached_tokens == 40
    plain = parse_stream_line('data: {"choices": [], "usage": {"prompt_tokens": 5}}').usage
    assert plain.cached_tokens is None
    results = [
        RequestResult(0, Outcome.COMPLETED, 0.0, 100, 3, 0.01, (), 0.02, cached_tokens=0),
        RequestResult(1, Outcome.COMPLETED, 0.0, 100, 3, 0.01, (), 0.02, cached_tokens=60),
        RequestResult(2, Outcome.COMPLETED, 0.0, 100, 3, 0.01, (), 0.02),  # not reported
    ]
    summary = summarize(RunResult(1.0, 3, 0.0, 1.0, results), Slo())
    assert (summary.total_cached_tokens, summary.cached_share) == (60, 0.3)
    assert summary.to_json()["cached_share"] == 0.3
    header, row = format_summaries([summary]).splitlines()[:2]
    assert header.split()[-2:] == ["cached", "%"] and row.split()[-1] == "30.0"
    none = summarize(RunResult(1.0, 1, 0.0, 1.0, results[2:]), Slo())
    assert (none.total_cached_tokens, none.cached_share) == (None, None)
    assert format_summaries([none]).splitlines()[1].split()[-1] == "-"


def test_the_stream_gives_the_answers_text():
    for chunk, text in (
        ('{"choices": [{"delta": {"content": "Hi"}}]}', "Hi"),
        ('{"choices": [{"delta": {"reasoning_content": "hmm"}}]}', ""),
        ('{"choices": [{"text": "x", "finish_reason": "length"}]}', "x"),
    ):
        assert parse_stream_line(f"data: {chunk}").text == text


# ---- against the project's own server ------------------------------------------------------


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory) -> Path:
    """The tiny random Llama with room for the built-in conversations' full histories."""
    path = tmp_path_factory.mktemp("tiny_long") / "tiny"
    make_tiny_llama(path, seed=0, max_position_embeddings=16384)
    return path


@pytest.fixture(scope="module")
def server(long_context_model):
    from cluster.control.local_backend import LocalBackend

    llm = LLM(str(long_context_model), device="cpu", max_model_len=16384, kv_cache_tokens=65536)
    llm.tokenizer.chat_template = CHAT_TEMPLATE
    backend = LocalBackend(llm, model_name="tiny")
    with BackgroundServer(create_app(backend)) as server:
        yield server
    backend.close()


def bench(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_bench_serving_args(parser)
    return run_bench_serving(parser.parse_args(["--disable-tqdm", *argv]))


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_shared_prefix_against_the_server(server, long_context_model, tmp_path, capsys):
    out = tmp_path / "out"
    code = bench(
        "--url", server.url, "--model", "tiny", "--tokenizer", str(long_context_model),
        "--dataset", "shared-prefix", "--prefix-groups", "2", "--prompts-per-group", "3",
        "--system-prompt-len", "60", "--question-len", "8", "--output-len", "4",
        "--max-concurrency", "1", "--output-dir", str(out), "--save-requests",
    )  # fmt: skip
    assert code == 0
    assert "6 shared-prefix prompts, mean 70 prompt tokens" in capsys.readouterr().out
    (run,) = read_lines(out / "results.jsonl")
    assert (run["sent"], run["completed"]) == (6, 6)
    assert run["total_output_tokens"] == 6 * 4  # random text: ignore_eos by default
    assert run["ttft_ms"]["p50"] is not None and run["ttft_ms"]["p99"] >= run["ttft_ms"]["p50"]
    dataset = run["dataset"]
    assert (dataset["groups"], dataset["prompts_per_group"], dataset["num_prompts"]) == (2, 3, 6)
    assert (dataset["system_len"], dataset["question_len"]) == (60, 8)
    # The server's prefix cache serves the system prompt to the group's later questions: the
    # cached tokens it reports are counted, never more than the prompts hold. One request at a
    # time, so a group's first prompt is cached before the next arrives (prompts admitted in one
    # step all compute their prefix).
    requests = read_lines(out / "requests.jsonl")
    assert all(r["cached_tokens"] is not None for r in requests)
    assert run["total_cached_tokens"] == sum(r["cached_tokens"] for r in requests) > 0
    assert 0 < run["cached_share"] < 1


def test_a_conversations_second_turn_carries_the_servers_first_answer(server, long_context_model):
    tokenizer = byte_tokenizer()
    target = Target(server.url, "tiny", "chat")
    script = ConversationScript(
        "short", ("Say something.", "Now say more."), ("reference",), (12, 5)
    )
    bodies = []

    async def scenario() -> RunResult:
        async with open_http_client(target) as http:

            async def send(request: BenchRequest, index: int) -> RequestResult:
                bodies.append(target.body(request))
                return await send_request(http, target, request, index)

            return await run_conversations([script], np.inf, send, tokenizer, concurrency=1,
                                           show_progress=False)  # fmt: skip

    first, second = asyncio.run(scenario()).results
    assert first.outcome is second.outcome is Outcome.COMPLETED
    assert first.output_text and first.output_tokens == 12
    assert bodies[1]["messages"][1] == {"role": "assistant", "content": first.output_text}
    assert bodies[1]["messages"][1]["content"] != "reference"
    # The server's own prompt count: the first turn, its answer (as text: the random model's
    # stray bytes come back as U+FFFD) and the second question.
    answer = len(encode(tokenizer, first.output_text))
    assert second.prompt_tokens >= first.prompt_tokens + answer + len("Now say more.")


def test_multiturn_against_the_server(server, long_context_model, tmp_path, capsys):
    out = tmp_path / "out"
    code = bench(
        "--url", server.url, "--model", "tiny", "--tokenizer", str(long_context_model),
        "--dataset", "multiturn", "--num-conversations", "3", "--concurrent-conversations", "2",
        "--output-dir", str(out), "--save-requests",
    )  # fmt: skip
    assert code == 0
    assert "3 conversations of 6 turns, 2 at a time" in capsys.readouterr().out
    (run,) = read_lines(out / "results.jsonl")
    assert (run["scheduled"], run["sent"], run["completed"]) == (6, 6, 6)
    assert run["max_concurrency"] == 2 and run["dataset"]["num_prompts"] == 3
    prompts = {r["index"]: r["prompt_tokens"] for r in read_lines(out / "requests.jsonl")}
    # Each conversation's second turn resends its first with the answer to it.
    for first in (0, 2, 4):
        assert prompts[first + 1] > prompts[first]


@pytest.mark.parametrize(
    ("flags", "refused"),
    [
        (["--dataset", "multiturn", "--num-prompts", "5"], "--num-prompts"),
        (["--dataset", "multiturn", "--max-concurrency", "5"], "--max-concurrency"),
        (["--dataset", "shared-prefix", "--num-prompts", "5"], "--num-prompts"),
        (["--dataset", "random", "--prefix-groups", "2"], "--prefix-groups"),
        (["--dataset", "chat", "--concurrent-conversations", "2"], "--concurrent-conversations"),
    ],
)
def test_flags_of_another_dataset_are_refused(flags, refused, capsys):
    assert bench("--url", "http://127.0.0.1:9", "--model", "m", *flags) == 2
    assert f"{refused} does not go with --dataset" in capsys.readouterr().err


def test_bench_serving_script_passes_each_dataset_its_own_flags(tiny_model_path, tmp_path):
    """bench/serving.py loads every setup with each dataset: the flags it gives the load
    generator are accepted for that dataset, with the values asked for."""
    pytest.importorskip("ray")
    from bench import serving
    from cluster.bench_serving.dataset_args import dataset_spec

    args = serving.parse_args(
        ["--model", str(tiny_model_path), "--datasets", *serving.DATASETS, "--num-prompts", "9",
         "--max-concurrency", "4", "--prefix-groups", "2", "--prompts-per-group", "3",
         "--num-conversations", "5", "--concurrent-conversations", "2"]
    )  # fmt: skip
    specs = {}
    for dataset in args.datasets:
        parser = argparse.ArgumentParser()
        add_bench_serving_args(parser)
        flags = serving.bench_flags(args, "http://127.0.0.1:9", dataset, tmp_path)
        parsed = parser.parse_args(flags)
        specs[dataset] = (dataset_spec(parsed), parsed.max_concurrency)
        if dataset == "multiturn":
            assert parsed.concurrent_conversations == 2
    assert {name: spec.num_prompts for name, (spec, _) in specs.items()} == {
        "random": 9, "chat": 9, "shared-prefix": 6, "multiturn": 5,
    }  # fmt: skip
    assert {name: limit for name, (_, limit) in specs.items()} == {
        "random": 4, "chat": 4, "shared-prefix": 4, "multiturn": None,
    }  # fmt: skip


def test_bench_serving_script_compares_the_prefix_cache_on_and_off(tiny_model_path):
    """--prefix-cache on off: each setup twice, the engines of the second without the cache,
    and the rows' labels tell them apart."""
    pytest.importorskip("ray")
    from bench import serving

    args = serving.parse_args(
        ["--model", str(tiny_model_path), "--setups", "aggregated", "1p1d",
         "--prefix-cache", "on", "off"]
    )  # fmt: skip
    setups = serving.setups_of(args)
    assert [s.label for s in setups] == [
        "aggregated", "1p1d", "aggregated, no prefix cache", "1p1d, no prefix cache",
    ]  # fmt: skip
    caches = [serving.cluster_config(s, args).engine.enable_prefix_cache for s in setups]
    assert caches == [True, True, False, False]
    default = serving.setups_of(serving.parse_args(["--model", str(tiny_model_path)]))
    assert default and all(s.prefix_cache for s in default)


def test_bench_serving_script_compares_prefill_policies_over_two_prefill_nodes(tiny_model_path):
    """--prefill-policies: each setup of two prefill nodes once per policy, labelled by it;
    a setup of one prefill node has no choice to make and runs once."""
    pytest.importorskip("ray")
    from bench import serving

    args = serving.parse_args(
        ["--model", str(tiny_model_path), "--setups", "1p1d", "2p1d",
         "--prefill-policies", "cache_aware", "round_robin", "--cache-aware-load-threshold", "3"]
    )  # fmt: skip
    setups = serving.setups_of(args)
    assert [s.label for s in setups] == ["1p1d", "2p1d, cache_aware", "2p1d, round_robin"]
    configs = [serving.cluster_config(s, args) for s in setups]
    assert [(c.prefill_nodes, c.decode_nodes) for c in configs] == [(1, 1), (2, 1), (2, 1)]
    assert [c.prefill_policy for c in configs] == ["round_robin", "cache_aware", "round_robin"]
    assert {c.cache_aware_load_threshold for c in configs} == {3}


def test_bench_serving_script_compares_decode_reuse_on_and_off(tiny_model_path):
    """--decode-reuse on off: each disaggregated setup twice, the second's decode nodes
    receiving every prompt whole; an aggregated setup has no transfer and runs once. The KV
    received per transfer and the share of positions reused come from the decode nodes'
    counters, read before and after a dataset's runs."""
    pytest.importorskip("ray")
    from bench import serving

    args = serving.parse_args(
        ["--model", str(tiny_model_path), "--setups", "aggregated", "1p1d",
         "--decode-reuse", "on", "off"]
    )  # fmt: skip
    setups = serving.setups_of(args)
    assert [s.label for s in setups] == ["aggregated", "1p1d", "1p1d, no decode reuse"]
    assert [serving.cluster_config(s, args).decode_reuse for s in setups] == [True, True, False]
    before = {"count": 2, "bytes": 1000, "kv_tokens": 20, "reused_tokens": 0}
    after = {"count": 4, "bytes": 1600, "kv_tokens": 30, "reused_tokens": 50}
    figures = serving.transfer_figures(before, after)
    assert figures == {
        "transfers": 2,
        "kv_bytes_per_transfer": 300.0,
        "kv_tokens_per_transfer": 5.0,
        "reused_share": 50 / 60,
    }
    assert serving.transfer_figures(None, None) == {} == serving.transfer_figures(after, after)
