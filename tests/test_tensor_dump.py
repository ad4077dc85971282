"""`--debug-tensor-dump-dir`: one folder per node, role and depth, one loadable file per forward
pass with the module outputs, input ids and positions; the draft's input hidden state is
spec_hidden_size wide; a speculative disaggregated run leaves disjoint trees on both node kinds."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import torch
from tiny_drafts import (
    make_copying_draft,
    make_good_draft,
    make_predictable_deep_llama,
    make_predictable_llama,
    target_config,
)

from cluster.commands.cli import build_parser
from cluster.commands.cli_commands import engine_args
from engine import LLM, SamplingParams
from engine.executor.debug_dump import refuse_cuda_graphs
from engine.loading.loader import EngineArgs

PROMPTS = [[1, 17, 99, 4, 250, 31, 8], [1, 200], [5] * 11]
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
ENGINE = dict(device="cpu", max_model_len=256, kv_cache_tokens=2048, max_num_seqs=8)
K = 3
ROLES = ["target", *(f"draft-{d}" for d in range(K))]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tensor_dump")
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "good", root / "target", K, noise=0.01)
    return root


def _speculative(folders: Path) -> dict:
    return dict(
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(folders / "good"),
        num_draft_steps=K,
        **ENGINE,
    )


def _files(folder: Path) -> list[Path]:
    """The folder's dump files, checked to be numbered 0, 1, ... with nothing else beside."""
    files = sorted(folder.iterdir())
    assert [f.name for f in files] == [f"forward_{i:06d}.pt" for i in range(len(files))]
    return files


def _load(path: Path) -> dict:
    record = torch.load(path, weights_only=True)
    num_tokens = record["input_ids"].shape[0]
    assert record["positions"].shape == (num_tokens,)
    assert int(record["extend_lens"].sum()) == num_tokens
    assert record["outputs"] and all(t.device.type == "cpu" for t in record["outputs"].values())
    return record


def _check_tree(node_root: Path, spec_hidden_size: int, hidden_size: int) -> dict[str, list]:
    """Every role's records under DIR/<node>/: the target's hold each layer's output per token,
    each depth's the hidden state it read (spec_hidden_size wide at depth 0)."""
    assert sorted(p.name for p in node_root.iterdir()) == sorted(ROLES)
    records = {}
    for role in ROLES:
        assert [p.name for p in (node_root / role).iterdir()] == ["rank0"]
        records[role] = [_load(f) for f in _files(node_root / role / "rank0")]
        assert records[role], f"{role} wrote nothing"
    for record in records["target"]:
        outputs, num_tokens = record["outputs"], record["input_ids"].shape[0]
        assert outputs["model.embed_tokens"].shape == (num_tokens, hidden_size)
        layers = [name for name in outputs if re.fullmatch(r"model\.layers\.\d+", name)]
        assert layers
        assert all(outputs[name].shape == (num_tokens, hidden_size) for name in layers)
        assert "lm_head" in outputs and "model.norm" in outputs
    for depth in range(K):
        width = spec_hidden_size if depth == 0 else hidden_size
        for record in records[f"draft-{depth}"]:
            num_tokens = record["input_ids"].shape[0]
            assert record["input_hidden"].shape == (num_tokens, width)
            assert record["outputs"]["layer"].shape == (num_tokens, hidden_size)
    # Each draft extend runs every depth once.
    assert len({len(records[f"draft-{d}"]) for d in range(K)}) == 1
    return records


def test_offline_dump_has_a_file_per_forward_for_target_and_each_depth(folders, tmp_path):
    expected = LLM(str(folders / "target"), **_speculative(folders)).generate(PROMPTS, PARAMS)
    llm = LLM(str(folders / "target"), debug_tensor_dump_dir=tmp_path, **_speculative(folders))
    outputs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]  # dumping is inert

    assert [p.name for p in tmp_path.iterdir()] == ["offline"]
    hidden = llm.model_config.hidden_size
    records = _check_tree(tmp_path / "offline", hidden, hidden)
    prefill = records["target"][0]
    assert prefill["input_ids"].tolist() == [t for p in PROMPTS for t in p]
    assert prefill["positions"].tolist() == [i for p in PROMPTS for i in range(len(p))]
    # Then verify passes: each request's newest token and its chain of at most K drafts.
    assert all(r["extend_lens"].max() <= K + 1 for r in records["target"][1:])


def test_layers_filter_and_a_wide_draft_input(tmp_path):
    """An EAGLE3-style draft reads three target layers side by side: depth 0's input is three
    hidden states wide. Only the layers asked for are dumped, embeddings and norm always."""
    target, draft = tmp_path / "target", tmp_path / "draft"
    make_predictable_deep_llama(target, num_layers=3)
    make_copying_draft(draft, target, K, noise=0.01, aux_layers=(0, 1, 2))
    llm = LLM(
        str(target),
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(draft),
        debug_tensor_dump_dir=tmp_path / "dump",
        debug_tensor_dump_layers=[1],
        **ENGINE,
    )
    llm.generate(PROMPTS, PARAMS)
    hidden = llm.model_config.hidden_size
    assert llm.model_config.spec_hidden_size == 3 * hidden
    records = _check_tree(tmp_path / "dump" / "offline", 3 * hidden, hidden)
    for record in records["target"]:
        layers = {name.split(".")[2] for name in record["outputs"] if name.startswith("model.l")}
        assert layers == {"1"}
        assert {"model.embed_tokens", "model.norm", "lm_head"} <= record["outputs"].keys()


