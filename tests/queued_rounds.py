"""Helpers of the tests of verifies queued from the device. Verify graphs on a CPU: a graph
set whose replay runs the eager forward over whatever its static buffer holds, so that a
speculative round takes the path of a captured verify (the next one queued from the device,
its spans moved in the buffer) where no graph can be captured. Counts of the rounds that took
a queued verify, plain decoding's output, and the pools' state after a run."""

from __future__ import annotations

import random
from types import SimpleNamespace

from engine.executor.cuda_graph import CudaGraphs
from engine.executor.forward_batch import Span, extend_batch
from engine.executor.graph_inputs import IDS, POSITIONS, Q_LENS, Q_STARTS, ROWS, SLOTS, TREE_BITS
from engine.llm import LLM
from engine.sampling.sampling_params import SamplingParams


class ReplayedEagerly(CudaGraphs):
    """A replay rebuilds each request's span from the buffer (ids, positions, slots, and for
    trees each token's mask) and runs it eagerly: whatever wrote the buffer, the forward is the
    one a captured graph would run over it."""

    def __init__(self, runner, max_span: int, max_tokens: int, trees: bool = False) -> None:
        attention = SimpleNamespace(supports_cuda_graph=True)
        pools = (runner.kv_pool, runner.req_to_token_pool)
        buckets = sorted({8, 16, 32, max_tokens})
        super().__init__("verify", None, attention, *pools, buckets, max_span, trees=trees)
        self.runner = runner

    def replay(self, batch):
        columns, requests = self.inputs, self.inputs[3:]
        spans = []
        for i in range(batch.batch_size):
            first, count = int(requests[Q_STARTS, i]), int(requests[Q_LENS, i])
            ids, positions, slots = (
                columns[row, first : first + count].tolist() for row in (IDS, POSITIONS, SLOTS)
            )
            visible = None
            if self.trees:
                visible = columns[TREE_BITS, first : first + count].tolist()
            spans.append(
                Span(
                    int(requests[ROWS, i]),
                    positions[0],
                    ids,
                    slots,
                    positions=positions if self.trees else None,
                    visible=visible,
                )
            )
        runner = self.runner
        pools = (runner.kv_pool, runner.req_to_token_pool)
        eager = extend_batch(spans, *pools, runner.attention, runner.device)
        self.num_replays += 1
        return runner.forward_every_token(eager)


def with_emulated_graphs(llm: LLM, max_span: int = 4, trees: bool = False) -> LLM:
    """`llm` with emulated verify graphs of spans up to `max_span` tokens, 16 of them."""
    runner = llm.engine.runner
    runner.verify_graphs = ReplayedEagerly(runner, max_span, max_span * 16, trees)
    return llm


def count_rounds(llm: LLM, monkeypatch, module, queue: str) -> dict[str, int]:
    """Counts, while `llm` runs: rounds verified, rounds that took a verify queued before them,
    verifies queued from the device (calls of `module.queue`, patched), and rounds that took
    one of those with every request's drafts still on their way to the host (`unread`: the
    host read none before the round)."""
    worker = llm.engine.speculator
    counts = {"rounds": 0, "taken": 0, "from_device": 0, "taken_from_device": 0, "unread": 0}
    verify, queued = worker.verify, getattr(module, queue)

    def counted_verify(requests, *args):
        counts["rounds"] += 1
        pending = worker.verifier.launched
        taken = pending is not None and pending.runs(requests)
        counts["taken"] += taken
        if taken and pending.inputs is None:
            counts["taken_from_device"] += 1
            counts["unread"] += all(req.spec_state._pending is not None for req in requests)
        return verify(requests, *args)

    def counted_queue(*args):
        counts["from_device"] += 1
        return queued(*args)

    monkeypatch.setattr(worker, "verify", counted_verify)
    monkeypatch.setattr(module, queue, counted_queue)
    return counts


def plain_outputs(
    target, prompts: list[list[int]], params: list[SamplingParams], device: str = "cpu"
) -> list[list[int]]:
    """The token ids plain decoding of `target` gives."""
    plain = LLM(str(target), device=device, kv_cache_tokens=8192, max_num_seqs=16)
    return [o.token_ids for o in plain.generate(prompts, params)]


def check_empty(llm: LLM) -> None:
    """Nothing left running or held, and every slot back in the pools."""
    engine = llm.engine
    assert not engine.has_work() and not engine.speculative.held
    assert engine.kv_cache.is_empty() and engine.speculator.is_empty()


def workload(seed: int, n: int, shortest: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """`n` random prompts, greedy, request i at most `shortest` + 9i tokens, every other one
    stopping at EOS: requests that end at different rounds."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(4, 30))] for _ in range(n)]
    params = [
        SamplingParams(max_tokens=shortest + 9 * i, temperature=0, ignore_eos=i % 2 == 0)
        for i in range(n)
    ]
    return prompts, params


def stop_token_workload(
    target, prompts: list[list[int]]
) -> tuple[list[SamplingParams], list[list[int]]]:
    """Params under which request i stops at the token plain decoding gives at its output
    position 9 + 4i (within 60 tokens), and plain decoding's output under them."""
    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    plain = plain_outputs(target, prompts, [long] * len(prompts))
    params = [
        SamplingParams(
            max_tokens=60, temperature=0, ignore_eos=True, stop_token_ids=[out[9 + 4 * i]]
        )
        for i, out in enumerate(plain)
    ]
    return params, plain_outputs(target, prompts, params)


def run_aborting_one(llm: LLM, prompts: list[list[int]], params: SamplingParams, choose):
    """Run `prompts` step by step; after the first step that leaves a verify queued from the
    device (its inputs gathered later), abort the request `choose(requests, queued)` picks.
    Returns the requests and the aborted one (None if no verify was queued from the device)."""
    engine = llm.engine
    requests = [engine.make_request(str(i), p, params) for i, p in enumerate(prompts)]
    for req in requests:
        engine.add_request(req)
    aborted = None
    while engine.has_work():
        engine.step()
        queued = engine.speculator.queued_verify()
        if aborted is None and queued is not None and queued.inputs is None:
            aborted = choose(requests, queued)
            assert engine.abort(aborted.request_id) is aborted
    return requests, aborted
