"""GPU decode step: engine.LLM with and without CUDA graphs and overlap scheduling against
transformers, ms per step.

    python bench/gpu_step.py [--models smollm2 llama8b] [--batch-sizes 1 16 64] [--steps 128]
        [--repeats 3] [--model PATH|default [--spec]] [--skip-hf | --hf-models M ...] [--no-write]

One process, one CUDA GPU, bfloat16. A step costs (t(16 + STEPS new tokens) - t(16)) / STEPS,
greedy, EOS ignored, the same pseudo-random --prompt-len token ids in every row, median of
--repeats after a warm-up with every length timed, for: the engine with CUDA graphs
(disable_cuda_graph=False; "n/a" where LLM lacks the keyword) with and without overlap
scheduling (overlap_schedule), and without graphs; transformers' generate,
eager, and with a static cache and CompileConfig(fullgraph=True, dynamic=False,
mode="reduce-overhead"), which transformers 5 uses to compile the decode forward itself (the
cache's size is part of the compiled shape: hence the warm-up with every length). HBM floor =
weight bytes / B, B = (bytes read + bytes written) / seconds of a large device-to-device copy in
this run; weight bytes = what a step reads once in bf16: decoder layers, final norm, LM head (the
input embedding, of which a step reads B rows, and the KV cache are left out).
"smollm2" and "llama8b" have SmolLM2-135M-Instruct's and Llama-3-8B's shapes with random weights
(speed does not depend on them), saved with a byte-level tokenizer under /tmp; "qwen3-8b",
"gemma3-270m" and "qwen3-moe-12l" Qwen3-8B's, Gemma 3 270M's and Qwen3-30B-A3B's (12 of its 48
layers), built with transformers' classes of each family (bench/random_models.py; "tiny*": a
smoke run on a CPU). A MoE's HBM floor counts its router and one token's experts alone (what a
step at batch 1 reads; at larger batches the tokens read more experts). A transformers column
that fails for a model (an error other than out of memory) is skipped at its larger batch
sizes with the reason; --model gives a
real folder for smollm2 ("default": the embedded model), and --spec then compares plain and
speculative tokens/s (multi-layer-eagle, the shipped draft) on held-out chat prompts. A failed
measurement leaves its error in its cell. Prints tables and rewrites the "GPU decode step"
section of docs/BENCHMARKS.md (raw figures in docs/bench/gpu_step.json)."""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.random_models import SHAPES, random_model, weight_bytes  # noqa: E402
from bench.report import write_section  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

BATCHES = {"smollm2": [1, 16, 64], "llama8b": [1, 32], "qwen3-8b": [1, 32], "gemma3-270m": [1, 64]}
BATCHES |= {"qwen3-moe-12l": [1, 32], "tiny": [1, 4], "tiny-qwen3": [1, 4], "tiny-gemma3": [1, 4]}
BATCHES |= {"tiny-qwen3-moe": [1, 4]}
SHORT, MAX_MODEL_LEN, SPEC_MAX_TOKENS, STARTUP_TARGET_S = 16, 1024, 128, 30.0
COLUMNS = [
    "engine_graphs",
    "engine_graphs_no_overlap",
    "engine_eager",
    "hf_eager",
    "hf_compiled",
    "hbm_floor",
]
# The engine's variants: (column, CUDA graphs, overlap scheduling).
ENGINE_VARIANTS = [
    ("engine_graphs", True, True),
    ("engine_graphs_no_overlap", True, False),
    ("engine_eager", False, True),
]
TARGETS: dict[tuple[str, int], tuple[str, Callable[[dict], bool]]] = {
    ("smollm2", 1): (
        "<= 1.5 ms, >= 2x faster than HF compiled",
        lambda r: r["engine_graphs"] <= 1.5 and r["hf_compiled"] >= 2 * r["engine_graphs"],
    ),
    ("smollm2", 64): ("<= 3 ms", lambda r: r["engine_graphs"] <= 3.0),
    ("llama8b", 1): ("<= 1.2x HBM floor", lambda r: r["engine_graphs"] <= 1.2 * r["hbm_floor"]),
    ("llama8b", 32): ("<= 1.5x HBM floor", lambda r: r["engine_graphs"] <= 1.5 * r["hbm_floor"]),
    ("qwen3-8b", 1): ("<= 1.25x HBM floor", lambda r: r["engine_graphs"] <= 1.25 * r["hbm_floor"]),
    # The floor of a MoE: the weights of one token's experts (bench.random_models.weight_bytes).
    ("qwen3-moe-12l", 1): ("<= 2x HBM floor", lambda r: r["engine_graphs"] <= 2 * r["hbm_floor"]),
}
SPEC_TARGETS = {1: 2.0, 64: 1.2}


