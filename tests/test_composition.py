"""One composition root: every engine (`engine.LLM`, the prefill, decode and aggregated nodes)
is built by `engine.build.build_engine` with its speculation injected, and the engine never
imports spec: `from engine import LLM` finds spec's `Speculation` by name, through the entry
point an installed pdcluster declares (pyproject.toml), without spec ever being imported by the
engine's modules."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from tiny_drafts import make_good_draft, make_predictable_llama

from engine import LLM, SamplingParams
from engine.speculation import ENTRY_POINT_GROUP
from spec.compose import MULTI_LAYER_EAGLE, MultiLayerEagle

ROOT = Path(__file__).resolve().parent.parent
SPEC = "multi-layer-eagle"
# Packages above the engine, and the serving stack it runs without (docs/DESIGN.md, "Layout").
ABOVE_ENGINE = ("spec", "cluster", "prefill_node", "decode_node", "metadata", "ray", "zmq")
PROMPTS = [[5, 9, 14, 3, 22], [40, 41, 42]]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
ENGINE = dict(device="cpu", kv_cache_tokens=4096, max_num_seqs=4)


def imported_packages(source: str) -> set[str]:
    """The top-level packages `source` imports, at module level or inside any function."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_import_scan_sees_imports_inside_functions() -> None:
    source = "import os\n\ndef f():\n    from spec.compose import x\n    import ray.util\n"
    assert imported_packages(source) == {"os", "spec", "ray"}


def test_no_engine_module_imports_spec_or_anything_above_the_engine() -> None:
    modules = sorted((ROOT / "engine").rglob("*.py"))
    assert len(modules) > 40
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path.read_text()) & set(ABOVE_ENGINE))
        for path in modules
    }
    assert {path: found for path, found in offenders.items() if found} == {}


def called_names(source: str) -> set[str]:
    """The names of the functions and classes `source` calls, bare or as attributes."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            found.add(func.id if isinstance(func, ast.Name) else getattr(func, "attr", ""))
    return found


def test_engines_are_built_in_one_place() -> None:
    """No package builds an EngineCore or loads a runner but engine/build.py (through
    engine/loading/loader.py's load_runner): LLM and every node kind go through build_engine."""
    builders = {"EngineCore", "ModelRunner", "load_runner"}
    packages = ("engine", "spec", "cluster", "prefill_node", "decode_node", "metadata")
    found = {
        str(path.relative_to(ROOT)): sorted(called_names(path.read_text()) & builders)
        for package in packages
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {path: names for path, names in found.items() if names} == {
        "engine/build.py": ["EngineCore", "load_runner"],
        "engine/loading/loader.py": ["ModelRunner"],
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("composition")
    make_predictable_llama(root / "target", seed=0)
    make_good_draft(root / "draft", root / "target", 2, noise=0.05)
    return {"target": root / "target", "draft": root / "draft"}


def _plain_tokens(models: dict[str, Path]) -> list[list[int]]:
    llm = LLM(str(models["target"]), **ENGINE)
    return [out.token_ids for out in llm.generate(PROMPTS, PARAMS)]


def _installed_metadata(folder: Path) -> Path:
    """The metadata `pip install` writes for pdcluster, as far as entry points go: its name and
    the entry points pyproject.toml declares."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dist = folder / f"{project['name']}-{project['version']}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    lines = []
    for group, entries in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines.extend(f"{name} = {target}" for name, target in entries.items())
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return folder


PROBE = """
import json, sys
from engine import LLM, SamplingParams
imported_with_engine = "spec" in sys.modules
llm = LLM(sys.argv[1], device="cpu", kv_cache_tokens=4096, max_num_seqs=4,
          speculative_algorithm="multi-layer-eagle", draft_model=sys.argv[2])
params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
outs = llm.generate(json.loads(sys.argv[3]), params)
print(json.dumps({
    "imported_with_engine": imported_with_engine,
    "speculator": type(llm.engine.speculator).__name__,
    "tokens": [o.token_ids for o in outs],
    "verify_steps": sum(o.usage.spec_verify_steps or 0 for o in outs),
}))
"""


def test_engine_llm_speculates_through_the_declared_entry_point(models, tmp_path: Path) -> None:
    """A fresh process that imports only the engine: spec is not loaded with it, and the
    speculative LLM finds multi-layer EAGLE through pyproject's entry point, decoding what plain
    decoding does."""
    assert (
        ENTRY_POINT_GROUP
        in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    )
    site = _installed_metadata(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    run = subprocess.run(
        [sys.executable, "-c", PROBE, str(models["target"]), str(models["draft"])]
        + [json.dumps(PROMPTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["imported_with_engine"] is False
    assert seen["speculator"] == "MultiLayerEagleWorker"
    assert seen["verify_steps"] > 0
    assert seen["tokens"] == _plain_tokens(models)


class RecordingEagle(MultiLayerEagle):
    """Multi-layer EAGLE that keeps the speculators it builds."""

    def __init__(self) -> None:
        self.built: list = []

    def speculator(self, args, runner):
        worker = super().speculator(args, runner)
        self.built.append(worker)
        return worker


def test_llm_runs_the_speculation_it_is_given(models) -> None:
    given = RecordingEagle()
    llm = LLM(
        str(models["target"]),
        **ENGINE,
        speculative_algorithm=SPEC,
        draft_model=str(models["draft"]),
        speculation=given,
    )
    assert len(given.built) == 1 and llm.engine.speculator is given.built[0]
    outs = llm.generate(PROMPTS, PARAMS)
    assert sum(o.usage.spec_verify_steps or 0 for o in outs) > 0
    assert [o.token_ids for o in outs] == _plain_tokens(models)


def test_a_plain_engine_refuses_a_speculation(models) -> None:
    with pytest.raises(ValueError, match="without speculative_algorithm"):
        LLM(str(models["target"]), **ENGINE, speculation=MULTI_LAYER_EAGLE)
