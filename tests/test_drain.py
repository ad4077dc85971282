"""Graceful drain (cluster.frontend.admission, cluster.commands.serve): once draining, new requests
get a 503 with
Retry-After and /health answers 503 "draining", the requests in flight finish, those left at the
drain timeout end with an error naming it; `pdcluster serve` drains on SIGTERM and exits 0."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from conftest import TINY_BACKEND_MODEL as MODEL
from test_admission import (
    LONG_STREAM,
    ScriptedBackend,
    StepGate,
    finish_reason,
    sse_payloads,
    stream_in_background,
    wait_until,
)

from cluster.frontend.admission import Admission
from cluster.frontend.api_errors import OpenAIError
from cluster.frontend.api_server import DrainingServer
from cluster.frontend.backend import BackendError
from cluster.frontend.openai_api import BackgroundServer, create_app

REPO = Path(__file__).resolve().parents[1]


def test_a_draining_server_refuses_new_requests_and_finishes_running_streams(backend, monkeypatch):
    gate = StepGate(backend, monkeypatch)
    admission = Admission()
    try:
        gate.close()
        with BackgroundServer(create_app(backend, admission=admission)) as server:
            assert httpx.get(f"{server.url}/health").status_code == 200
            running, result = stream_in_background(server.url, LONG_STREAM)
            assert wait_until(lambda: admission.in_flight == 1)

            admission.begin_drain(30)
            refused = httpx.post(f"{server.url}/v1/completions", json=LONG_STREAM)
            assert refused.status_code == 503, refused.text
            assert 1 <= int(refused.headers["retry-after"]) <= 30
            error = refused.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert "draining" in error["message"] and "30 s" in error["message"]
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
            assert httpx.post(f"{server.url}/v1/chat/completions", json=chat).status_code == 503
            health = httpx.get(f"{server.url}/health")
            assert health.status_code == 503 and health.json()["status"] == "draining"
            # Whatever does not generate is still answered.
            assert httpx.get(f"{server.url}/v1/models").status_code == 200

            gate.open()
            running.join(timeout=120)
            assert result["status"] == 200, result
            payloads = sse_payloads(result["text"])
            assert payloads[-1] == "[DONE]" and finish_reason(payloads) == "length"
            assert not any("error" in p for p in payloads if isinstance(p, dict))
            assert wait_until(lambda: admission.in_flight == 0)
    finally:
        gate.open()
    assert wait_until(backend.engine.kv_cache.is_empty)


def test_the_drain_timeout_ends_the_requests_left_with_an_error_naming_it():
    async def run() -> None:
        admission = Admission()
        finishing = ScriptedBackend([0.0])
        hanging = ScriptedBackend([0.0, None])
        watched = [admission.admit().watch(b.generate()) for b in (finishing, hanging)]
        for deltas in watched:
            await anext(deltas)  # both have their first token

        async def consume(deltas) -> str | BaseException:
            try:
                return [delta.finish_reason async for delta in deltas][-1]
            except BackendError as err:
                return err
            finally:
                await deltas.aclose()

        consumers = [asyncio.create_task(consume(deltas)) for deltas in watched]
        assert await admission.drain(0.3) == 1
        finished, ended = await asyncio.gather(*consumers)
        assert finished == "length"
        assert isinstance(ended, BackendError) and ended.status == 503
        assert "--drain-timeout" in str(ended) and "0.3 s" in str(ended)
        assert hanging.closed.is_set() and admission.in_flight == 0
        with pytest.raises(OpenAIError, match="draining"):
            admission.admit()

    asyncio.run(run())


def test_the_first_signal_drains_and_a_second_stops_at_once():
    async def run() -> None:
        admission = Admission()
        config = uvicorn.Config(create_app(ScriptedBackend([])), port=0, log_level="warning")
        server = DrainingServer(config, admission, drain_timeout_s=600)
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        admission.admit()  # a request in flight: the drain waits for it
        server.handle_exit(signal.SIGTERM, None)
        while not admission.draining:
            await asyncio.sleep(0.01)
        assert not server.should_exit
        server.handle_exit(signal.SIGINT, None)
        assert server.should_exit and server.force_exit
        await serving

    asyncio.run(run())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_health(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"serve exited during start-up:\n{log.read_text()}"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"serve was not healthy within {timeout} s:\n{log.read_text()}")


def drain_began(log: Path) -> bool:
    return "draining" in log.read_text()


def test_serve_drains_on_sigterm_and_exits_zero(tiny_model_path, tmp_path):
    pytest.importorskip("ray")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    command = [
        sys.executable, "-m", "cluster.commands.cli", "serve",
        "--device", "cpu", "--model", str(tiny_model_path), "--port", str(port),
        "--max-model-len", "512", "--kv-cache-tokens", "2048", "--drain-timeout", "30",
    ]  # fmt: skip
    with log.open("w") as output:
        process = subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT)
    try:
        wait_for_health(url, process, log, timeout=300)
        body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=120) as http:
            with http.stream("POST", "/v1/completions", json=body) as stream:
                lines = stream.iter_lines()
                first = next(line for line in lines if line.startswith("data:"))
                process.send_signal(signal.SIGTERM)
                assert wait_until(lambda: drain_began(log) or process.poll() is not None)
                # No request is served after SIGTERM: a 503 while draining, or no server at all.
                try:
                    late = httpx.post(f"{url}/v1/completions", json=body | {"stream": False})
                    assert late.status_code == 503, late.text
                    assert "draining" in late.json()["error"]["message"]
                    assert "retry-after" in late.headers
                except httpx.TransportError:
                    pass
                text = "\n\n".join([first, *lines]) + "\n\n"
        payloads = sse_payloads(text)
        assert payloads[-1] == "[DONE]" and finish_reason(payloads) == "length"
        assert not any("error" in p for p in payloads if isinstance(p, dict))
        assert process.wait(timeout=120) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
