"""What more than one page of chapter 5 computes: the exercise notebook's points, and the
fusion counts of the engine's RMSNorm that the chapter's summary quotes."""

from __future__ import annotations

import pathlib

import torch

from minillm.lab.exercise_count import exercise_points as count_exercise_points
from minillm.lab.op_trace import OpRecord, trace_ops
from minillm.model.config import ModelConfig
from minillm.model.llama import RMSNorm


def exercise_points(path: str | pathlib.Path) -> tuple[int, int] | None:
    """(graded cells, points) of an exercise notebook; None where the file is absent (Colab)."""
    points = count_exercise_points(path)
    return None if points is None else (len(points), sum(points))


def rmsnorm_fusion_trace(config: ModelConfig, tokens: int = 4096) -> list[OpRecord]:
    """The eager operations of the engine's RMSNorm with residual on a bfloat16 prefill
    chunk of `tokens` tokens of `config`, each with the bytes it moves (`trace_ops`)."""
    norm = RMSNorm(config.hidden_size, config.rms_norm_eps).to(torch.bfloat16)
    x = torch.randn(tokens, config.hidden_size, dtype=torch.bfloat16)
    residual = torch.randn(tokens, config.hidden_size, dtype=torch.bfloat16)
    _, ops = trace_ops(norm, x, residual)
    return ops


def paged_prefix(
    prefixes: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A KV cache holding each sequence's prefix in shuffled blocks, and its block table.

    Returns (kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] of random keys
    and values, block_tables [num_seqs, max_blocks] int32): sequence b's token t lives in
    block block_tables[b, t // block_size], at offset t % block_size. A sequence with no
    prefix still gets one block, so every row of the table names a real block."""
    blocks_per_seq = [max(1, -(-p // block_size)) for p in prefixes]
    order = torch.randperm(sum(blocks_per_seq)).int()
    cache = torch.randn(2, len(order), block_size, num_kv_heads, head_dim, device=device)
    table = torch.zeros(len(prefixes), max(blocks_per_seq), dtype=torch.int32)
    taken = 0
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = order[taken : taken + n]
        taken += n
    return cache, table.to(device)
