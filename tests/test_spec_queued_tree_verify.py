"""The next round's tree verify queued from the device
(spec.runtime.tree_round.queue_next_tree_verify):
behind a round's extend, before the host has read that round's outcome, each request's span
moved past its accepted path and given its next tree's nodes, positions, slots and ancestor
masks on the device (CudaGraphs.advance_trees)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from devices import DEVICES
from queued_rounds import (
    check_empty,
    count_rounds,
    plain_outputs,
    run_aborting_one,
    stop_token_workload,
    with_emulated_graphs,
    workload,
)
from tiny_drafts import make_good_draft, make_predictable_llama

import spec.runtime.tree_round as tree_round
from engine import LLM, SamplingParams
from engine.executor.cuda_graph import CudaGraphs
from engine.executor.forward_batch import Span, ancestor_bits
from engine.executor.graph_inputs import padded_columns
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool
from spec.runtime.tree import DraftTree

SPEC = "multi-layer-eagle"


def _random_tree(rng: np.random.Generator, count: int, depth: int) -> DraftTree:
    """`count` nodes ordered by level, at most `depth` levels, each level's parents among the
    level above (level 1's the root)."""
    levels = np.sort(rng.integers(1, depth + 1, size=count))
    levels[0] = 1
    for i in range(1, count):  # no level skipped
        levels[i] = min(levels[i], levels[i - 1] + 1)
    parents = []
    for i, level in enumerate(levels):
        above = [j for j in range(i) if levels[j] == level - 1]
        parents.append(-1 if level == 1 else int(rng.choice(above)))
    tokens = rng.integers(3, 100, size=count).tolist()
    return DraftTree(tokens, parents, levels.tolist())


@pytest.mark.parametrize("count", [1, 5, 24, 62])
def test_ancestor_bits_are_the_trees_own_masks(count: int) -> None:
    """Each row sees exactly itself, the root and its ancestors: DraftTree.visible, which
    walks the tree on the host."""
    rng = np.random.default_rng(count)
    trees = [_random_tree(rng, count, 5) for _ in range(6)]
    parents = torch.tensor([tree.parents for tree in trees])
    got = ancestor_bits(parents, 5).tolist()
    assert got == [tree.visible() for tree in trees]


def _graphs(width: int, context: int, device: str) -> CudaGraphs:
    """A graph set of trees over a small pool whose buffers are loaded and moved, never
    captured."""
    pool = KVPool(64, 1, 1, 4, torch.float32, device)
    table = ReqToTokenPool(8, context, device)
    attention = SimpleNamespace(supports_cuda_graph=True)
    return CudaGraphs("verify", None, attention, pool, table, [64, 256], width, trees=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 3, 7])
@pytest.mark.parametrize("count", [8, 24])
@torch.inference_mode()
def test_a_moved_tree_span_equals_the_span_loaded_where_it_moved(
    n: int, count: int, device: str
) -> None:
    """advance_trees gives the graph's inputs exactly what `load` gives for the tree spans
    each moved past its kept tokens and the one after: ids, rotary positions by level, slots
    of the cache positions after the root, masks, lengths; the padding untouched (on a GPU,
    the Triton kernel). The nodes are read as the extend leaves them: float64 columns of one
    block, after other columns."""
    k, context = 3, 80
    width = count + 1
    graphs = _graphs(width, context, device)
    rng = np.random.default_rng(n * 100 + count)
    table = graphs.req_to_token_pool.req_to_token
    table[:8] = torch.from_numpy(rng.integers(1, 64, size=(8, context))).to(device)
    host_table = table.cpu().numpy()
    rows = rng.permutation(8)[:n]
    starts = rng.integers(k, 20, size=n)

    def spans(starts, roots, trees) -> list[Span]:
        return [
            Span(
                int(row),
                int(start),
                [int(root), *tree.tokens],
                host_table[row, start : start + width].tolist(),
                positions=tree.positions(int(start)),
                visible=tree.visible(),
            )
            for row, start, root, tree in zip(rows, starts, roots, trees)
        ]

    before = [_random_tree(rng, count, k) for _ in range(n)]
    batch = graphs.load(spans(starts, rng.integers(3, 100, size=n), before))
    kept = rng.integers(0, k + 1, size=n)
    committed = rng.integers(3, 100, size=(n, k + 1))
    after = [_random_tree(rng, count, k) for _ in range(n)]
    nodes = np.array([[*t.tokens, *t.parents, *t.levels] for t in after], dtype=np.float64)
    block = np.concatenate([rng.random((n, 2 * k)), nodes, rng.random((n, k + 2))], axis=1)
    on_device = torch.from_numpy(block).to(device)
    graphs.advance_trees(
        batch,
        torch.from_numpy(kept).to(device),
        torch.from_numpy(committed).to(device),
        on_device[:, 2 * k : 2 * k + 3 * count],
        k,
    )
    moved = graphs.inputs.clone()

    graphs.load(spans(starts + kept + 1, committed[np.arange(n), kept], after))
    assert torch.equal(moved, graphs.inputs)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("queued_tree_verify")
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "draft", root / "target", 3, noise=0.3)
    return root / "target", root / "draft"


TREE = dict(speculative_topk=2, num_draft_tokens=10)


