"""The expert GEMMs of a mixture-of-experts layer: one launch per expert, padded, or grouped.

After routing, expert e multiplies the M_e rows routed to it, [M_e, K] x [K, N], and the M_e
differ from expert to expert. There are three ways to run those E products:

- **per expert**: one GEMM per expert that received rows (minillm's
  `SparseMoeBlock.experts_forward` loops this way); no wasted FLOPs, but one launch each,
  and most of them small;
- **padded**: pad every group to the largest, M_max rows, and run one batched matmul
  [E, M_max, K] x [E, K, N]: one launch, 2 E M_max K N FLOPs, of which the padding rows are
  waste;
- **grouped**: one launch that walks the list of problems (M_e, N, K). A GPU kernel cuts each
  problem into tiles of `block_m` rows, so each group is padded only to a multiple of
  `block_m` (vLLM's `moe_align_block_size` does exactly this before its `fused_moe_kernel`).

`strategy_costs` counts launches and FLOPs of each from the group sizes; `router_group_sizes`
gets real group sizes by running tokens through a minillm MoE model's routers; `time_strategies`
times the three on this machine, round robin.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from minillm.lab.moe_runs import tiny_moe_config
from minillm.model.llama import LlamaForCausalLM
from minillm.model.loader import load_model
from minillm.model.moe import routing_recorder

STRATEGIES = ("per expert", "padded", "grouped")


@dataclasses.dataclass(frozen=True, slots=True)
class StrategyCost:
    """Launches and FLOPs of one way to run a layer's expert GEMMs [M_e, K] x [K, N]."""

    name: str
    launches: int
    experts_read: int  # expert weight matrices the launches read
    flops: float  # executed, padding rows included
    useful_flops: float  # 2 * sum(M_e) * K * N

    @property
    def waste(self) -> float:
        """Share of the executed FLOPs spent on padding rows."""
        return 1.0 - self.useful_flops / self.flops if self.flops else 0.0


def _check_sizes(group_sizes: Sequence[int]) -> list[int]:
    sizes = [int(m) for m in group_sizes]
    if not sizes or any(m < 0 for m in sizes) or sum(sizes) == 0:
        raise ValueError(f"need non-negative rows per expert with some rows, got {group_sizes}")
    return sizes


def strategy_costs(
    group_sizes: Sequence[int], n: int, k: int, block_m: int = 1
) -> dict[str, StrategyCost]:
    """Launches and FLOPs of the per-expert, padded and grouped strategies.

    group_sizes: rows M_e routed to each expert (an expert-load vector); each product is
    [M_e, k] x [k, n]. The grouped kernel pads each non-empty group to a multiple of
    `block_m` rows (1: no tile padding)."""
    sizes = _check_sizes(group_sizes)
    if n < 1 or k < 1 or block_m < 1:
        raise ValueError(f"need n, k, block_m >= 1, got {n}, {k}, {block_m}")
    per_row = 2.0 * n * k
    useful = per_row * sum(sizes)
    tiled = sum(math.ceil(m / block_m) * block_m for m in sizes)
    used = sum(m > 0 for m in sizes)  # a batched matmul also reads the idle experts' weights
    return {
        "per expert": StrategyCost("per expert", used, used, useful, useful),
        "padded": StrategyCost("padded", 1, len(sizes), per_row * len(sizes) * max(sizes), useful),
        "grouped": StrategyCost("grouped", 1, used, per_row * tiled, useful),
    }


def tiny_router_model(
    num_experts: int = 128, top_k: int = 8, tokenizer_model: str = "minillm-stdlib-target"
):
    """minillm's tiny random Qwen3-MoE model (`moe_runs.tiny_moe_config`) with `num_experts`
    experts and top-`top_k` routing, built in memory, and `tokenizer_model`'s tokenizer. As in
    `moe_runs.tiny_moe_checkpoint`, the routers are drawn wide (std 1) so that tokens spread
    over the experts unevenly. Returns (model, tokenizer)."""
    base = load_model(tokenizer_model, "float32", weights=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_moe_config(base.config.vocab_size, num_experts, top_k)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)
    return model, base.tokenizer


