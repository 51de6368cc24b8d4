"""Megatron-style tensor-parallel layers (Shoeybi et al., 2019, "Megatron-LM").

A linear layer y = x W^T splits two ways over p ranks:

- column-parallel: each rank holds a slice of W's output rows and computes its slice of y
  (QKV, gate and up projections); no communication, the next layer consumes the slice;
- row-parallel: each rank holds a slice of W's input columns, multiplies its slice of x and
  gets a partial sum of y; one all-reduce adds the partial sums (o_proj and down_proj).

Column then row is the pattern of both halves of a decoder layer, so a layer costs two
all-reduces of [num_tokens, hidden_size]. The vocabulary splits too: each rank embeds the
token ids in its range and zeroes the rest (one all-reduce), and computes the logits of its
range (one all-gather).

A column-parallel linear is an ordinary `nn.Linear` holding its slice, so it needs no class;
the classes below are the layers that communicate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minillm.distributed.parallel_state import Communicator


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b: W_r [out_features, in_features / p] is this rank's slice
    of the input columns; the bias is added once, after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Communicator):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.comm.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of the token ids rank owns: ceil(vocab_size / p) each, the last one short."""
    per_rank = -(-vocab_size // world_size)
    start = min(rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size)


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [start, end) of the embedding matrix, padded to ceil(V / p) rows.

    A token outside the rank's range looks up row 0 and is zeroed; the all-reduce then gives
    every token the one row that some rank holds."""

    def __init__(self, weight: torch.Tensor, start: int, end: int, comm: Communicator) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [ceil(V / p), hidden]
        self.start, self.end = start, end
        self.comm = comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.start) & (input_ids < self.end)
        local_ids = torch.where(mine, input_ids - self.start, 0)
        x = F.embedding(local_ids, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.comm.all_reduce(x)


class ParallelLMHead(nn.Module):
    """Logits of rows [start, end) of the vocabulary on each rank, all-gathered and trimmed of
    the padding rows: hidden [n, hidden] -> logits [n, vocab_size]."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, comm: Communicator) -> None:
        super().__init__()
        self.weight = weight  # [ceil(V / p), hidden]; the embedding's own when tied
        self.vocab_size = vocab_size
        self.comm = comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local_logits = F.linear(hidden, self.weight)
        return self.comm.all_gather(local_logits, dim=-1)[..., : self.vocab_size]
