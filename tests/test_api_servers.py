"""Several API processes on one port (`pdcluster serve --api-servers 2`,
cluster.frontend.api_servers):
both serve, each request's tokens reach the process that holds its connection, aborts from
either free the KV on every node, /metrics from either counts every request, and an API
process killed under load takes only its own streams down, leaves nothing on the nodes, and is
restarted. One disaggregated cluster (a prefill and a decode node) for the module."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from tiny_models import make_tiny_llama, save_chat_template

from cluster.frontend.http_guards import API_SERVER_HEADER
from engine import LLM, SamplingParams

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[1]
ENGINE = {"max_model_len": 256, "kv_cache_tokens": 8192, "max_num_seqs": 64}
PROMPTS = [f"request {i}: " + "abcdefgh"[: 1 + i % 8] for i in range(200)]
MAX_TOKENS = 6
API_KEY = "test-key-for-two-processes"
AUTH = {"authorization": f"Bearer {API_KEY}"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-api-servers")
    make_tiny_llama(path)
    save_chat_template(path)
    return str(path)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    command = [
        sys.executable, "-m", "cluster.commands.cli", "serve",
        "--device", "cpu", "--model", tiny_model, "--port", str(port), "--api-servers", "2",
        "--max-model-len", str(ENGINE["max_model_len"]),
        "--kv-cache-tokens", str(ENGINE["kv_cache_tokens"]),
        "--max-num-seqs", str(ENGINE["max_num_seqs"]),
        "--kv-audit-interval", "1", "--api-key", API_KEY, "--enable-tracing",
    ]  # fmt: skip
    with log.open("w") as output:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            stdout=output,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"serve did not come up:\n{log.read_text()}")
            time.sleep(0.5)
        yield url, process, log
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _healthy(url: str) -> bool:
    try:
        health = httpx.get(f"{url}/health", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return False
    servers = health.get("api_servers") or []
    return health.get("status") == "ok" and len(servers) == 2 and all(s["up"] for s in servers)


@pytest.fixture(scope="module")
def offline(tiny_model) -> LLM:
    return LLM(tiny_model, device="cpu", **ENGINE)


async def _stream(
    http: httpx.AsyncClient, prompt: str, started: asyncio.Queue | None = None, **extra
) -> dict:
    """One streaming completion on a connection of its own: which process served it, its
    text, tokens and finish reason. `started` hears of its first chunk."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    outcome = {"server": None, "text": "", "token_ids": [], "finish_reason": None}
    async with http.stream("POST", "/v1/completions", json=body | extra) as response:
        outcome["server"] = response.headers.get(API_SERVER_HEADER)
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if started is not None and not outcome["token_ids"]:
                started.put_nowait(outcome["server"])
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk["choices"]:
                outcome["text"] += choice["text"]
                outcome["token_ids"] += choice["token_ids"]
                outcome["finish_reason"] = choice["finish_reason"] or outcome["finish_reason"]
    return outcome


def _client(url: str) -> httpx.AsyncClient:
    # No keep-alive: each request is a new connection, which the kernel gives either process.
    limits = httpx.Limits(max_keepalive_connections=0)
    return httpx.AsyncClient(base_url=url, timeout=120, limits=limits, headers=AUTH)


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        metric, _, value = line.rpartition(" ")
        if metric.split("{")[0] != name:
            continue
        if all(f'{key}="{val}"' in metric for key, val in labels.items()):
            total += float(value)
    return total


def _scrape_each_process(url: str) -> dict[str, str]:
    """/metrics as each API process answers it."""
    seen: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while len(seen) < 2 and time.monotonic() < deadline:
        headers = {"connection": "close"}
        response = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
        seen[response.headers[API_SERVER_HEADER]] = response.text
    assert set(seen) == {"0", "1"}, "both API processes answer"
    return seen


def _scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=30).text


def _nodes_empty(url: str) -> bool:
    text = _scrape(url)
    return _metric(text, "pdcluster_node_kv_used_tokens") == 0 and "kv_used_tokens{" in text


def _wait(predicate, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.25)
    return predicate()


def test_both_processes_serve_and_every_request_equals_the_offline_engine(server, offline):
    url, _, _ = server
    expected = offline.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))

    async def run() -> list[dict]:
        async with _client(url) as http:
            return await asyncio.gather(*(_stream(http, prompt) for prompt in PROMPTS))

    outcomes = asyncio.run(run())
    assert {outcome["server"] for outcome in outcomes} == {"0", "1"}
    for outcome, reference in zip(outcomes, expected):
        assert outcome["token_ids"] == reference.token_ids
        assert outcome["text"] == reference.text
        assert outcome["finish_reason"] == reference.finish_reason
    assert _wait(lambda: _nodes_empty(url))
    for text in _scrape_each_process(url).values():
        assert _metric(text, "pdcluster_requests_total") == len(PROMPTS)
        assert _metric(text, "pdcluster_generation_tokens_total") == sum(
            len(reference.token_ids) for reference in expected
        )


