"""Queue bounds of the HTTP API (cluster.frontend.admission): past --max-queued-requests a request
gets a 429 with Retry-After at once and the others complete; a request with no first token within
--queue-timeout ends with an error naming it, and its resources are freed on the engine."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from conftest import TINY_BACKEND_MODEL as MODEL

from cluster.commands.cli import main
from cluster.control.local_backend import LocalBackend
from cluster.deploy.config import ServeConfig
from cluster.frontend.admission import Admission
from cluster.frontend.api_errors import OpenAIError
from cluster.frontend.backend import BackendError, TokenDelta, make_usage
from cluster.frontend.openai_api import BackgroundServer, create_app
from engine import LLM

LONG_STREAM = {"prompt": "Hello", "max_tokens": 40, "ignore_eos": True, "stream": True}


class StepGate:
    """Engine steps run only as the test allows: it decides when tokens come."""

    def __init__(self, backend: LocalBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        self._permits: int | None = None  # None: open
        self._changed = threading.Condition()
        step = backend.engine.step

        def gated_step():
            with self._changed:
                self._changed.wait_for(lambda: self._permits is None or self._permits > 0)
                if self._permits is not None:
                    self._permits -= 1
            return step()

        monkeypatch.setattr(backend.engine, "step", gated_step)

    def close(self) -> None:
        with self._changed:
            self._permits = 0

    def allow(self, steps: int) -> None:
        with self._changed:
            self._permits = (self._permits or 0) + steps
            self._changed.notify_all()

    def open(self) -> None:
        with self._changed:
            self._permits = None
            self._changed.notify_all()


@pytest.fixture
def gate(backend, monkeypatch):
    gate = StepGate(backend, monkeypatch)
    yield gate
    gate.open()  # never leave the shared engine thread blocked


def wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def sse_payloads(text: str) -> list:
    events = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    return [json.loads(e) if e != "[DONE]" else e for e in events]


def finish_reason(payloads: list) -> str | None:
    chunks = [p for p in payloads if isinstance(p, dict) and p.get("choices")]
    return chunks[-1]["choices"][0]["finish_reason"] if chunks else None


def stream_in_background(url: str, body: dict) -> tuple[threading.Thread, dict]:
    """POST a stream on a thread; the dict gets its status and body when it ends."""
    result: dict = {}

    def run() -> None:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        result.update(status=response.status_code, text=response.text)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def failures(backend: LocalBackend, kind: str) -> float:
    registry = backend.metrics.registry
    return registry.get_sample_value("pdcluster_request_failures_total", {"kind": kind}) or 0.0


# ---- --max-queued-requests ---------------------------------------------------------------


def test_requests_past_the_limit_get_a_429_and_the_others_complete(backend, gate):
    limit = 2
    admission = Admission(max_queued_requests=limit)
    overloaded_before = failures(backend, "overloaded")
    gate.close()  # the admitted requests wait for their first token, in flight
    with BackgroundServer(create_app(backend, admission=admission)) as server:
        running = [stream_in_background(server.url, LONG_STREAM) for _ in range(limit)]
        assert wait_until(lambda: admission.in_flight == limit)

        overflow = httpx.post(f"{server.url}/v1/completions", json=LONG_STREAM, timeout=30)
        assert overflow.status_code == 429, overflow.text
        assert int(overflow.headers["retry-after"]) >= 1
        error = overflow.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "rate_limit_error"
        assert "--max-queued-requests" in error["message"] and str(limit) in error["message"]
        assert failures(backend, "overloaded") == overloaded_before + 1

        gate.open()
        for thread, result in running:
            thread.join(timeout=120)
            assert result["status"] == 200, result
            payloads = sse_payloads(result["text"])
            assert payloads[-1] == "[DONE]" and finish_reason(payloads) == "length"
        # Finished requests leave room: the next one is served.
        assert wait_until(lambda: admission.in_flight == 0)
        body = {"prompt": "Hi", "max_tokens": 3, "model": MODEL}
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
    assert wait_until(backend.engine.kv_cache.is_empty)


def test_a_refused_request_is_not_counted_in_flight():
    async def run() -> None:
        admission = Admission(max_queued_requests=1)
        first = admission.admit()
        for _ in range(3):
            with pytest.raises(OpenAIError) as refused:
                admission.admit()
            assert refused.value.status == 429
        assert admission.in_flight == 1
        first.release()
        first.release()  # twice is harmless
        admission.admit()
        assert admission.in_flight == 1

    asyncio.run(run())


# ---- --queue-timeout ---------------------------------------------------------------------


@pytest.fixture
def one_seat_backend(tiny_model_path):
    """An engine that runs one request at a time: a second one waits in its queue."""
    llm = LLM(
        str(tiny_model_path), device="cpu", max_model_len=256, kv_cache_tokens=2048, max_num_seqs=1
    )
    backend = LocalBackend(llm, model_name=MODEL)
    yield backend
    backend.close()


def test_a_request_past_the_queue_timeout_ends_with_an_error_and_frees_its_place(
    one_seat_backend, monkeypatch
):
    backend = one_seat_backend
    gate = StepGate(backend, monkeypatch)
    scheduler = backend.engine.scheduler
    admission = Admission(queue_timeout_s=1.0)
    long_body = LONG_STREAM | {"max_tokens": 200}
    try:
        with (
            BackgroundServer(create_app(backend, admission=admission)) as server,
            httpx.Client(base_url=server.url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=long_body) as first,
        ):
            lines = (line for line in first.iter_lines() if line.startswith("data:"))
            next(lines)  # the first request has its first token: the timeout no longer applies
            gate.close()

            waiting = http.post("/v1/completions", json=LONG_STREAM)
            assert waiting.status_code == 503, waiting.text
            error = waiting.json()["error"]
            assert "queue timeout" in error["message"] and "--queue-timeout" in error["message"]
            assert error["type"] == "service_unavailable_error"

            # One step, after which the engine thread takes its commands: the abort of the
            # request that timed out takes it out of the queue, while the first one still runs.
            gate.allow(1)
            assert wait_until(lambda: not scheduler.waiting)
            assert len(scheduler.running) == 1
            gate.open()
            later = json.loads(next(lines)[len("data: ") :])
            assert "error" not in later and later["choices"][0]["finish_reason"] is None
        # Leaving the block disconnects the first request, which aborts it too.
        assert wait_until(backend.engine.kv_cache.is_empty)
        assert wait_until(lambda: admission.in_flight == 0)
    finally:
        gate.open()


class ScriptedBackend:
    """Yields after the given delays, or waits forever for None; records that it was closed."""

    def __init__(self, delays: list[float | None]) -> None:
        self.delays = delays
        self.closed = asyncio.Event()

    async def generate(self):
        try:
            for delay in self.delays:
                if delay is None:
                    await asyncio.Event().wait()
                await asyncio.sleep(delay)
                yield TokenDelta([72], "H")
            yield TokenDelta([], "", finish_reason="length", usage=make_usage(1, 1))
        finally:
            self.closed.set()


def test_the_queue_timeout_closes_the_backend_generator():
    async def run() -> None:
        admission = Admission(queue_timeout_s=0.2)
        backend = ScriptedBackend([None])
        deltas = admission.admit().watch(backend.generate())
        with pytest.raises(BackendError) as ended:
            await anext(deltas)
        assert ended.value.status == 503 and "--queue-timeout" in str(ended.value)
        assert backend.closed.is_set()
        assert admission.in_flight == 0

    asyncio.run(run())


def test_the_queue_timeout_spares_a_request_that_has_its_first_token():
    async def run() -> None:
        admission = Admission(queue_timeout_s=0.2)
        backend = ScriptedBackend([0.0, 0.5])  # the second token comes after the timeout
        deltas = admission.admit().watch(backend.generate())
        finish = [delta.finish_reason async for delta in deltas][-1]
        await deltas.aclose()
        assert finish == "length" and admission.in_flight == 0

    asyncio.run(run())


# ---- configuration -----------------------------------------------------------------------


def test_queue_flags_reach_the_config_and_bad_values_are_refused(monkeypatch, capsys):
    import cluster.commands.serve

    served = []
    monkeypatch.setattr(cluster.commands.serve, "serve", served.append)
    flags = ["--max-queued-requests", "8", "--queue-timeout", "2.5", "--drain-timeout", "12"]
    assert main(["serve", *flags]) == 0
    [config] = served
    assert (config.max_queued_requests, config.queue_timeout_s) == (8, 2.5)
    assert config.drain_timeout_s == 12
    assert main(["serve", "--max-queued-requests", "0"]) == 2
    assert "max_queued_requests" in capsys.readouterr().err
    defaults = ServeConfig()
    assert defaults.max_queued_requests is None and defaults.queue_timeout_s is None
    assert defaults.drain_timeout_s == 30
    with pytest.raises(ValueError, match="queue_timeout_s"):
        ServeConfig(queue_timeout_s=0)