def log(message: str) -> None:
    print(f"[gpu_step] {message}", flush=True)


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fmt(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def cell(fn: Callable[[], Any], what: str) -> Any:
    """fn()'s value, or its error as text: one failed measurement never ends the run."""
    try:
        value = fn()
    except torch.cuda.OutOfMemoryError:
        value = "error: OOM"
    except Exception as err:
        traceback.print_exc()
        value = f"error: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:80]}"
    free()
    log(f"{what}: {fmt(value[0] if isinstance(value, tuple) else value)}")
    return value


def verdict(check: Callable[[Any], bool], data: Any) -> str:
    try:
        return "yes" if check(data) else "no"
    except TypeError:  # a figure is missing: text where a number should be
        return "?"


def copy_bandwidth(device: str, size: int, iters: int = 20) -> float:
    """(bytes read + bytes written) per second of a device-to-device copy of `size` bytes."""
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    started = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    return 2 * size * iters / (time.perf_counter() - started)


def per_step_ms(generate: Callable[[int], int], device: str, args: argparse.Namespace) -> float:
    """`generate(n)` makes n new tokens per row and returns how many it made."""

    def seconds(n: int) -> float:
        sync(device)
        started = time.perf_counter()
        made = generate(n)
        sync(device)
        assert made == n, f"asked for {n} new tokens, got {made}"
        return time.perf_counter() - started

    seconds(SHORT)  # the warm-up runs every length that is timed
    seconds(SHORT + args.steps)
    runs = [seconds(SHORT + args.steps) - seconds(SHORT) for _ in range(args.repeats)]
    return statistics.median(runs) / args.steps * 1e3


def hf_generate(model: Any, x: torch.Tensor, **kw: Any) -> Callable[[int], int]:
    """n -> new tokens per row that transformers' greedy generate made when asked for n."""
    kw.update(attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=0)
    return lambda n: (
        model.generate(x, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, **kw).shape[1]
        - x.shape[1]
    )


def engine_generate(llm: LLM, prompts: list[list[int]]) -> Callable[[int], int]:
    """n -> fewest new tokens of any row that the engine made when asked for n."""

    def generate(n: int) -> int:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        return min(len(o.token_ids) for o in llm.generate(prompts, params))

    return generate


def build(model: str | None, args: argparse.Namespace, graphs: bool, max_bs: int, what: str,
          **kw: Any) -> tuple[Any, LLM | None]:  # fmt: skip
    """(seconds to construct the engine, or why there is none; the engine or None). With
    graphs=True and an LLM lacking the CUDA-graph keywords: ("n/a", None)."""
    kw.update(device=args.device, dtype=args.dtype, max_num_seqs=max_bs)
    if args.attention_backend:
        kw["attention_backend"] = args.attention_backend
    graph_kw: dict[str, Any] = {"disable_cuda_graph": not graphs}
    if graphs:
        graph_kw["cuda_graph_max_bs"] = max_bs

    def construct() -> tuple[Any, LLM | None]:
        started = time.perf_counter()
        try:
            llm = LLM(model, **kw, **graph_kw)
        except TypeError as err:
            if "unexpected keyword" not in str(err):
                raise
            log(f"LLM lacks the CUDA-graph keywords ({err})")
            if graphs:
                return "n/a", None
            started, llm = time.perf_counter(), LLM(model, **kw)
        sync(args.device)
        return time.perf_counter() - started, llm

    built = cell(construct, f"{what} startup s")
    return (built, None) if isinstance(built, str) else built


def bench_model(
    name: str, args: argparse.Namespace, batches: list[int], bandwidth: float, scratch: Path
) -> tuple[list[dict], dict]:
    from transformers import AutoConfig, AutoModelForCausalLM, CompileConfig

    hf = None
    if name == "smollm2" and args.model is not None:
        from engine.loading.default_model import default_model_path

        engine_model = None if args.model == "default" else args.model
        path = Path(args.model) if engine_model else default_model_path()
    else:
        path = scratch / name
        engine_model = str(path)
        log(f"{name}: random weights into {path}")
        hf = random_model(name, path, args.device)
    config = AutoConfig.from_pretrained(path)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (args.prompt_len,), generator=generator).tolist()
    rows = [{"model": name, "batch": b, "hbm_floor": 1e3 * weight_bytes(config) / bandwidth}
            for b in batches]  # fmt: skip
    compiled = CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead")
    static = dict(cache_implementation="static", compile_config=compiled)
    # The engine first, transformers after: a call that runs out of time while compiling
    # transformers (minutes for a large vocabulary) still logs the engine's columns.
    hf = None
    free()
    startup: dict[str, Any] = {"model": name}
    for column, graphs, overlap in ENGINE_VARIANTS:
        startup[column], llm = build(
            engine_model, args, graphs, max(batches), f"{name} {column}",
            max_model_len=MAX_MODEL_LEN, kv_cache_tokens=max(batches) * MAX_MODEL_LEN,
            overlap_schedule=overlap,
        )  # fmt: skip
        for r in rows:
            if llm is None:
                r[column] = "n/a" if startup[column] == "n/a" else "not built"
                continue
            generate = engine_generate(llm, [ids] * r["batch"])
            what = f"{name} b={r['batch']} {column}"
            r[column] = cell(lambda g=generate: per_step_ms(g, args.device, args), what)
        llm = generate = None
        free()
    cannot: dict[str, str] = {}  # column: why transformers could not run this model there
    for r in rows:
        if args.skip_hf or (args.hf_models is not None and name not in args.hf_models):
            r["hf_eager"] = r["hf_compiled"] = "skipped"
            continue
        if hf is None:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
            hf = hf.to(args.device).eval()
        x = torch.tensor([ids] * r["batch"], device=args.device)
        for column, extra in (("hf_eager", {}), ("hf_compiled", static)):
            if column in cannot:  # the same failure at every batch size, compiled anew each time
                r[column] = f"skipped ({cannot[column]})"
                continue
            generate = hf_generate(hf, x, **extra)
            what = f"{name} b={r['batch']} {column}"
            r[column] = cell(lambda g=generate: per_step_ms(g, args.device, args), what)
            if isinstance(r[column], str) and r[column] != "error: OOM":
                cannot[column] = f"transformers failed at b={r['batch']}"
    hf = generate = None
    torch._dynamo.reset()  # lets go of the compiled graphs and their memory pools
    free()
    startup["met"] = verdict(lambda s: s["engine_graphs"] < STARTUP_TARGET_S, startup)
    for r in rows:
        r["target"], check = TARGETS.get((name, r["batch"]), ("-", None))
        r["met"] = "-" if check is None else verdict(check, r)
    return rows, startup