def _llm(models, device: str = "cpu", **kwargs) -> LLM:
    """The tree engine; on a CPU with emulated verify graphs, on a GPU with captured ones."""
    target, draft = models
    options = dict(kv_cache_tokens=8192, max_num_seqs=16) | kwargs
    llm = LLM(
        str(target), device=device, speculative_algorithm=SPEC, draft_model=str(draft),
        num_draft_steps=3, **TREE, **options,
    )  # fmt: skip
    if device != "cpu":
        return llm
    return with_emulated_graphs(llm, max_span=1 + TREE["num_draft_tokens"], trees=True)


def _plain(models, prompts, params, device: str = "cpu") -> list[list[int]]:
    return plain_outputs(models[0], prompts, params, device)


def _counted(llm: LLM, monkeypatch) -> dict[str, int]:
    """Counts of rounds, of verifies taken from the round before and of those queued from the
    device; each taken verify's buffer checked against the spans the host gathers for it."""
    worker = llm.engine.speculator
    run_tree_round = worker.verifier.tree_round

    def checked_tree_round(inputs, queue_next="none", launched=None):
        if launched is not None and launched.inputs is None:  # written by the device
            # The host gathered none of the trees: they are still on their way from the
            # device (reading them now, for the check, waits for them).
            assert inputs.trees is None and inputs.device_nodes is not None
            assert all(req.spec_state._pending is not None for req in inputs.requests)
            graphs, size = launched.batch.graph, launched.batch.graph_batch_size
            table = llm.engine.runner.req_to_token_pool
            k, rows = worker.num_draft_steps, table.max_context_len
            gathered = tree_round.gather_tree_round(inputs.requests, k, inputs.num_nodes, rows)
            nodes = np.stack([[t.tokens, t.parents, t.levels] for t in gathered.trees])
            assert inputs.device_nodes.tolist() == nodes.reshape(len(nodes), -1).tolist()
            expected = padded_columns(size, gathered.spans(), table.padding_row, trees=True)
            assert graphs.inputs[:, :size].tolist() == expected
            counts["checked"] += 1
        return run_tree_round(inputs, queue_next, launched)

    monkeypatch.setattr(worker.verifier, "tree_round", checked_tree_round)
    counts = count_rounds(llm, monkeypatch, tree_round, "queue_next_tree_verify")
    counts["checked"] = 0
    return counts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 6])
def test_tree_verifies_queued_from_the_device_change_no_output(models, monkeypatch, n, device):
    """Requests ending at different rounds (max_tokens, EOS for some): the device queues each
    next tree verify, the rounds take them, and the tokens are those of plain decoding;
    every slot comes back. On a GPU: captured graphs, the Triton kernels, CUDA events."""
    prompts, params = workload(4 + n, n, 30)
    expected = _plain(models, prompts, params, device)
    llm = _llm(models, device)
    counts = _counted(llm, monkeypatch)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert counts["from_device"] > 0 and counts["taken"] == counts["checked"] > 0
    assert counts["unread"] == counts["taken_from_device"] == counts["checked"]
    if n == 1:  # nothing ends but at the last round: every round but the first took one
        assert counts["taken"] == counts["from_device"] >= counts["rounds"] // 2
    check_empty(llm)


def test_tree_verifies_are_not_queued_without_graphs(models, monkeypatch):
    """Eager verify batches cannot be moved on the device: nothing is queued, the output is
    the same."""
    prompts, params = workload(9, 3, 30)
    expected = _plain(models, prompts, params)
    target, draft = models
    llm = LLM(
        str(target), device="cpu", speculative_algorithm=SPEC, draft_model=str(draft),
        num_draft_steps=3, kv_cache_tokens=8192, max_num_seqs=16, **TREE,
    )  # fmt: skip
    counts = _counted(llm, monkeypatch)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert counts["from_device"] == 0 and counts["rounds"] > 0


def test_requests_ending_under_a_tree_verify_queued_from_the_device(models, monkeypatch):
    """Stop tokens end requests while the next tree verify is queued: they are held until it
    has run, the output is plain decoding's, and the pools come back empty."""
    prompts, _ = workload(5, 6, 30)
    params, expected = stop_token_workload(models[0], prompts)
    llm = _llm(models)
    counts = _counted(llm, monkeypatch)
    engine, held = llm.engine, []
    finish_round = engine.speculator.finish_round

    def recorded_finish(*args, **kwargs):
        held.append(len(engine.speculative.held))  # ended under a queued verify this step
        return finish_round(*args, **kwargs)

    monkeypatch.setattr(engine.speculator, "finish_round", recorded_finish)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert counts["from_device"] > 0 and sum(held) > 0
    check_empty(llm)


@pytest.mark.parametrize("kv_cache_tokens", [8192, 300])
def test_aborts_and_retractions_under_a_tree_verify_queued_from_the_device(models, kv_cache_tokens):
    """A request aborted while its next tree verify is queued from the device, and (in a pool
    too small for every request) requests retracted meanwhile: the others' output is plain
    decoding's and every slot comes back."""
    prompts, _ = workload(6, 6, 30)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    expected = _plain(models, prompts, [params] * len(prompts))
    llm = _llm(models, kv_cache_tokens=kv_cache_tokens)
    requests, aborted = run_aborting_one(
        llm, prompts, params, lambda _, queued: queued.requests[-1]
    )
    assert aborted is not None, "no tree verify was queued from the device"
    for i, req in enumerate(requests):
        if req is not aborted:
            assert req.output_token_ids == expected[i]
    if kv_cache_tokens == 300:
        assert llm.engine.scheduler.num_retractions > 0
    check_empty(llm)