@torch.no_grad()
def router_routes(model: LlamaForCausalLM, token_ids: Sequence[int]) -> dict[int, torch.Tensor]:
    """The experts minillm's routers pick for each token in one causal forward pass:
    {layer: expert ids [num_tokens, top_k]}. The model is causal, so the first n rows are
    also the routes of the first n tokens alone."""
    recorder = routing_recorder(model)
    recorder.start_record()
    try:
        model.forward_causal(torch.tensor([list(token_ids)]))
    finally:
        trace = recorder.stop_record()
    return trace[0]


def group_sizes(expert_ids: torch.Tensor, num_experts: int) -> list[int]:
    """Rows routed to each expert: expert ids [num_tokens, top_k] -> M_e for e < num_experts."""
    return torch.bincount(expert_ids.flatten(), minlength=num_experts).tolist()


def grouped_mm_runs() -> bool:
    """Whether this torch has `torch.nn.functional.grouped_mm` and it runs on a CPU in
    float32 (PyTorch documents it for bfloat16 on recent CUDA GPUs)."""
    if not hasattr(F, "grouped_mm"):
        return False
    x, w = torch.ones(3, 8), torch.ones(2, 8, 4)  # rows of 32 bytes: kernels want 16-byte strides
    try:
        out = F.grouped_mm(x, w, offs=torch.tensor([1, 3], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return out.shape == (3, 4) and bool((out == 8).all())


def expert_gemms(group_sizes: Sequence[int], n: int, k: int, seed: int = 0):
    """The three strategies as functions of the same inputs: rows x [sum M_e, k] sorted by
    expert, weights [E, k, n]. Each returns the [sum M_e, n] products in the rows' order;
    "grouped" is `F.grouped_mm` and present only where `grouped_mm_runs()`."""
    sizes = _check_sizes(group_sizes)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), k, generator=gen)
    w = torch.randn(len(sizes), k, n, generator=gen) / math.sqrt(k)
    ends = torch.tensor(sizes).cumsum(0)
    starts = (ends - torch.tensor(sizes)).tolist()
    m_max = max(sizes)
    # row i of expert e goes to row e * m_max + i of the padded batch
    slots = torch.cat([e * m_max + torch.arange(m) for e, m in enumerate(sizes)])

    def per_expert():
        pairs = enumerate(zip(starts, sizes, strict=True))
        return torch.cat([x[a : a + m] @ w[e] for e, (a, m) in pairs if m])

    def padded():
        xp = x.new_zeros(len(sizes) * m_max, k)
        xp[slots] = x
        return torch.bmm(xp.view(len(sizes), m_max, k), w).view(-1, n)[slots]

    fns = {"per expert": per_expert, "padded": padded}
    if grouped_mm_runs():
        offs = ends.to(torch.int32)
        fns["grouped"] = lambda: F.grouped_mm(x, w, offs=offs)
    return fns


@dataclasses.dataclass(frozen=True, slots=True)
class StrategyTiming:
    """Seconds of each strategy's repeats (run round robin), and the median of each."""

    seconds: dict[str, list[float]]

    def median_s(self, name: str) -> float:
        return statistics.median(self.seconds[name])


def time_strategies(group_sizes: Sequence[int], n: int, k: int, repeats: int = 7) -> StrategyTiming:
    """Time each strategy `repeats` times, round robin (one warm-up each first), after checking
    that all of them compute the same products."""
    if repeats < 1:
        raise ValueError(f"need repeats >= 1, got {repeats}")
    fns = expert_gemms(group_sizes, n, k)
    want = fns["per expert"]()
    for name, fn in fns.items():  # also the warm-up
        torch.testing.assert_close(fn(), want, atol=1e-4, rtol=1e-4, msg=name)
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
    return StrategyTiming(seconds)
