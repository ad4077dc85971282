"""What prefill and decode nodes share: setting up their process, describing their engine for
pairing, and opening the data-plane channels with their peers."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

import torch

from engine.config import default_device
from engine.cpu_tuning import keep_large_allocations_in_heap
from engine.loading.loader import EngineArgs, ModelSpec
from engine.scheduling.kv_pool import KVPool
from metadata.buffers import MetadataBuffers
from metadata.handshake import TransferSpec
from metadata.transfer import KVReceiver, KVSender, TransferState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeOptions:
    """How one node runs; plain values so it crosses a Ray call."""

    role: str  # "prefill" or "decode"
    index: int
    # The address the node's sockets bind and advertise. AUTO_HOST resolves inside the node's
    # own process, so that on a multi-host cluster each node binds its own host's address.
    bind_host: str = "127.0.0.1"
    cpu_threads: int | None = None  # torch threads on CPU; None leaves torch's default
    metadata_rows: int = 256
    transfer_timeout_s: float = 120.0
    enable_tracing: bool = False  # a timeline per request (engine.tracing), sent to the router
    log_level: str = "info"
    stats_log_interval_s: float = 5.0  # a busy node logs its load this often; <= 0: never
    # How often the node audits its KV pools against its live requests (metadata.kv_audit);
    # <= 0: never.
    kv_audit_interval_s: float = 10.0
    # Transfers over gloo through host memory although the pools are on a GPU: for nodes that
    # share one GPU, which NCCL refuses to pair with itself.
    transfer_through_host: bool = False
    # A request's tokens go to its front end once this many are new (its first and last at
    # once): larger values send fewer, larger frames (--stream-interval).
    stream_interval: int = 1
    # Detokenize and frame the token streams in a worker process beside the node
    # (decode_node.stream_worker) rather than on the thread that drives its engine.
    stream_worker: bool = False
    # A decode node keeps finished requests' KV in a prefix cache and takes from its prefill
    # node only the KV of a prompt's positions past what it holds (decode_node.reuse).
    decode_reuse: bool = True
    # The cluster's control-plane key (metadata.control_auth): every message a node sends is
    # signed with it, and every message it receives must be.
    control_key: bytes = field(repr=False, kw_only=True)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def host(self) -> str:
        return resolve_host(self.bind_host)


AUTO_HOST = "auto"


def resolve_host(host: str) -> str:
    """`host` itself, or for AUTO_HOST the IP address Ray knows this process's host by."""
    if host != AUTO_HOST:
        return host
    import ray  # only nodes that Ray placed are given AUTO_HOST

    return ray.util.get_node_ip_address()


def start_node_process(args: EngineArgs, options: NodeOptions) -> None:
    """Set up the node's process before its engine is built (engine.build.build_engine): logs
    named after the node, its torch threads, its heap, and the GPU its engine takes."""
    level = options.log_level.upper()
    logging.basicConfig(level=level, format=f"%(asctime)s {options.name} %(message)s")
    logging.getLogger().setLevel(level)  # basicConfig leaves it alone when Ray set a handler
    if options.cpu_threads:
        # Several nodes on one CPU host must not each spin a thread per core.
        torch.set_num_threads(options.cpu_threads)
    keep_large_allocations_in_heap()
    device = args.device or default_device()
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))


def transfer_spec(spec: ModelSpec, num_draft_steps: int = 0) -> TransferSpec:
    """What a prefill and a decode node must agree on; `num_draft_steps`: the draft depths
    whose KV crosses too (each a one-layer pool shaped like the target's layers). The KV is
    described in the model's terms (its KV heads, whatever ranks either node splits them
    over), with this node's tensor parallel size, from which each side derives which of its
    ranks sends or receives which heads (metadata.rank_kv)."""
    config = spec.model_config
    fingerprint = hashlib.sha256(repr(config).encode()).hexdigest()[:16]
    return TransferSpec(
        model=f"{spec.path.name}:{fingerprint}",
        kv_dtype=str(spec.engine_config.dtype),
        page_size=1,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        kv_layout=KVPool.layout,
        spec_hidden_size=config.spec_hidden_size,
        num_draft_steps=num_draft_steps,
        topk=1,
        draft_kv=tuple((1, config.num_kv_heads, config.head_dim) for _ in range(num_draft_steps)),
        tp_size=spec.engine_config.tensor_parallel_size,
    )


def metadata_buffers(
    spec: ModelSpec, options: NodeOptions, num_draft_steps: int
) -> MetadataBuffers:
    config = spec.engine_config
    return MetadataBuffers(
        options.metadata_rows,
        spec.model_config.spec_hidden_size,
        num_draft_steps,
        1,
        config.dtype,
        config.device,
        boundary_width=spec.model_config.hidden_size,
    )


def open_channels(endpoint: KVSender | KVReceiver, peers: list[int], timeout_s: float) -> None:
    """Open the data-plane channel with every peer now (NCCL builds a pair's communicator on
    first use, blocking until both join), so the first request does not pay for it."""
    handles = [endpoint.connect(peer) for peer in peers]
    for handle in handles:
        if handle.wait(timeout_s) != TransferState.SUCCESS:
            raise RuntimeError(
                f"could not open the channel with rank {handle.peer}: {handle.error or 'timed out'}"
            )