def bench_spec(args: argparse.Namespace, batches: list[int]) -> list[dict]:
    """Plain vs speculative tokens/s, graphs on both, over held-out chat prompts."""
    from spec.default_draft import default_draft_path
    from spec.train.prompts import heldout_prompts

    if default_draft_path() is None:
        log("no shipped draft installed: speculation skipped")
        return []
    model = None if args.model == "default" else args.model
    # Speculation's own speed at each batch size: a round at every step.
    spec_kw = dict(
        speculative_algorithm="multi-layer-eagle",
        draft_model=default_draft_path(),
        speculative_plan="always",
    )
    got: dict[str, dict[int, Any]] = {}
    for side, extra in (("plain", {}), ("spec", spec_kw)):
        why, llm = build(model, args, True, max(batches), side, max_model_len=2048,
                       kv_cache_tokens=max(batches) * 2048, **extra)  # fmt: skip
        if llm is None:
            got[side] = dict.fromkeys(batches, "n/a" if why == "n/a" else "not built")
            continue
        chats = heldout_prompts()
        prompts = [llm.apply_chat_template(chats[i % len(chats)]) for i in range(max(batches))]
        got[side] = {
            b: cell(lambda b=b, e=llm, p=prompts: spec_run(e, p, b), f"{side} b={b} tok/s")
            for b in batches
        }
        llm = None
        free()
    rows = []
    for b in batches:
        p, s = got["plain"][b], got["spec"][b]
        goal = SPEC_TARGETS.get(b)
        row = {"batch": b, "plain_tok_s": p, "spec_tok_s": s, "speedup": "?", "identical": "?",
               "target": "-" if goal is None else f">= {goal}x"}  # fmt: skip
        if isinstance(p, tuple) and isinstance(s, tuple):
            same = "yes" if p[1] == s[1] else "NO"
            row.update(plain_tok_s=p[0], spec_tok_s=s[0], speedup=s[0] / p[0], identical=same)
        elif isinstance(p, tuple) or isinstance(s, tuple):  # keep no token lists in the row
            row.update(plain_tok_s=fmt(p[0]) if isinstance(p, tuple) else p)
            row.update(spec_tok_s=fmt(s[0]) if isinstance(s, tuple) else s)
        row["met"] = "-" if goal is None else verdict(lambda r, g=goal: r["speedup"] >= g, row)
        rows.append(row)
    return rows


