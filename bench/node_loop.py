"""Where a served run's time went on its generating nodes (decode nodes, replicas), read from
the cluster's /metrics before and after the run: each node's engine steps by kind and its
serving thread's time by part (metadata.loop_clock, engine.step_counts), beside the offline
engine's steps for the same load. A node busy all the time with its engine is limited by its
engine's steps (their number and cost), one that waits is starved by what feeds it."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

GENERATING_ROLES = ("decode", "replica")
STEP_KINDS = ("decode", "prefill", "mixed", "drains")
PARTS = ("engine", "streams", "other", "waiting")


def _forwards(steps: dict[str, int]) -> int:
    """The forward steps among `steps` (drains are waits, not forwards)."""
    return steps["decode"] + steps["prefill"] + steps["mixed"]


def node_counters(url: str) -> dict[str, dict[str, float]]:
    """Per generating node: its loop seconds by part, its steps by kind and its generated
    tokens, as cumulative counters ("loop:<part>", "steps:<kind>", "tokens")."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    nodes: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if labels.get("role") not in GENERATING_ROLES or not sample.name.endswith("_total"):
                continue
            counters = nodes.setdefault(labels["node"], {})
            if sample.name == "pdcluster_node_loop_seconds_total":
                counters[f"loop:{labels['part']}"] = sample.value
            elif sample.name == "pdcluster_node_steps_total":
                counters[f"steps:{labels['kind']}"] = sample.value
            elif sample.name == "pdcluster_node_generation_tokens_total":
                counters["tokens"] = sample.value
    return nodes


def node_figures(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], run_s: float
) -> list[dict]:
    """One row of figures per generating node over a run whose requests took `run_s`
    seconds (the load generator's duration). The counters span a little more (the load
    generator's start and end, when the nodes idle): the busy parts are taken over `run_s`,
    and the waiting share is what they leave of it."""
    rows = []
    for node, now in sorted(after.items()):
        was = before.get(node, {})
        delta = {key: value - was.get(key, 0.0) for key, value in now.items()}
        steps = {kind: int(delta.get(f"steps:{kind}", 0)) for kind in STEP_KINDS}
        forwards = _forwards(steps)
        engine_s = delta.get("loop:engine", 0.0)
        share = {part: delta.get(f"loop:{part}", 0.0) / run_s for part in PARTS[:-1]}
        share["waiting"] = max(0.0, 1.0 - sum(share.values()))
        rows.append(
            {
                "node": node,
                "steps": steps,
                "steps_per_s": forwards / run_s,
                "tokens_per_step": delta.get("tokens", 0.0) / max(1, forwards),
                "ms_per_step": engine_s / max(1, forwards) * 1e3,
                "share": share,
            }
        )
    return rows


def offline_figures(tokens: int, elapsed_s: float, steps: dict[str, int]) -> dict:
    """The offline engine's figures in the same terms (its whole time is its engine's)."""
    forwards = _forwards(steps)
    return {
        "node": "-",
        "steps": steps,
        "steps_per_s": forwards / elapsed_s,
        "tokens_per_step": tokens / max(1, forwards),
        "ms_per_step": elapsed_s / max(1, forwards) * 1e3,
        "share": {"engine": 1.0},
    }


def loop_table(rows: list[dict]) -> str:
    """Rows carrying `nodes` (a list of node_figures / offline_figures rows)."""
    lines = [
        "| setup | API processes | streams | node | steps/s | tokens/step | ms/step "
        "| decode / prefill / mixed steps | drains | engine | streams | other | waiting |",
        "| --- | ---: | ---: | --- " + "| ---: " * 9 + "|",
    ]
    for row in rows:
        for node in row.get("nodes", []):
            steps, share = node["steps"], node["share"]
            parts = " | ".join(
                f"{100 * share[part]:.0f} %" if part in share else "-" for part in PARTS
            )
            api = row["api_servers"] or "-"
            lines.append(
                f"| {row['setup']} | {api} | {row['concurrency']} | {node['node']} "
                f"| {node['steps_per_s']:,.0f} | {node['tokens_per_step']:.1f} "
                f"| {node['ms_per_step']:.2f} "
                f"| {steps['decode']:,} / {steps['prefill']:,} / {steps['mixed']:,} "
                f"| {steps['drains']:,} | {parts} |"
            )
    return "\n".join(lines)
