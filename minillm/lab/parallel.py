"""What splitting a model over several accelerators costs and saves: a calculator.

Each way of splitting is priced from the model's shape (`ModelConfig`), a device
(`minillm.lab.hardware`) and a link (`minillm.lab.interconnect`):

- tensor parallelism (TP) splits every weight matrix over `tp` ranks. A decoder layer does two
  all-reduces of its tokens' hidden states, after the attention output projection and after
  the MLP's down projection; a vocabulary-parallel embedding adds one more per step.
- pipeline parallelism (PP) gives each of `pp` stages a run of layers. With m micro-batches a
  schedule that runs each stage once per micro-batch leaves every stage idle for
  (pp - 1) / (m + pp - 1) of the time: the bubble (GPipe, Huang et al. 2019).
- expert parallelism (EP) places the experts of a mixture-of-experts layer on `ep` ranks and
  sends each token to the ranks of its top-k experts (dispatch) and back (combine) with two
  all-to-alls per layer.
- data parallelism (DP) runs whole replicas; it costs no communication while serving.
- prefill/decode disaggregation moves each request's KV cache from the prefill instance to
  the decode instance once: its bytes are the KV bytes of the prompt.

`choose_layout` puts these together for decode: for every split of `num_gpus` into
tp x pp x dp it checks that the weights and the KV cache fit, estimates the time of one decode
step (chapter 2's roofline floor, split tp ways, plus the all-reduces on the link), and returns
the layouts that meet a latency target, fastest first. It is a model with stated assumptions,
not a measurement: the floors are what the hardware allows, and real steps are slower.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from minillm.lab import roofline
from minillm.lab.hardware import DeviceSpec
from minillm.lab.interconnect import Link, all_reduce_time_s, transfer_time_s
from minillm.lab.units import dtype_bytes
from minillm.model.config import ModelConfig


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


# -- tensor parallelism --------------------------------------------------------------------


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads each tensor-parallel rank caches: num_kv_heads / tp when tp divides them; with
    more ranks than KV heads each rank keeps one head, replicated tp / num_kv_heads times
    (tp must then be a multiple of num_kv_heads), as vLLM does."""
    _positive_int(num_kv_heads, "num_kv_heads")
    _positive_int(tp, "tp")
    if tp <= num_kv_heads:
        if num_kv_heads % tp:
            raise ValueError(f"tp={tp} must divide the {num_kv_heads} KV heads")
        return num_kv_heads // tp
    if tp % num_kv_heads:
        raise ValueError(f"tp={tp} must be a multiple of the {num_kv_heads} KV heads")
    return 1


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """Raise ValueError unless `tp` ranks can split the model's heads, KV heads and MLP."""
    _positive_int(tp, "tp")
    if config.num_attention_heads % tp:
        raise ValueError(f"tp={tp} must divide the {config.num_attention_heads} attention heads")
    if config.intermediate_size % tp:
        raise ValueError(f"tp={tp} must divide intermediate_size={config.intermediate_size}")
    kv_heads_per_rank(config.num_key_value_heads, tp)


def tp_all_reduces_per_step(config: ModelConfig, vocab_parallel_embedding: bool = True) -> int:
    """All-reduces in one forward step under tensor parallelism: two per layer (attention
    output and MLP down projection), plus one for a vocabulary-parallel embedding lookup."""
    return 2 * config.num_hidden_layers + (1 if vocab_parallel_embedding else 0)


def tp_all_reduce_bytes(config: ModelConfig, num_tokens: int, dtype: str = "bfloat16") -> float:
    """Bytes of one all-reduce's tensor: the step's hidden states, tokens x hidden x bytes."""
    _positive_int(num_tokens, "num_tokens")
    return num_tokens * config.hidden_size * dtype_bytes(dtype)


def tp_communication_time_s(
    config: ModelConfig,
    num_tokens: int,
    tp: int,
    link: Link,
    dtype: str = "bfloat16",
    algorithm: str = "ring",
    vocab_parallel_embedding: bool = True,
) -> float:
    """Seconds of all-reduce in one step: count x time of one, one after the other (each
    all-reduce needs the layer's result before it, so they cannot overlap one another)."""
    one = all_reduce_time_s(tp_all_reduce_bytes(config, num_tokens, dtype), tp, link, algorithm)
    return tp_all_reduces_per_step(config, vocab_parallel_embedding) * one