def spec_run(llm: LLM, prompts: list[list[int]], batch: int) -> tuple[float, list]:
    """(tokens/s, tokens) over all prompts, `batch` at a time, greedy, stopping at EOS."""
    llm.generate(prompts[:batch], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    params = SamplingParams(max_tokens=SPEC_MAX_TOKENS, temperature=0)
    outputs, started = [], time.perf_counter()
    for start in range(0, len(prompts), batch):
        outputs += llm.generate(prompts[start : start + batch], params)
    elapsed = time.perf_counter() - started
    return sum(len(o.token_ids) for o in outputs) / elapsed, [o.token_ids for o in outputs]


def table(header: list[str], rows: list[list[Any]]) -> tuple[str, str]:
    """The same table as aligned plain text and as markdown."""
    rows = [[fmt(x) for x in r] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    text = "\n".join("  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in [header, *rows])
    md = ["| " + " | ".join(header) + " |", "|" + " ---: |" * len(header)]
    return text, "\n".join(md + ["| " + " | ".join(r) + " |" for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=["smollm2", "llama8b"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="for every model")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--model", help="a real SmolLM2 folder for smollm2, or 'default'")
    parser.add_argument("--spec", action="store_true", help="plain vs speculative (with --model)")
    parser.add_argument("--skip-hf", action="store_true", help="leave out the transformers columns")
    parser.add_argument(
        "--hf-models", nargs="+", choices=list(SHAPES), help="transformers columns for these only"
    )
    parser.add_argument("--attention-backend", help="passed to LLM when given")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-write", action="store_true", help="print only, leave docs/ alone")
    args = parser.parse_args()
    import torch._dynamo
    import transformers

    torch._dynamo.config.cache_size_limit = 64  # HF compiled: a graph per batch and cache size
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    command = "python bench/gpu_step.py " + " ".join(sys.argv[1:])
    cuda = torch.device(args.device).type == "cuda"
    gpu = torch.cuda.get_device_name() if cuda else f"no GPU ({args.device})"
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    log(f"{gpu}, {versions}")
    bandwidth = copy_bandwidth(args.device, (2048 if cuda else 64) << 20)
    free()
    log(f"copy bandwidth, bytes read + written: {bandwidth / 1e9:.1f} GB/s")
    rows, startups, spec_rows = [], [], []
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="gpu_step_") as scratch:
        for name in args.models:
            batches = args.batch_sizes or BATCHES[name]
            try:
                got, startup = bench_model(name, args, batches, bandwidth, Path(scratch))
                rows, startups = rows + got, [*startups, startup]
            except Exception as err:
                traceback.print_exc()
                log(f"{name}: failed before its timings: {err}")
            free()
            for leftover in Path(scratch).glob(f"{name}/*"):  # 16 GB for llama8b
                leftover.unlink()
    if args.spec and args.model is not None and "smollm2" in args.models:
        spec_rows = bench_spec(args, args.batch_sizes or BATCHES["smollm2"])
    elif args.spec:
        log("--spec needs --model (a real SmolLM2 folder, or 'default') and smollm2: skipped")

    main_text, main_md = table(
        ["model", "batch", "engine graphs", "graphs, no overlap", "engine eager", "HF eager"]
        + ["HF compiled"]
        + ["HBM floor", "target", "target met?"],
        [[r["model"], r["batch"], *(r.get(c, "?") for c in COLUMNS), r["target"], r["met"]]
         for r in rows],
    )  # fmt: skip
    start_text, start_md = table(
        ["model", "graphs on (s)", "graphs off (s)", "target", "target met?"],
        [[s["model"], s["engine_graphs"], s["engine_eager"], "graphs on < 30 s", s["met"]]
         for s in startups],
    )  # fmt: skip
    spec_text, spec_md = table(
        ["batch", "plain tok/s", "spec tok/s", "speedup", "identical", "target", "target met?"],
        [[r[k] for k in ("batch", "plain_tok_s", "spec_tok_s", "speedup", "identical")]
         + [r["target"], r["met"]] for r in spec_rows],
    )  # fmt: skip
    print(f"\nms per decode step\n{main_text}\n\nengine startup\n{start_text}", flush=True)
    if spec_rows:
        print(f"\nspeculation (shipped draft, graphs on)\n{spec_text}", flush=True)
    if args.no_write:
        return
    body = (
        f"Command: `{command.strip()}` ({gpu}, {args.dtype}, {versions}).\n\n"
        f"Milliseconds per decode step: (t({SHORT} + {args.steps} new tokens) - t({SHORT})) / "
        f"{args.steps}, greedy, EOS ignored, the same {args.prompt_len}-token prompt in every "
        f"row, median of {args.repeats} after a warm-up. Random weights unless a model folder "
        "was given. HF compiled: static cache, CompileConfig(fullgraph=True, dynamic=False, "
        'mode="reduce-overhead"). HBM floor: bf16 bytes of the decoder layers, final norm and '
        "LM head (of a mixture of experts: the router and one token's experts, what batch 1 "
        "reads) over the device-to-device copy bandwidth counted as bytes read + written "
        f"({bandwidth / 1e9:.1f} GB/s here); the KV cache and input embedding are left out.\n\n"
        "Engine graphs: CUDA graphs and overlap scheduling (the defaults on a GPU); no "
        "overlap: each step's tokens read before the next step is prepared.\n\n"
        f"{main_md}\n\nStartup: seconds to construct the engine (CUDA graphs are captured "
        f"there).\n\n{start_md}\n"
    )
    if spec_rows:
        body += (
            "\nSpeculation with the shipped draft (multi-layer-eagle), graphs on both sides, "
            f"held-out chat prompts, greedy, at most {SPEC_MAX_TOKENS} new tokens, stopping at "
            f"EOS; tokens/s.\n\n{spec_md}\n"
        )
    setup = {"command": command, "gpu": gpu, "versions": versions, "args": vars(args),
             "copy_bandwidth_read_plus_write_bytes_per_s": bandwidth}  # fmt: skip
    raw = {"setup": setup, "rows": rows, "startup": startups, "spec": spec_rows}
    write_section("GPU decode step", body, raw, "gpu_step.json")


if __name__ == "__main__":
    main()
