"""What the `pdcluster` commands do once their arguments are parsed: `serve`, `demo` and
`generate` (their arguments are in cluster.commands.cli_args, the parser in
cluster.commands.cli)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Mapping


def engine_args(args: argparse.Namespace):
    from engine.loading.loader import EngineArgs

    return EngineArgs(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        max_tokens_cap=args.max_tokens_cap,
        kv_cache_tokens=args.kv_cache_tokens,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_backend=args.attention_backend,
        disable_cuda_graph=args.disable_cuda_graph,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        cuda_graph_max_prefill_tokens=args.cuda_graph_max_prefill_tokens,
        overlap_schedule=False if args.disable_overlap_schedule else None,
        mixed_prefill=not args.disable_mixed_prefill,
        enable_prefix_cache=not args.disable_prefix_cache,
        speculative_algorithm=args.speculative_algorithm,
        draft_model=args.draft_model,
        num_draft_steps=args.num_draft_steps,
        num_draft_chains=args.num_draft_chains,
        speculative_topk=args.speculative_topk,
        num_draft_tokens=args.num_draft_tokens,
        draft_vocab=args.draft_vocab,
        speculative_plan=args.speculative_plan,
        speculative_disable_batch_size=args.speculative_disable_batch_size,
        debug_tensor_dump_dir=args.debug_tensor_dump_dir,
        debug_tensor_dump_layers=args.debug_tensor_dump_layers,
    )


def build_llm(args: argparse.Namespace):
    from engine import LLM
    from spec.compose import speculation_of

    chosen = engine_args(args)
    # LLM takes every EngineArgs field as a keyword of the same name.
    return LLM(**dataclasses.asdict(chosen), speculation=speculation_of(chosen))


def run_demo(args: argparse.Namespace) -> None:
    from cluster.commands.demo import run_cluster_demo

    run_cluster_demo(args)


API_KEY_VARIABLE = "PDCLUSTER_API_KEY"


def serve_api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The bearer token from --api-key, --api-key-file or $PDCLUSTER_API_KEY, one of them at
    most; the file and the variable keep it out of `ps`. An empty key would let anyone in."""
    sources: dict[str, str] = {}
    if args.api_key is not None:
        sources["--api-key"] = args.api_key
    if args.api_key_file is not None:
        sources["--api-key-file"] = _first_line(args.api_key_file)
    if API_KEY_VARIABLE in environ:
        sources[f"${API_KEY_VARIABLE}"] = environ[API_KEY_VARIABLE]
    if len(sources) > 1:
        raise ValueError(f"give the API key one way, not {' and '.join(sources)}")
    if not sources:
        return None
    [(source, key)] = sources.items()
    if not key.strip():
        raise ValueError(f"the API key from {source} is empty")
    return key.strip()


def _first_line(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            return file.readline()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read the API key file {path}: {err}") from err


def run_serve(args: argparse.Namespace) -> int:
    from cluster.commands.serve import serve
    from cluster.deploy.config import DEFAULT_MAX_REQUEST_BYTES, ClusterConfig, ServeConfig
    from metadata.loopback import is_loopback

    config = ServeConfig(
        cluster=ClusterConfig(
            engine=engine_args(args),
            prefill_nodes=args.prefill_nodes,
            decode_nodes=args.decode_nodes,
            aggregated=args.aggregated,
            replicas=args.replicas,
            prefill_tp=args.prefill_tp,
            decode_tp=args.decode_tp,
            gpus_per_node=args.gpus_per_node,
            prefill_policy=args.prefill_policy,
            decode_policy=args.decode_policy,
            cache_aware_load_threshold=args.cache_aware_load_threshold,
            decode_reuse=not args.disable_decode_reuse,
            ray_address=args.ray_address,
            # Nothing of a local cluster behind a loopback-only API needs to be reachable
            # from elsewhere.
            loopback_only=args.ray_address is None and is_loopback(args.host),
            prefill_resource=args.prefill_resource,
            decode_resource=args.decode_resource,
            node_wait_s=args.wait_for_nodes,
            cpu_threads_per_node=args.cpu_threads_per_node,
            enable_tracing=args.enable_tracing,
            trace_dir=args.trace_dir,
            log_level=args.log_level,
            stats_log_interval_s=args.log_stats_interval,
            transfer_timeout_s=args.transfer_timeout,
            max_node_restarts=args.max_node_restarts,
            node_restart_backoff_s=args.node_restart_backoff,
            node_restart_backoff_max_s=max(60.0, args.node_restart_backoff),
            kv_audit_interval_s=args.kv_audit_interval,
            stream_interval=args.stream_interval,
            stream_worker={"auto": None, "on": True, "off": False}[args.stream_worker],
        ),
        host=args.host,
        port=args.port,
        api_key=serve_api_key(args, os.environ),
        served_model_name=args.served_model_name,
        max_request_bytes=(
            DEFAULT_MAX_REQUEST_BYTES if args.max_request_bytes is None else args.max_request_bytes
        ),
        metrics_require_api_key=args.metrics_require_api_key,
        drain_timeout_s=args.drain_timeout,
        max_queued_requests=args.max_queued_requests,
        queue_timeout_s=args.queue_timeout,
        api_servers=args.api_servers,
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    return serve(config)


def run_generate(args: argparse.Namespace) -> None:
    from engine import SamplingParams

    llm = build_llm(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    if args.chat:
        [out] = llm.chat([[{"role": "user", "content": args.prompt}]], params)
    else:
        [out] = llm.generate([args.prompt], params)
    print(out.text)