def test_aborts_from_either_process_free_the_kv_on_every_node(server):
    url, _, _ = server
    long = {"max_tokens": 200, "ignore_eos": True}

    async def abort_after_first_chunk(http: httpx.AsyncClient, prompt: str) -> str:
        body = {"prompt": prompt, "stream": True, **long}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    return response.headers[API_SERVER_HEADER]  # closing the stream aborts
        raise AssertionError("the stream ended before its first chunk")

    async def run() -> list[str]:
        async with _client(url) as http:
            return await asyncio.gather(
                *(abort_after_first_chunk(http, f"abort {i}") for i in range(24))
            )

    served = asyncio.run(run())
    assert set(served) == {"0", "1"}, "aborts came through both processes"
    assert _wait(lambda: _nodes_empty(url)), "every node freed the aborted requests' KV"
    for text in _scrape_each_process(url).values():
        assert _metric(text, "pdcluster_request_failures_total", kind="aborted") >= len(served)


def test_a_killed_api_process_ends_its_own_streams_only_and_is_restarted(server):
    url, process, log = server
    victim = httpx.get(f"{url}/health", timeout=30).json()["api_servers"][0]
    long = {"max_tokens": 240, "ignore_eos": True}
    streams = 32

    generated_before = _metric(_scrape(url), "pdcluster_node_generation_tokens_total")

    async def run() -> list[dict | str]:
        async with _client(url) as http:
            started: asyncio.Queue[str] = asyncio.Queue()

            async def one(i: int) -> dict | str:
                try:
                    return await _stream(http, f"kill {i}", started, **long)
                except httpx.TransportError as err:
                    return type(err).__name__

            tasks = [asyncio.create_task(one(i)) for i in range(streams)]
            # Killed as soon as every stream has its first chunk: all are mid-stream.
            for _ in range(streams):
                await started.get()
            os.kill(victim["pid"], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    outcomes = asyncio.run(run())
    completed = [o for o in outcomes if isinstance(o, dict) and o["finish_reason"] == "length"]
    dropped = [o for o in outcomes if not (isinstance(o, dict) and o["finish_reason"])]
    assert completed and dropped, outcomes
    assert all(o["server"] == "1" and len(o["token_ids"]) == 240 for o in completed)
    assert len(completed) + len(dropped) == len(outcomes)
    # Nothing is left on any node: their requests were aborted, their KV freed and audited.
    assert _wait(lambda: _nodes_empty(url), 90), log.read_text()[-3000:]
    time.sleep(1.5)  # one more KV audit on every node (--kv-audit-interval 1)
    metrics = _scrape(url)
    assert _metric(metrics, "pdcluster_node_kv_audit_mismatches_total") == 0
    assert _metric(metrics, "pdcluster_node_kv_unaccounted_tokens") == 0
    # The dropped streams' requests were aborted, not generated to their end: together they
    # made fewer tokens than their budgets. (How many fewer depends on how long the first
    # streams ran before the last one started, which on a loaded host can be most of them.)
    generated = _metric(metrics, "pdcluster_node_generation_tokens_total") - generated_before
    dropped_tokens = generated - len(completed) * 240
    assert dropped_tokens < len(dropped) * 240, (generated, len(completed), len(dropped))
    # It comes back (a new process in its place) and both serve again.
    assert _wait(lambda: _restarted(url, victim["pid"]), 90), log.read_text()[-3000:]
    assert process.poll() is None

    async def after() -> list[dict]:
        async with _client(url) as http:
            return await asyncio.gather(*(_stream(http, f"after {i}") for i in range(16)))

    served = {outcome["server"] for outcome in asyncio.run(after())}
    assert served == {"0", "1"}


def test_api_keys_and_traces_work_the_same_through_either_process(server):
    url, _, _ = server
    # Both processes serve (not one still restarting after an earlier test's kill).
    assert _wait(lambda: _all_up(url), 90)
    answered: dict[str, int] = {}
    body = {"prompt": "no key", "max_tokens": 2}
    for _ in range(40):
        refused = httpx.post(f"{url}/v1/completions", json=body, headers={"connection": "close"})
        answered[refused.headers[API_SERVER_HEADER]] = refused.status_code
    assert answered == {"0": 401, "1": 401}
    done = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH).json()
    found: dict[str, int] = {}
    for _ in range(40):
        trace = httpx.get(
            f"{url}/v1/traces/{done['id']}", headers={**AUTH, "connection": "close"}
        )
        found[trace.headers[API_SERVER_HEADER]] = trace.status_code
        if trace.status_code == 200:
            names = {event["name"] for event in trace.json()["traceEvents"]}
            assert "first_token" in names
    assert found == {"0": 200, "1": 200}, "each process serves the traces of both"


def _all_up(url: str) -> bool:
    return all(s["up"] for s in httpx.get(f"{url}/health", timeout=30).json()["api_servers"])


def _restarted(url: str, old_pid: int) -> bool:
    servers = httpx.get(f"{url}/health", timeout=30).json()["api_servers"]
    first = servers[0]
    return first["up"] and first["pid"] != old_pid and first["restarts"] == 1


def test_sigterm_drains_every_api_process_and_exits_zero(server):
    """Last: it stops the module's server. A stream running at SIGTERM finishes, then the
    controller and both API processes exit, status 0."""
    url, process, log = server
    body = {"prompt": "drain", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=120, headers=AUTH) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in "".join(rest)
    assert process.wait(timeout=120) == 0, log.read_text()[-3000:]
    output = log.read_text()
    assert "draining 2 API processes" in output and "Traceback" not in output
