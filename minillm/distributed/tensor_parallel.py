"""Cut a loaded Llama-family model into the shard one tensor-parallel rank runs.

Rank r of p keeps, in every layer:

    q_proj          rows of query heads r*H/p .. (r+1)*H/p - 1       column-parallel
    k_proj, v_proj  rows of its KV heads (see `kv_head_range`)       column-parallel
    o_proj          the matching input columns, then all-reduce       row-parallel
    gate/up_proj    rows r*I/p .. (r+1)*I/p - 1                       column-parallel
    down_proj       the matching input columns, then all-reduce       row-parallel

and replicates the norms. Attention needs no communication: a rank's query heads read only
its own KV heads, which is also why each rank's KV cache holds only those heads.

A mixture-of-experts layer keeps its router replicated. Without expert parallelism every
expert (and the shared expert) is cut like the MLP above, rows r*I_e/p .. of gate and up and
the matching columns of down, and one all-reduce sums the block's partial outputs; with
expert parallelism (`expert_parallel`) the rank keeps its experts whole and the shared
expert replicated.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from minillm.distributed.expert_parallel import expert_range, make_expert_parallel
from minillm.distributed.parallel_layers import (
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_range,
)
from minillm.distributed.parallel_state import Communicator
from minillm.model.config import ModelConfig
from minillm.model.llama import LlamaForCausalLM
from minillm.model.moe import SparseMoeBlock


def kv_head_range(num_kv_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of the KV heads rank keeps: KV/p of them when p divides KV; with fewer
    KV heads than ranks, the one head its query heads read, replicated on p/KV ranks."""
    if num_kv_heads >= world_size:
        per_rank = num_kv_heads // world_size
        return rank * per_rank, (rank + 1) * per_rank
    head = rank * num_kv_heads // world_size
    return head, head + 1


def tensor_parallel_config(
    config: ModelConfig, world_size: int, expert_parallel: bool = False
) -> ModelConfig:
    """The shape one rank's shard has: its share of the heads and of the MLP width (and of
    every expert's width, unless the experts are spread whole over the ranks)."""
    start, end = kv_head_range(config.num_key_value_heads, 0, world_size)
    experts = {}
    if config.is_moe and not expert_parallel:
        experts = dict(
            moe_intermediate_size=config.moe_intermediate_size // world_size,
            shared_expert_intermediate_size=config.shared_expert_intermediate_size // world_size,
        )
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // world_size,
        num_key_value_heads=end - start,
        intermediate_size=config.intermediate_size // world_size,
        **experts,
    )


def shard_tensor(
    name: str,
    tensor: torch.Tensor,
    config: ModelConfig,
    rank: int,
    size: int,
    expert_parallel: bool = False,
):
    """This rank's slice of the full model's parameter `name`."""
    if ".mlp.experts." in name or ".mlp.shared_expert." in name:
        if expert_parallel:
            return tensor  # whole: the rank's own experts, and the replicated shared expert
        width = (
            config.moe_intermediate_size
            if ".mlp.experts." in name
            else config.shared_expert_intermediate_size
        ) // size
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return tensor[rank * width : (rank + 1) * width]
        return tensor[:, rank * width : (rank + 1) * width]  # down_proj
    d = config.head_dim
    per_rank_q = config.num_attention_heads // size * d
    per_rank_i = config.intermediate_size // size
    kv_start, kv_end = kv_head_range(config.num_key_value_heads, rank, size)
    if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
        return tensor[rank * per_rank_q : (rank + 1) * per_rank_q]
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        return tensor[kv_start * d : kv_end * d]
    if name.endswith("o_proj.weight"):
        return tensor[:, rank * per_rank_q : (rank + 1) * per_rank_q]
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return tensor[rank * per_rank_i : (rank + 1) * per_rank_i]
    if name.endswith("down_proj.weight"):
        return tensor[:, rank * per_rank_i : (rank + 1) * per_rank_i]
    return tensor  # norms and the o_proj bias: replicated


def vocab_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rows of rank's vocabulary range, zero-padded to ceil(V / p) rows."""
    vocab_size = weight.shape[0]
    start, end = vocab_range(vocab_size, rank, size)
    shard = weight.new_zeros((-(-vocab_size // size), weight.shape[1]))
    shard[: end - start] = weight[start:end]
    return shard


def is_other_ranks_expert(name: str, config: ModelConfig, rank: int, size: int) -> bool:
    """Whether `name` is an expert's tensor that another expert-parallel rank holds."""
    if ".mlp.experts." not in name:
        return False
    expert = int(name.split(".mlp.experts.")[1].split(".")[0])
    start, end = expert_range(config.num_experts, rank, size)
    return not start <= expert < end


@torch.no_grad()
def shard_model(
    full: LlamaForCausalLM, rank: int, comm: Communicator, expert_parallel: bool = False
) -> LlamaForCausalLM:
    """Rank's tensor-parallel shard of `full` (left unchanged): local heads and MLP width,
    row-parallel o_proj and down_proj, vocabulary-parallel embedding and LM head; the MoE
    layers' experts cut in width, or with `expert_parallel` spread whole over the ranks."""
    config, size = full.config, comm.world_size
    with torch.device("meta"):
        shard = LlamaForCausalLM(
            tensor_parallel_config(config, size, expert_parallel), full.attention_backend
        )
    state = {
        name: shard_tensor(name, tensor, config, rank, size, expert_parallel).clone()
        for name, tensor in full.state_dict().items()
        if not name.startswith(("lm_head.", "model.embed_tokens."))
        and not (expert_parallel and is_other_ranks_expert(name, config, rank, size))
    }
    shard.load_state_dict(state, strict=False, assign=True)
    for layer in shard.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallelLinear(attn.o_proj.weight, attn.o_proj.bias, comm)
        if not isinstance(mlp, SparseMoeBlock):
            mlp.down_proj = RowParallelLinear(mlp.down_proj.weight, None, comm)
        elif expert_parallel:
            make_expert_parallel(mlp, comm)  # drops the other ranks' (still meta) experts
        else:
            mlp.comm = comm  # one all-reduce sums the experts' partial outputs
    start, end = vocab_range(config.vocab_size, rank, size)
    embed = vocab_shard(full.model.embed_tokens.weight, rank, size)
    shard.model.embed_tokens = VocabParallelEmbedding(embed, start, end, comm)
    head = (
        shard.model.embed_tokens.weight
        if config.tie_word_embeddings
        else nn.Parameter(vocab_shard(full.lm_head.weight, rank, size), requires_grad=False)
    )
    shard.lm_head = ParallelLMHead(head, config.vocab_size, comm)
    return shard.eval()
