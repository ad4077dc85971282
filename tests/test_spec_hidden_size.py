"""`spec_hidden_size`, the width of the target hidden state a draft reads, derived once in the
model config: hidden_size * hc_mult for a target whose residual stream is widened (a
hyper-connection Llama), len(aux_layers) times that for an EAGLE3-style draft reading several
target layers. Both are lossless end to end, offline and through a prefill -> decode hand-off
whose hidden state crosses in a metadata row of that width; a width mismatch is refused at
start, naming both sizes."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from tiny_drafts import (
    make_copying_draft,
    make_eagle3_draft,
    make_predictable_deep_llama,
    make_predictable_llama,
    make_random_draft,
)
from tiny_models import make_tiny_hyper_llama, make_tiny_llama, widen_to_hyper_llama
from transformers import LlamaForCausalLM

from engine import LLM, ModelLoadError, SamplingParams
from engine.loading.loader import ModelSpec
from metadata.buffers import MetadataBuffers
from metadata.handshake import PairingError, check_compatible
from metadata.node_common import transfer_spec
from spec import DraftMismatchError, DraftState, build_speculator

SPEC = "multi-layer-eagle"
HIDDEN = 64
AUX_LAYERS = (1, 3, 5)
MAX_K = 3


@dataclasses.dataclass(frozen=True)
class Case:
    target: Path
    draft: Path
    spec_hidden_size: int
    good: bool  # the draft nearly reproduces the target: many drafts are accepted


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("spec_hidden_size")
    make_tiny_hyper_llama(root / "hc", seed=0, hc_mult=2)
    make_random_draft(root / "hc-random", root / "hc", MAX_K, seed=1)
    make_predictable_llama(root / "hc-predictable", seed=0)
    widen_to_hyper_llama(root / "hc-predictable", hc_mult=2, mix_noise=0.1)
    make_copying_draft(root / "hc-good", root / "hc-predictable", MAX_K, noise=0.01)
    make_tiny_llama(root / "deep", seed=0, num_hidden_layers=6)
    make_eagle3_draft(root / "eagle3-random", root / "deep", MAX_K, AUX_LAYERS, seed=1)
    make_predictable_deep_llama(root / "deep-predictable", num_layers=6)
    make_copying_draft(
        root / "eagle3-good", root / "deep-predictable", MAX_K, noise=0.01, aux_layers=AUX_LAYERS
    )
    make_tiny_llama(root / "plain", seed=0)  # the hc target's shapes, with one copy
    return {
        "plain": Case(root / "plain", root / "plain-draft", HIDDEN, False),
        "hc-random": Case(root / "hc", root / "hc-random", 2 * HIDDEN, False),
        "hc-good": Case(root / "hc-predictable", root / "hc-good", 2 * HIDDEN, True),
        "eagle3-random": Case(root / "deep", root / "eagle3-random", 3 * HIDDEN, False),
        "eagle3-good": Case(root / "deep-predictable", root / "eagle3-good", 3 * HIDDEN, True),
    }


def _llm(target: Path, draft: Path | None = None, k: int | None = None) -> LLM:
    kw = {}
    if draft is not None:
        kw = dict(speculative_algorithm=SPEC, draft_model=str(draft), num_draft_steps=k)
    return LLM(str(target), device="cpu", kv_cache_tokens=2048, max_num_seqs=8, **kw)


def _workload(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(1, 30))] for _ in range(n)]
    params = [
        SamplingParams(max_tokens=rng.randint(1, 20), temperature=0, ignore_eos=True)
        for _ in range(n)
    ]
    return prompts, params


_baselines: dict[tuple, list[list[int]]] = {}


def _baseline(target: Path, prompts, params, key: tuple) -> list[list[int]]:
    if key not in _baselines:
        _baselines[key] = [o.token_ids for o in _llm(target).generate(prompts, params)]
    return _baselines[key]


KINDS = ["hc-random", "hc-good", "eagle3-random", "eagle3-good"]


@pytest.mark.parametrize("batch_size", [1, 6])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_output_equals_the_target_alone(cases, kind: str, k: int, batch_size: int):
    case = cases[kind]
    prompts, params = _workload(batch_size, seed=batch_size)
    expected = _baseline(case.target, prompts, params, (kind, batch_size))
    llm = _llm(case.target, case.draft, k)
    config = llm.model_config
    assert config.spec_hidden_size == case.spec_hidden_size
    assert config.draft_aux_layers == (AUX_LAYERS if kind.startswith("eagle3") else ())
    depth0 = llm.engine.speculator.depths[0].module
    assert depth0.hnorm.weight.shape == (case.spec_hidden_size,)
    assert depth0.fc.weight.shape == (HIDDEN, HIDDEN + case.spec_hidden_size)

    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert llm.engine.kv_cache.is_empty() and llm.engine.speculator.is_empty()
    if case.good and batch_size > 1:
        details = [o.usage.completion_tokens_details for o in outputs]
        assert sum(d.accepted_prediction_tokens for d in details) > 0


def test_eagle3_draft_reads_the_aux_layers_outputs_side_by_side(cases) -> None:
    """Checked against transformers' hidden states: layer i's output is hidden_states[i + 1]
    (the last one after the final norm)."""
    case = cases["eagle3-random"]
    llm = _llm(case.target, case.draft)
    prompt = [1, 17, 99, 4, 250, 31, 8]
    core, runner = llm.engine, llm.engine.runner
    req = core.make_request("0", prompt, SamplingParams(max_tokens=1))
    core.kv_cache.grow(req, len(prompt))
    out = runner.forward(runner.build_batch([req]), keep_hidden=True)
    core.kv_cache.release(req)
    assert out.hidden.shape == (len(prompt), 3 * HIDDEN)
    torch.testing.assert_close(out.last_hidden[0], out.hidden[-1])
    hf = LlamaForCausalLM.from_pretrained(case.target).eval()
    with torch.no_grad():
        reference = hf(torch.tensor([prompt]), output_hidden_states=True)
    pieces = out.hidden.split(HIDDEN, dim=-1)
    for layer, piece in zip(AUX_LAYERS, pieces):
        if layer == hf.config.num_hidden_layers - 1:
            piece = runner.model.model.norm(piece)
        torch.testing.assert_close(
            piece, reference.hidden_states[layer + 1][0], atol=1e-4, rtol=1e-4
        )
    # The LM head still reads the last layer alone.
    torch.testing.assert_close(out.logits[0], reference.logits[0, -1], atol=1e-4, rtol=1e-4)


def _copy_kv(src_pool, src_slots: list[int], dst_pool, dst_slots: list[int]) -> None:
    for layer in range(src_pool.num_layers):
        for buffers in ("k_buffers", "v_buffers"):
            getattr(dst_pool, buffers)[layer][dst_slots] = getattr(src_pool, buffers)[layer][
                src_slots
            ]


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_to_decode_hand_off_is_lossless(cases, kind: str) -> None:
    """Two engines in one process: the prefill engine's KV (target and every depth) and draft
    state cross into the decode engine's reserved slots, the target hidden state in a metadata
    row that is spec_hidden_size wide on both sides."""
    case = cases[kind]
    prefill, decode = _llm(case.target, case.draft).engine, _llm(case.target, case.draft).engine
    prompts, params = _workload(5, seed=11)
    expected = _baseline(case.target, prompts, params, (kind, "hand-off"))
    width = prefill.runner.model_config.spec_hidden_size
    assert width == decode.runner.model_config.spec_hidden_size == case.spec_hidden_size
    k = prefill.speculator.num_draft_steps
    sender = MetadataBuffers(4, width, k, 1, torch.float32, "cpu", boundary_width=HIDDEN)
    receiver = MetadataBuffers(4, width, k, 1, torch.float32, "cpu", boundary_width=HIDDEN)
    received = []
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        sent = prefill.make_request(str(i), prompt, param)
        prefill.add_request(sent)
        prefill.step()
        req = decode.make_request(str(i), prompt, param)
        n = len(prompt)
        if sent.finished:  # max_tokens = 1: nothing left to decode
            assert expected[i] == sent.output_token_ids
            continue
        state = prefill.speculator.export_state(sent)
        assert state.target_hidden.shape == (width,)
        assert state.boundary_hidden.shape == (k - 1, HIDDEN)
        # The hidden state crosses in a metadata row, as between two nodes.
        row = sender.allocate()
        sender.write_row(
            row,
            room=i + 1,
            output_id=sent.output_token_ids[0],
            output_logprob=0.0,
            hidden_state=state.target_hidden,
            topk_index=torch.tensor(state.draft_token_ids),
            topk_p=torch.tensor(state.draft_probs),
            boundary_hidden=state.boundary_hidden,
        )
        landed = receiver.allocate()
        receiver.copy_row_from(landed, [t.clone() for t in sender.row_tensors(row)])
        assert receiver.row_landed(landed, i + 1)
        state = DraftState(
            num_prefilled=n,
            draft_token_ids=receiver.topk_index[landed].tolist(),
            draft_probs=receiver.topk_p[landed].tolist(),
            target_hidden=receiver.hidden_states[landed].clone(),
            boundary_hidden=receiver.boundary_hidden[landed].clone(),
        )
        sender.free(row)
        receiver.free(landed)

        decode.kv_cache.grow(req, n + param.max_tokens)
        decode.speculator.reserve(req, n + param.max_tokens)
        _copy_kv(prefill.runner.kv_pool, sent.slots[:n], decode.runner.kv_pool, req.slots[:n])
        pairs = zip(prefill.speculator.depth_kv(sent, n), decode.speculator.depth_kv(req, n))
        for (src_pool, src_slots), (dst_pool, dst_slots) in pairs:
            _copy_kv(src_pool, src_slots, dst_pool, dst_slots)
        req.output_token_ids.append(int(receiver.output_ids[landed]))
        req.kv_len = n
        decode.speculator.adopt(req, state)
        decode.scheduler.add_running(req)
        prefill.scheduler.abort(sent.request_id)
        received.append((i, req))
    assert prefill.kv_cache.is_empty() and prefill.speculator.is_empty()
    while decode.has_work():
        decode.step()
    for i, req in received:
        assert req.output_token_ids == expected[i]
    assert decode.kv_cache.is_empty() and decode.speculator.is_empty()
    if case.good:
        assert sum(req.spec_stats.accepted_tokens for _, req in received) > 0


# --- (c) a width mismatch is refused at start, naming both sizes ---


def test_a_draft_for_the_widened_stream_is_refused_by_a_plain_target(cases, tmp_path) -> None:
    plain = cases["plain"].target
    with pytest.raises(DraftMismatchError, match="spec_hidden_size: draft 128, target 64"):
        _llm(plain, cases["hc-random"].draft)
    plain_draft = make_random_draft(tmp_path / "plain-draft", plain, 2)
    with pytest.raises(DraftMismatchError, match="spec_hidden_size: draft 64, target 128"):
        _llm(cases["hc-random"].target, plain_draft)


def test_an_eagle3_draft_needs_a_runner_built_for_its_layers(cases) -> None:
    """A target built without deriving its config for the draft is refused by the speculator,
    naming the layers and both widths."""
    case = cases["eagle3-random"]
    runner = _llm(case.target).engine.runner
    assert runner.model_config.spec_hidden_size == HIDDEN
    with pytest.raises(DraftMismatchError) as error:
        build_speculator(SPEC, runner, case.draft)
    message = str(error.value)
    assert "aux_layers: draft [1, 3, 5], target []" in message
    assert "spec_hidden_size: draft 192, target 64" in message


def test_an_eagle3_draft_declaring_another_width_is_refused(cases, tmp_path) -> None:
    draft = tmp_path / "draft"
    make_eagle3_draft(draft, cases["eagle3-random"].target, 1, AUX_LAYERS)
    raw = json.loads((draft / "config.json").read_text())
    assert raw["aux_layers"] == list(AUX_LAYERS) and raw["spec_hidden_size"] == 192
    (draft / "config.json").write_text(json.dumps({**raw, "spec_hidden_size": 128}))
    with pytest.raises(DraftMismatchError, match="spec_hidden_size: draft 128, target 192"):
        _llm(cases["eagle3-random"].target, draft)


def test_aux_layers_the_target_lacks_are_refused(cases, tmp_path) -> None:
    draft = make_eagle3_draft(tmp_path / "draft", cases["eagle3-random"].target, 1, AUX_LAYERS)
    with pytest.raises(DraftMismatchError, match=r"layers \[1, 3, 5\].*has 2 layers \(0\.\.1\)"):
        _llm(cases["hc-random"].target, draft)
    raw = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**raw, "aux_layers": [1, 1, -2]}))
    with pytest.raises(ModelLoadError, match="aux_layers must be a list of distinct"):
        _llm(cases["eagle3-random"].target, draft)


@pytest.mark.parametrize("kind", ["hc-random", "eagle3-random"])
def test_pairing_and_metadata_refuse_another_width(cases, kind: str) -> None:
    """With the real derived widths: a node whose target runs the draft and one whose does not
    cannot pair, and a metadata row of one width refuses the other's hidden state."""
    case = cases[kind]
    ours = _llm(case.target, case.draft)
    # The hc target's shapes with one copy; the EAGLE3 draft's target run without the draft.
    plain = _llm(cases["plain"].target if kind == "hc-random" else case.target)
    wide = ModelSpec(case.target, ours.model_config, ours.config, None)
    narrow = ModelSpec(case.target, plain.model_config, plain.config, None)
    width, narrow_width = case.spec_hidden_size, plain.model_config.spec_hidden_size
    assert narrow_width == HIDDEN
    with pytest.raises(PairingError, match=f"spec_hidden_size {width} != {narrow_width}"):
        check_compatible(transfer_spec(wide), transfer_spec(narrow))
    buffers = MetadataBuffers(2, narrow_width, 1, 1, torch.float32, "cpu")
    with pytest.raises(ValueError, match=f"width {width} != spec_hidden_size {narrow_width}"):
        buffers.write_row(
            buffers.allocate(),
            room=1,
            output_id=0,
            output_logprob=0.0,
            hidden_state=torch.zeros(width),
        )


def test_aux_layers_on_a_hyper_connection_target_read_whole_streams(cases, tmp_path) -> None:
    """Both at once: each auxiliary layer's stream, flattened, side by side."""
    target = cases["hc-random"].target
    draft = make_eagle3_draft(tmp_path / "draft", target, 2, (0, 1))
    prompts, params = _workload(4, seed=5)
    expected = _baseline(target, prompts, params, ("hc-random", "aux"))
    llm = _llm(target, draft)
    assert llm.model_config.spec_hidden_size == 2 * 2 * HIDDEN
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
