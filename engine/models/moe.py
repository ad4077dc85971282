"""The mixture-of-experts MLP of Mixtral and Qwen3-MoE (engine.model_config.MoeConfig): a router
(`gate`) picks each token's top-k experts, and the token's output is the weighted sum of their
gated MLPs.

The experts' weights are stacked, expert first, as one tensor per projection: `gate_up_proj`
[E, 2 * I, H] (each expert's gate rows, then its up rows, as the dense MLP packs them) and
`down_proj` [E, H, I], filled from the checkpoints' per-expert tensors at load time. An
expert-parallel rank would hold a slice of E of the same tensors and add its partial outputs to
the other ranks'.

The T tokens' T * k (token, expert) pairs are sorted by expert, so that each expert's rows are
one contiguous run, and each projection is one grouped GEMM over those runs. Every shape there
is fixed by T and k, and the runs' ends are found on the device: torch's grouped GEMM
(`F.grouped_mm`) takes them as a tensor, so the step reads nothing back to the host and a CUDA
graph can hold it. Where that GEMM is not used (its CPU kernel wants 16-byte aligned rows; on a
GPU it is taken in bf16 on Hopper only), an eager step runs one matmul per expert that has rows
(reading the ends on the host), and a step captured in a CUDA graph runs every expert over every
token, the experts a token did not choose weighted zero. There is no fused Triton MoE kernel
yet: on a GPU these torch paths are what runs."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.kernels import triton_usable
from engine.model_config import ModelConfig
from engine.models.linear import Linear


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) from the router's logits [T, E]: the top k
    of the softmax in float32, divided by their sum when `renormalize` (Mixtral always;
    Qwen3-MoE when `norm_topk_prob`), as transformers orders these operations."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_mm_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `F.grouped_mm` takes rows `x` [R, K] and stacked weights `weight` [G, N, K]."""
    if not hasattr(F, "grouped_mm") or x.dtype != weight.dtype:
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] == 9
    if x.device.type != "cpu":
        return False
    size = x.element_size()
    strides = (x.stride(0), weight.stride(0), weight.stride(1))
    return all(s * size % 16 == 0 for s in strides) and all(
        t.data_ptr() % 16 == 0 for t in (x, weight)
    )


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [R, K] holds group g's rows at ends[g - 1]:ends[g] (int32, ascending, the last R);
    each row times its group's weight [G, N, K], transposed: [R, N]."""
    if grouped_mm_runs(x, weight):
        return F.grouped_mm(x, weight.transpose(1, 2), offs=ends)
    return linear_per_group(x, weight, ends)


