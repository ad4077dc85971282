"""`pdcluster demo`: start `pdcluster serve` on a free port, send a few chat requests through the
client SDK (one streamed and printed as it arrives, the rest at once), print the answers with
TTFT and tokens/s, then stop the server with Ctrl-C (SIGINT), as a user would.

On the default model the demo speculates with the shipped draft (--no-speculation turns it off)
and prints the accept length, tokens per verify step, next to tokens/s."""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from cluster.client import APIConnectionError, APIError, Client

DEMO_CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Give three tips for staying focused while studying.",
    "Explain in two sentences what a GPU is.",
]
STARTUP_TIMEOUT_S = 600


def run_cluster_demo(args: argparse.Namespace) -> None:
    from spec.default_draft import resolve_draft_model

    speculate = not getattr(args, "no_speculation", False)
    if speculate and args.speculative_algorithm is None:
        if resolve_draft_model(args.model, args.draft_model) is not None:
            args.speculative_algorithm = "multi-layer-eagle"
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "cluster.commands.cli",
        "serve",
        "--port",
        str(port),
        *_forwarded_flags(args),
    ]
    print("$ pdcluster " + " ".join(command[3:]), flush=True)
    server = subprocess.Popen(command)
    try:
        client = Client(f"http://127.0.0.1:{port}", timeout=300)
        _wait_until_healthy(client, server)
        _stream_one(client, DEMO_CHATS[0], args.max_tokens)
        _batch(client, DEMO_CHATS[1:], args.max_tokens)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    if server.returncode not in (0, -signal.SIGINT, 130):
        raise RuntimeError(f"the server exited with status {server.returncode}")


def _stream_one(client: Client, prompt: str, max_tokens: int) -> None:
    print(f"\n> {prompt}   (streamed)", flush=True)
    started = time.perf_counter()
    ttft = None
    tokens = 0
    usage = None
    for chunk in client.chat(
        [{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0, stream=True
    ):
        if ttft is None and (chunk.text or chunk.token_ids):
            ttft = time.perf_counter() - started
        tokens += len(chunk.token_ids)
        usage = chunk.usage or usage
        print(chunk.text, end="", flush=True)
    elapsed = time.perf_counter() - started
    print(
        f"\n  [TTFT {1000 * (ttft or elapsed):.0f} ms, {tokens} tokens, "
        f"{tokens / elapsed:.1f} tokens/s{_accept_length_note([usage])}]",
        flush=True,
    )


def _accept_length_note(usages: list) -> str:
    """ ", accept length 1.93" over the requests that speculated, or "" when none did."""
    steps = emitted = 0.0
    for usage in usages:
        extra = getattr(usage, "extra", None) or {}
        n = extra.get("spec_verify_steps") or 0
        steps += n
        emitted += (extra.get("spec_accept_length") or 0.0) * n
    return f", accept length {emitted / steps:.2f}" if steps else ""


def _batch(client: Client, prompts: list[str], max_tokens: int) -> None:
    def ask(prompt: str):
        started = time.perf_counter()
        answer = client.chat(
            [{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0
        )
        return answer, time.perf_counter() - started

    started = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(ask, prompts))
    elapsed = time.perf_counter() - started
    total = 0
    for prompt, (answer, latency) in zip(prompts, results):
        total += answer.usage.completion_tokens
        print(
            f"\n> {prompt}\n{answer.text.strip()}\n  [{answer.usage.completion_tokens} tokens "
            f"in {latency:.1f} s, finish: {answer.finish_reason}"
            f"{_accept_length_note([answer.usage])}]"
        )
    print(
        f"\n{len(prompts)} concurrent requests: {total} tokens in {elapsed:.1f} s = "
        f"{total / elapsed:.1f} tokens/s{_accept_length_note([a.usage for a, _ in results])}",
        flush=True,
    )


def _wait_until_healthy(client: Client, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited during start-up (status {server.returncode})")
        try:
            if client.health().get("status") == "ok":
                return
        except (APIConnectionError, APIError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy within {STARTUP_TIMEOUT_S} s")


def _forwarded_flags(args: argparse.Namespace) -> list[str]:
    """Every engine and cluster flag the user set, passed on to `pdcluster serve`."""
    from cluster.commands.cli_args import add_cluster_args, add_engine_args

    probe = argparse.ArgumentParser()
    add_engine_args(probe)
    add_cluster_args(probe)
    flags = []
    for name, default in vars(probe.parse_args([])).items():
        value = getattr(args, name, default)
        if value != default:
            flag = "--" + name.replace("_", "-")
            # A switch (store_true, like --enable-tracing) takes no value; a list is comma-joined.
            if value is True:
                flags.append(flag)
            elif isinstance(value, list | tuple):
                flags += [flag, ",".join(map(str, value))]
            else:
                flags += [flag, str(value)]
    return flags


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
