"""Expert parallelism: the experts of every MoE layer spread over the ranks, tokens sent to
them and back with two all-to-alls.

As in vLLM (`enable_expert_parallel=True`, v0.10 and later), the expert-parallel group is the
tensor-parallel group here (vLLM's EP size is TP x DP, and minillm has no data parallelism):
attention, the dense layers, the embedding and the LM head stay tensor-parallel, and rank r of
p holds experts [r E/p, (r+1) E/p) whole, with its router replicated.

After attention's all-reduce every rank holds the hidden states of all n tokens. One MoE
layer then runs (`expert_parallel_moe`):

1. every rank routes all n tokens (the same top-k everywhere: same weights, same input);
2. rank r takes its share of the tokens, rows [r ceil(n/p), (r+1) ceil(n/p)) (`token_share`),
   and orders its (token, slot) pairs by the rank that owns their expert;
3. dispatch: one `all_to_all_single` sends each pair's hidden state to that rank. The counts
   need no exchange: every rank routed every token, so it knows what each peer will send;
4. each rank runs its experts on the rows it received;
5. combine: a second `all_to_all_single` sends the results back in the same order; the
   sender weights them with the router's probabilities and sums the k of each token (plus the
   shared expert, replicated on every rank and run on the rank's own share);
6. an all-gather of the token shares gives every rank all n outputs again.

gloo (the CPU backend) implements `all_to_all_single` with uneven splits, so the CPU test suite
runs the same collectives as NCCL would. Per MoE layer and step: 2 all-to-alls and 1 all-gather.
"""

from __future__ import annotations

import functools

import torch

from minillm.distributed.parallel_state import Communicator
from minillm.model.moe import SparseMoeBlock


def expert_range(num_experts: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of the experts rank holds (world_size divides num_experts)."""
    per_rank = num_experts // world_size
    return rank * per_rank, (rank + 1) * per_rank


def token_share(num_tokens: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of the tokens rank dispatches: ceil(n / p) each, the last ones short or
    empty."""
    per_rank = -(-num_tokens // world_size)
    start = min(rank * per_rank, num_tokens)
    return start, min(start + per_rank, num_tokens)


def make_expert_parallel(block: SparseMoeBlock, comm: Communicator) -> None:
    """Keep only this rank's experts in `block` (in place) and route its forward through
    dispatch and combine."""
    start, end = expert_range(block.num_experts, comm.rank, comm.world_size)
    for key in list(block.experts):
        if not start <= int(key) < end:
            del block.experts[key]
    block.moe_forward = functools.partial(expert_parallel_moe, block, comm)


def expert_parallel_moe(
    block: SparseMoeBlock,
    comm: Communicator,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """One MoE layer over the expert-parallel ranks: x [n, hidden] (the same on every rank),
    weights and ids [n, k] (the routes, the same on every rank) -> the layer's output
    [n, hidden], the same on every rank."""
    rank, size = comm.rank, comm.world_size
    n, k = ids.shape
    experts_per_rank = block.num_experts // size
    owner = ids // experts_per_rank  # [n, k]: the rank holding each pair's expert
    shares = [token_share(n, j, size) for j in range(size)]

    # dispatch order of this rank's pairs: by owner, in (token, slot) order within an owner
    start, end = shares[rank]
    mine = owner[start:end].flatten()
    order = torch.argsort(mine, stable=True)
    send_counts = torch.bincount(mine, minlength=size).tolist()
    send_rows = x[start + torch.div(order, k, rounding_mode="floor")]
    # what every peer sends here: its pairs owned by this rank, in the same order
    recv_counts, recv_experts = [], []
    for j_start, j_end in shares:
        flat_owner = owner[j_start:j_end].flatten()
        picked = torch.nonzero(flat_owner == rank, as_tuple=True)[0]
        recv_counts.append(len(picked))
        recv_experts.append(ids[j_start:j_end].flatten()[picked])
    recv_experts = torch.cat(recv_experts)

    received = comm.all_to_all(send_rows, send_counts, recv_counts)
    results = torch.empty_like(received)
    for key, expert in block.experts.items():
        rows = torch.nonzero(recv_experts == int(key), as_tuple=True)[0]
        if len(rows):
            results[rows] = expert(received[rows])
    returned = comm.all_to_all(results, recv_counts, send_counts)

    out = torch.zeros((end - start, x.shape[1]), dtype=x.dtype, device=x.device)
    pair_weights = weights[start:end].flatten()[order].to(x.dtype)
    out.index_add_(0, torch.div(order, k, rounding_mode="floor"), returned * pair_weights[:, None])
    if block.shared_expert is not None:
        out = out + block.shared_forward(x[start:end])
    per_rank = -(-n // size)
    padded = out.new_zeros((per_rank, x.shape[1]))
    padded[: end - start] = out
    return comm.all_gather(padded, dim=0)[:n]