def test_dump_settings_are_refused_with_the_reason(folders, tmp_path):
    with pytest.raises(ValueError, match="needs debug_tensor_dump_dir"):
        EngineArgs(debug_tensor_dump_layers=(0,))
    with pytest.raises(ValueError, match=r"\[5\] outside the target's layers 0..0"):
        LLM(str(folders / "target"), debug_tensor_dump_dir=tmp_path, debug_tensor_dump_layers=[5])
    LLM(str(folders / "target"), debug_tensor_dump_dir=tmp_path, **ENGINE).generate([[1]], PARAMS)
    with pytest.raises(ValueError, match="already holds a tensor dump"):
        LLM(str(folders / "target"), debug_tensor_dump_dir=tmp_path, **ENGINE)
    with pytest.raises(ValueError, match="needs eager mode"):
        refuse_cuda_graphs(dumping=True, cuda_graphs=True)
    refuse_cuda_graphs(dumping=False, cuda_graphs=True)
    refuse_cuda_graphs(dumping=True, cuda_graphs=False)


@pytest.mark.parametrize("command", ["serve", "generate", "demo"])
def test_cli_flags_and_help_say_where_files_go(command, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("COLUMNS", "200")
    positional = ["hi"] if command == "generate" else []
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "DIR/<node>/<target|draft-N>/rank0/forward_NNNNNN.pt" in help_text
    monkeypatch.chdir(tmp_path)
    flags = ["--debug-tensor-dump-dir", "dump", "--debug-tensor-dump-layers", "0,2"]
    args = engine_args(build_parser().parse_args([command, *positional, *flags]))
    # Absolute: cluster nodes run in other working directories.
    assert args.debug_tensor_dump_dir == str(tmp_path / "dump")
    assert args.debug_tensor_dump_layers == (0, 2)


def test_disaggregated_speculative_run_leaves_disjoint_trees(folders, tmp_path):
    pytest.importorskip("ray")  # the cluster runs on Ray
    from cluster_helpers import launch, wait_for

    cluster = launch(
        str(folders / "target"),
        prefill=1,
        decode=1,
        debug_tensor_dump_dir=str(tmp_path),
        **{k: v for k, v in _speculative(folders).items() if k != "device"},
    )
    try:

        async def run_all():
            async def one(i: int, prompt: list[int]):
                async for _ in cluster.router.generate(f"r{i}", prompt, PARAMS):
                    pass

            try:
                await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
            finally:
                await cluster.router.close()

        asyncio.run(run_all())
        assert wait_for(cluster.kv_pools_empty, 30)
    finally:
        cluster.shutdown()

    # Only the nodes wrote (the driver resolves the model but runs nothing), each in its own
    # tree, and every file lies in exactly one writer's folder.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode-0", "prefill-0"]
    folders_written = {tmp_path / n / r / "rank0" for n in ("prefill-0", "decode-0") for r in ROLES}
    assert {f.parent for f in tmp_path.rglob("*.pt")} == folders_written
    hidden = target_config(folders / "target").hidden_size
    prefill = _check_tree(tmp_path / "prefill-0", hidden, hidden)
    decode = _check_tree(tmp_path / "decode-0", hidden, hidden)
    # The prefill node runs prompts, the decode node verifies chains of at most K drafts.
    prompt_tokens = sorted(t for r in prefill["target"] for t in r["input_ids"].tolist())
    assert prompt_tokens == sorted(t for p in PROMPTS for t in p)
    assert all(r["extend_lens"].max() <= K + 1 for r in decode["target"])


def test_each_tensor_parallel_rank_dumps_its_own_shard(tmp_path):
    """Two ranks: each dumps its target's forwards into its own folder (rank0, rank1), the
    same passes with the same inputs; a column-parallel projection holds half the columns
    on each rank, and what the final norm reads (all-reduced) is the same on both."""
    from tiny_models import make_tiny_llama

    model = tmp_path / "model"
    make_tiny_llama(model, seed=3, vocab_size=322)
    dump = tmp_path / "dump"
    llm = LLM(str(model), device="cpu", tensor_parallel_size=2, debug_tensor_dump_dir=dump)
    try:
        llm.generate([[5, 17, 99, 5]], SamplingParams(max_tokens=3, temperature=0.0))
    finally:
        llm.close()
    ranks = [dump / "offline" / "target" / f"rank{r}" for r in (0, 1)]
    files = [sorted(folder.glob("forward_*.pt")) for folder in ranks]
    assert files[0] and [f.name for f in files[0]] == [f.name for f in files[1]]
    first = [torch.load(f[0], weights_only=True) for f in files]
    assert torch.equal(first[0]["input_ids"], first[1]["input_ids"])
    outputs = [dump["outputs"] for dump in first]
    assert outputs[0].keys() == outputs[1].keys()
    gate_up = next(name for name in outputs[0] if name.endswith("layers.0.mlp.gate_up_proj"))
    width = json.loads((model / "config.json").read_text())["intermediate_size"]
    # Whole, gate and up are 2 x width wide: each rank holds half of each.
    assert outputs[0][gate_up].shape[-1] == outputs[1][gate_up].shape[-1] == width
    norm = next(name for name in outputs[0] if name.endswith("norm") and "layers" not in name)
    torch.testing.assert_close(outputs[0][norm], outputs[1][norm])