def linear_per_group(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """`grouped_linear` as one matmul per group that has rows (it reads the ends on the host)."""
    out = x.new_empty((x.shape[0], weight.shape[1]))
    start = 0
    for group, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = F.linear(x[start:end], weight[group])
        start = end
    return out


def capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


class Experts(nn.Module):
    """`num_experts` gated MLPs, their weights stacked expert first (see the module's text)."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gelu = hidden_act == "gelu_pytorch_tanh"
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; each token's experts `ids` [T, k] with their `weights` [T, k]."""
        if capturing(x) and not grouped_mm_runs(x, self.gate_up_proj):
            return self.every_expert(x, weights, ids)
        return self.grouped(x, weights, ids)

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The (token, expert) pairs sorted by expert, each projection one grouped GEMM."""
        tokens, top_k = ids.shape
        if tokens == 0:
            return torch.zeros_like(x)
        pair_experts, order = torch.sort(ids.reshape(-1), stable=True)
        # ends[e]: the pairs of experts 0..e, found on the device.
        bounds = torch.arange(1, self.num_experts + 1, device=x.device, dtype=pair_experts.dtype)
        ends = torch.searchsorted(pair_experts, bounds, out_int32=True)
        rows = x[order // top_k]
        hidden = self.activation(grouped_linear(rows, self.gate_up_proj, ends))
        out = grouped_linear(hidden, self.down_proj, ends)
        out = self.weighted(out, weights.reshape(-1)[order])
        # Back to (token, rank) order: each token's k outputs are summed in one reduction.
        pairs = torch.empty_like(out)
        pairs[order] = out
        return pairs.view(tokens, top_k, -1).sum(dim=1)

    def every_expert(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Every expert over every token, the experts a token did not choose weighted zero: E / k
        times the grouped GEMMs' work, with no data-dependent step (what a CUDA graph holds
        where the grouped GEMM does not run)."""
        gate_up = torch.matmul(x, self.gate_up_proj.transpose(1, 2))  # [E, T, 2I]
        hidden = self.activation(gate_up.flatten(0, 1))
        out = torch.bmm(
            hidden.view(self.num_experts, x.shape[0], -1), self.down_proj.transpose(1, 2)
        )
        dense = torch.zeros(
            (x.shape[0], self.num_experts), dtype=weights.dtype, device=x.device
        ).scatter(1, ids, weights)
        out = self.weighted(out, dense.t().reshape(-1)).view(self.num_experts, x.shape[0], -1)
        return out.sum(dim=0)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[R, 2I] (gate, then up) -> act(gate) * up, [R, I]."""
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.gelu(gate, approximate="tanh") * up
        if triton_usable(gate_up):
            from engine.kernels.elementwise import silu_and_mul

            return silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def weighted(out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Rows [R, H] times their float32 routing weights [R], rounded once to the model's
        dtype after the product (as Mixtral's reference does)."""
        out = out.reshape(weights.shape[0], -1)
        return (out.float() * weights[:, None]).to(out.dtype)


class SparseMoeBlock(nn.Module):
    """What replaces the MLP of a sparse layer: the router `gate` and the `experts`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.gate = Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(
            moe.num_experts, config.hidden_size, moe.intermediate_size, config.hidden_act
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, weights, ids)


# Per-expert checkpoint tensors: Mixtral's w1 (gate), w3 (up) and w2 (down) under
# block_sparse_moe, Qwen3-MoE's gate_proj, up_proj and down_proj under mlp.
_EXPERT_WEIGHT = re.compile(
    r"(?P<layer>.*)\.(?:block_sparse_moe|mlp)\.experts\.(?P<expert>\d+)\."
    r"(?P<part>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight"
)
_GATE_PARTS, _UP_PARTS = ("w1", "gate_proj"), ("w3", "up_proj")


def moe_weight_slot(name: str, config: ModelConfig) -> tuple[str, int | None, int | None] | None:
    """Where a checkpoint tensor of a MoE block lands: (parameter, expert, first row), expert
    and row None for the whole parameter; None for a tensor outside the experts and router."""
    if ".block_sparse_moe.gate." in name:  # Mixtral's router
        return name.replace(".block_sparse_moe.", ".mlp."), None, None
    match = _EXPERT_WEIGHT.fullmatch(name)
    if match is None or config.moe is None:
        return None
    expert, part = int(match["expert"]), match["part"]
    if expert >= config.moe.num_experts:
        raise ModelLoadError(
            f"weight {name!r} is of expert {expert}; the config has {config.moe.num_experts}"
        )
    prefix = f"{match['layer']}.mlp.experts."
    if part in _GATE_PARTS:
        return prefix + "gate_up_proj", expert, 0
    if part in _UP_PARTS:
        return prefix + "gate_up_proj", expert, config.moe.intermediate_size
    return prefix + "down_proj", expert, None


def expert_weight_keys(parameter: str, config: ModelConfig) -> set[str] | None:
    """The loaded-tensor keys (`weight_key`) that fill a stacked expert parameter; None for a
    parameter that is not one."""
    moe = config.moe
    if moe is None:
        return None
    experts = range(moe.num_experts)
    if parameter.endswith(".experts.gate_up_proj"):
        offsets = (0, moe.intermediate_size)
        return {weight_key(parameter, e, o) for e in experts for o in offsets}
    if parameter.endswith(".experts.down_proj"):
        return {weight_key(parameter, e, None) for e in experts}
    return None


def weight_key(parameter: str, expert: int | None, offset: int | None) -> str:
    """What a checkpoint tensor filled: a parameter, an expert of it, rows of either."""
    key = parameter if expert is None else f"{parameter}[{expert}]"
    return key if offset is None else f"{key}:{offset}"