# -- pipeline parallelism ------------------------------------------------------------------


def pipeline_bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """The share of time each stage idles in a GPipe-style schedule: (p - 1) / (m + p - 1).

    A step of m micro-batches over p stages takes m + p - 1 slots (the first micro-batch
    reaches the last stage after p - 1 slots); each stage works m of them.
    """
    _positive_int(num_stages, "num_stages")
    _positive_int(num_microbatches, "num_microbatches")
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def pipeline_stage_layers(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as even as possible, the earlier stages taking the remainder."""
    _positive_int(num_layers, "num_layers")
    _positive_int(num_stages, "num_stages")
    if num_stages > num_layers:
        raise ValueError(f"{num_stages} stages need at least as many layers, got {num_layers}")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if i < extra else 0) for i in range(num_stages)]


# -- expert parallelism --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MoEShape:
    """The fields of a mixture-of-experts model's config.json that size its expert traffic."""

    name: str
    hidden_size: int
    num_layers: int  # layers with a mixture-of-experts MLP
    num_experts: int  # routed experts per layer
    top_k: int  # routed experts each token visits
    num_shared_experts: int  # experts every token visits, kept on every rank
    expert_intermediate_size: int


# Copied from each model's Hugging Face config.json (DeepSeek V3's first 3 layers are dense).
MOE_MODELS = {
    shape.name: shape
    for shape in (
        MoEShape("Mixtral 8x7B", 4096, 32, 8, 2, 0, 14336),
        MoEShape("Qwen3-30B-A3B", 2048, 48, 128, 8, 0, 768),
        MoEShape("DeepSeek V3", 7168, 58, 256, 8, 1, 2048),
    )
}


def experts_per_rank(num_experts: int, ep: int) -> int:
    """Routed experts each of `ep` ranks holds; `ep` must divide the experts."""
    _positive_int(num_experts, "num_experts")
    _positive_int(ep, "ep")
    if num_experts % ep:
        raise ValueError(f"ep={ep} must divide the {num_experts} experts")
    return num_experts // ep


@dataclass(frozen=True, slots=True)
class AllToAllBytes:
    """Bytes one rank sends in one MoE layer: dispatch (tokens to experts) and combine (back)."""

    dispatch: float
    combine: float

    @property
    def total(self) -> float:
        return self.dispatch + self.combine


def moe_all_to_all_bytes(
    tokens_per_rank: int, hidden_size: int, top_k: int, ep: int, dtype: str = "bfloat16"
) -> AllToAllBytes:
    """Bytes one rank sends per MoE layer when routing is uniform over the experts.

    Each of the rank's tokens goes to top_k experts; a share (ep - 1) / ep of them live on
    other ranks, so dispatch sends tokens x top_k x (ep - 1) / ep hidden vectors. Combine sends
    the experts' outputs back: the same count, in the same dtype here.
    """
    for value, name in ((tokens_per_rank, "tokens_per_rank"), (hidden_size, "hidden_size")):
        _positive_int(value, name)
    _positive_int(top_k, "top_k")
    _positive_int(ep, "ep")
    remote = tokens_per_rank * top_k * (ep - 1) / ep
    bytes_each = remote * hidden_size * dtype_bytes(dtype)
    return AllToAllBytes(dispatch=bytes_each, combine=bytes_each)


def remote_ranks_per_token(num_experts: int, top_k: int, ep: int) -> float:
    """Other ranks one token reaches, on average, when its top_k experts are distinct and
    uniformly random: each of the ep - 1 other ranks holds none of them with probability
    C(E - E/ep, k) / C(E, k) (hypergeometric)."""
    for value, name in ((num_experts, "num_experts"), (top_k, "top_k"), (ep, "ep")):
        _positive_int(value, name)
    if num_experts % ep or top_k > num_experts:
        raise ValueError(f"need ep | num_experts and top_k <= num_experts, got {num_experts}, {ep}")
    none_here = math.comb(num_experts - num_experts // ep, top_k) / math.comb(num_experts, top_k)
    return (ep - 1) * (1 - none_here)


def moe_all_to_all_bytes_per_rank(
    tokens_per_rank: int,
    hidden_size: int,
    num_experts: int,
    top_k: int,
    ep: int,
    dispatch_bytes: float = 1.0,
    scale_block: int | None = 128,
    combine_bytes: float = 2.0,
) -> AllToAllBytes:
    """Bytes one rank sends per MoE layer when a token goes once to each rank holding any of
    its experts (DeepSeek V3, DeepEP): the receiving rank hands the copy to all its chosen
    experts, and reduces their outputs before combine sends one vector back. Dispatch in FP8
    (1 byte) plus one float32 scale per `scale_block` values, combine in BF16 (DeepSeek V3's
    choices); routing uniform, as `moe_all_to_all_bytes`, which sends one copy per expert."""
    _positive_int(tokens_per_rank, "tokens_per_rank")
    _positive_int(hidden_size, "hidden_size")
    copies = tokens_per_rank * remote_ranks_per_token(num_experts, top_k, ep)
    scales = 0 if scale_block is None else math.ceil(hidden_size / scale_block) * 4
    return AllToAllBytes(
        dispatch=copies * (hidden_size * dispatch_bytes + scales),
        combine=copies * hidden_size * combine_bytes,
    )


def load_imbalance(loads: Sequence[float]) -> float:
    """max / mean of per-rank (or per-expert) loads: 1.0 is perfectly even. A step waits for
    its busiest rank, so it takes `load_imbalance` times as long as an even one."""
    if not loads or any(x < 0 for x in loads) or sum(loads) == 0:
        raise ValueError("loads must be non-empty, >= 0 and not all zero")
    return max(loads) * len(loads) / sum(loads)


def rank_loads(expert_loads: Sequence[float], ep: int) -> list[float]:
    """Per-rank load when expert e lives on rank e // (experts / ep), without replication."""
    per_rank = experts_per_rank(len(expert_loads), ep)
    return [sum(expert_loads[r * per_rank : (r + 1) * per_rank]) for r in range(ep)]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the replicas of each expert live, and what each rank then carries."""

    replicas: list[int]  # replicas[e]: copies of expert e (its load is split evenly among them)
    slots: list[list[int]]  # slots[r]: the experts whose replica rank r holds
    loads: list[float]  # loads[r]: the load rank r carries

    @property
    def imbalance(self) -> float:
        return load_imbalance(self.loads)


def replicate_experts(expert_loads: Sequence[float], ep: int, num_redundant: int) -> Placement:
    """An EPLB-style placement: give `num_redundant` extra replicas to the busiest experts,
    then place the replicas on `ep` ranks, heaviest first, each on the least loaded rank that
    has a free slot and no replica of that expert yet.

    A replica of expert e carries load_e / replicas_e. Every rank gets
    (experts + num_redundant) / ep slots, which must be a whole number. (DeepSeek's EPLB also
    groups experts by node first; this is its flat, single-node form.)
    """
    num_experts = len(expert_loads)
    _positive_int(ep, "ep")
    if num_redundant < 0 or (num_experts + num_redundant) % ep:
        raise ValueError(
            f"experts + redundant ({num_experts} + {num_redundant}) must be a multiple of ep={ep}"
        )
    if any(x < 0 for x in expert_loads) or num_experts == 0:
        raise ValueError("expert loads must be a non-empty list of numbers >= 0")
    slots_per_rank = (num_experts + num_redundant) // ep
    replicas = [1] * num_experts
    for _ in range(num_redundant):  # each extra copy goes to the largest per-replica load
        busiest = max(range(num_experts), key=lambda e: (expert_loads[e] / replicas[e], -e))
        if replicas[busiest] == ep:
            raise ValueError(f"expert {busiest} would need more replicas than the {ep} ranks")
        replicas[busiest] += 1
    pieces = sorted(
        (
            (expert_loads[e] / replicas[e], e)
            for e in range(num_experts)
            for _ in range(replicas[e])
        ),
        key=lambda piece: (-piece[0], piece[1]),
    )
    slots: list[list[int]] = [[] for _ in range(ep)]
    loads = [0.0] * ep
    for load, expert in pieces:
        free = [r for r in range(ep) if len(slots[r]) < slots_per_rank and expert not in slots[r]]
        rank = min(free, key=lambda r: (loads[r], r))
        slots[rank].append(expert)
        loads[rank] += load
    return Placement(replicas, slots, loads)


# -- memory and disaggregation -------------------------------------------------------------


def weight_bytes_per_gpu(config: ModelConfig, tp: int, pp: int, dtype: str = "bfloat16") -> float:
    """Weight bytes on each GPU when tp x pp GPUs share one replica (an even split)."""
    _positive_int(tp, "tp")
    _positive_int(pp, "pp")
    return roofline.model_weight_bytes(config, dtype) / (tp * pp)


def kv_bytes_per_gpu(
    config: ModelConfig, num_tokens: int, tp: int, pp: int, kv_dtype: str = "bfloat16"
) -> float:
    """KV bytes each GPU of a replica holds for `num_tokens` cached tokens: its KV heads
    (replicated when tp > KV heads) for its share of the layers."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    heads = kv_heads_per_rank(config.num_key_value_heads, tp)
    layers = max(pipeline_stage_layers(config.num_hidden_layers, pp))
    return num_tokens * 2 * layers * heads * config.head_dim * dtype_bytes(kv_dtype)


def min_gpus_for_weights(
    config: ModelConfig, device: DeviceSpec, dtype: str = "bfloat16", usable_fraction: float = 0.9
) -> int:
    """The fewest GPUs whose usable memory holds the weights alone (no room for KV yet)."""
    if not 0 < usable_fraction <= 1:
        raise ValueError(f"usable_fraction must be in (0, 1], got {usable_fraction}")
    return math.ceil(
        roofline.model_weight_bytes(config, dtype) / (device.memory_bytes * usable_fraction)
    )


def kv_transfer_bytes(config: ModelConfig, prompt_len: int, kv_dtype: str = "bfloat16") -> float:
    """Bytes of KV a prefill instance hands to a decode instance for one prompt."""
    if prompt_len < 0:
        raise ValueError(f"prompt_len must be >= 0, got {prompt_len}")
    return roofline.kv_cache_bytes(config, prompt_len, kv_dtype)


def kv_transfer_time_s(
    config: ModelConfig,
    prompt_len: int,
    link: Link,
    num_links: int = 1,
    kv_dtype: str = "bfloat16",
) -> float:
    """Seconds to move one prompt's KV over `num_links` links in parallel (one per
    tensor-parallel rank, each sending its KV heads): alpha + bytes / (links x B)."""
    return transfer_time_s(kv_transfer_bytes(config, prompt_len, kv_dtype), link, num_links)


# -- choosing a layout ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LayoutEstimate:
    """One way to run a model on num_gpus = tp x pp x dp GPUs, priced for decode."""

    tp: int
    pp: int
    dp: int
    memory_per_gpu_bytes: float  # weights + KV of the replica's share of the batch
    fits: bool
    compute_s: float  # roofline floor of one decode step of a replica, split tp ways
    communication_s: float  # all-reduces plus pipeline hand-offs in that step
    batch_per_replica: int

    @property
    def step_s(self) -> float:
        """Time between two tokens of one sequence (the inter-token latency) in this model."""
        return self.compute_s + self.communication_s

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of all replicas together."""
        return self.dp * self.batch_per_replica / self.step_s


def estimate_layout(
    config: ModelConfig,
    device: DeviceSpec,
    link: Link,
    tp: int,
    pp: int,
    dp: int,
    batch_size: int,
    context_len: int,
    dtype: str = "bfloat16",
    usable_fraction: float = 0.9,
    pipelined: bool = False,
) -> LayoutEstimate:
    """Price decoding `batch_size` sequences of `context_len` tokens on tp x pp x dp GPUs.

    Each of the dp replicas takes ceil(batch_size / dp) sequences. Its step's roofline floor
    (chapter 2) is split evenly over its tp ranks; the pp stages run one after the other for a
    token, so PP saves memory but not time, and each of the pp - 1 stage boundaries adds one
    transfer of the batch's hidden states. Tensor parallelism adds its all-reduces
    (`tp_communication_time_s`). Fits when weights and KV take at most `usable_fraction` of
    each GPU's memory.

    By default one micro-batch is in flight: each stage idles (pp - 1) / pp of the step, as in
    minillm's engine, which drains its pipeline every step. `pipelined=True` prices the
    steady state of an engine that keeps pp micro-batches in flight (vLLM V1): the replica's
    sequences form pp micro-batches, each stage works on one at a time (reading its share of
    the weights once per micro-batch), and a sequence gets its next token once every stage
    has served every micro-batch: ITL = pp x (a stage's time for one micro-batch).
    """
    check_tensor_parallel(config, tp)
    pipeline_stage_layers(config.num_hidden_layers, pp)
    _positive_int(dp, "dp")
    batch = math.ceil(_positive_int(batch_size, "batch_size") / dp)
    memory = weight_bytes_per_gpu(config, tp, pp, dtype) + kv_bytes_per_gpu(
        config, batch * context_len, tp, pp, dtype
    )
    if pipelined and pp > 1:
        micro = math.ceil(batch / pp)
        cost = roofline.decode_step_cost(config, micro, context_len, dtype)
        # pp stages x (floor / (tp x pp)) each
        compute = (
            roofline.step_time_floor_s(
                cost, device.peak_flops(dtype), device.memory_bandwidth_bytes_per_s
            )
            / tp
        )
        micro_bytes = micro * config.hidden_size * dtype_bytes(dtype)
        stage_comm = tp_communication_time_s(config, micro, tp, link, dtype) / pp
        communication = pp * (stage_comm + transfer_time_s(micro_bytes, link))
    else:
        cost = roofline.decode_step_cost(config, batch, context_len, dtype)
        compute = (
            roofline.step_time_floor_s(
                cost, device.peak_flops(dtype), device.memory_bandwidth_bytes_per_s
            )
            / tp
        )
        communication = tp_communication_time_s(config, batch, tp, link, dtype)
        hidden_bytes = batch * config.hidden_size * dtype_bytes(dtype)
        communication += (pp - 1) * transfer_time_s(hidden_bytes, link)
    return LayoutEstimate(
        tp=tp,
        pp=pp,
        dp=dp,
        memory_per_gpu_bytes=memory,
        fits=memory <= device.memory_bytes * usable_fraction,
        compute_s=compute,
        communication_s=communication,
        batch_per_replica=batch,
    )


def layouts(config: ModelConfig, num_gpus: int) -> list[tuple[int, int, int]]:
    """Every (tp, pp, dp) with tp x pp x dp = num_gpus that the model's shape allows."""
    _positive_int(num_gpus, "num_gpus")
    found = []
    for tp, pp in itertools.product(range(1, num_gpus + 1), repeat=2):
        if num_gpus % (tp * pp) or pp > config.num_hidden_layers:
            continue
        try:
            check_tensor_parallel(config, tp)
        except ValueError:
            continue
        found.append((tp, pp, num_gpus // (tp * pp)))
    return found


def choose_layout(
    config: ModelConfig,
    device: DeviceSpec,
    link: Link,
    num_gpus: int,
    batch_size: int,
    context_len: int,
    itl_target_s: float,
    dtype: str = "bfloat16",
) -> list[LayoutEstimate]:
    """The layouts that fit in memory and decode within `itl_target_s` per token, the highest
    throughput first (ties: fewer tensor-parallel ranks). Empty when none meets the target."""
    if not itl_target_s > 0:
        raise ValueError(f"itl_target_s must be > 0, got {itl_target_s}")
    estimates = [
        estimate_layout(config, device, link, tp, pp, dp, batch_size, context_len, dtype)
        for tp, pp, dp in layouts(config, num_gpus)
    ]
    good = [e for e in estimates if e.fits and e.step_s <= itl_target_s]
    return sorted(good, key=lambda e: (-e.tokens_per_s, e.tp, e.pp))
