"""The rejection sampler: accept draft tokens so that the output follows the target exactly.

For each request the proposer offered draft tokens d_1 .. d_k, drawn from its distributions
q_1 .. q_k (a deterministic proposer, such as n-gram lookup, has q_j = one-hot(d_j)), and the
target scored all k + 1 positions in one forward, giving p_1 .. p_{k+1}. Left to right:

    accept d_j with probability min(1, p_j(d_j) / q_j(d_j))       (draw u ~ U[0, 1): u * q < p)
    on the first rejection, emit one token from the residual  max(0, p_j - q_j) / its sum, stop
    when all k are accepted, emit the bonus token from p_{k+1}

Every emitted token is distributed exactly as the target would have sampled it (Leviathan et
al., 2023; Chen et al., 2023): P(emit x) = min(p(x), q(x)) + (1 - sum_y min(p(y), q(y))) *
residual(x) = p(x). Greedy rows (temperature 0) are the limit: accept while d_j is the target's
argmax, then emit the target's argmax. p and q here are the *processed* distributions, after the
request's penalties, temperature, top-k and top-p (see `minillm.spec.spec_runner`).

Everything is batched over rows: target_probs [num_rows, max_k + 1, vocab], draft_probs
[num_rows, max_k, vocab] or None (one-hot drafts), draft_token_ids [num_rows, max_k] padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minillm.worker.sampler import random_sample


@dataclass(slots=True)
class RejectionOutput:
    token_ids: list[list[int]]  # per row: the accepted drafts, then the recovered or bonus token
    num_accepted: list[int]  # per row: how many draft tokens were accepted


def _uniform(
    shape: tuple[int, int],
    num_draft_tokens: Sequence[int],
    generators: Sequence[torch.Generator | None] | None,
    generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """U[0, 1) draws; a row with its own generator draws one per draft token of its own, so
    its stream does not depend on the other rows of the batch."""
    u = torch.rand(shape, generator=generator, device=device)
    for row, row_generator in enumerate(generators or ()):
        if row_generator is not None and num_draft_tokens[row]:
            n = num_draft_tokens[row]
            u[row, :n] = torch.rand(n, generator=row_generator, device=device)
    return u


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None = None,
    is_greedy: torch.Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    generator: torch.Generator | None = None,
) -> RejectionOutput:
    """Verify every row's draft tokens against the target (see the module docstring).

    target_probs: [num_rows, max_k + 1, vocab]; row b's positions 0 .. num_draft_tokens[b] are
    used. draft_token_ids: [num_rows, max_k] int64 (padding ignored). draft_probs: [num_rows,
    max_k, vocab] or None for one-hot drafts. is_greedy: [num_rows] bool (None: no row greedy).
    Random draws: each row from generators[b] when given, else from `generator`.
    """
    num_rows, width, _vocab = target_probs.shape
    max_k = width - 1
    device = target_probs.device
    num_draft = torch.tensor(list(num_draft_tokens), device=device)
    if is_greedy is None:
        is_greedy = torch.zeros(num_rows, dtype=torch.bool, device=device)
    drafts = draft_token_ids.clamp_min(0)
    if max_k > 0:
        p_draft = target_probs[:, :max_k].gather(-1, drafts[..., None]).squeeze(-1)
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)
        else:
            q_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
        u = _uniform((num_rows, max_k), num_draft_tokens, generators, generator, device)
        accept = u * q_draft < p_draft
        target_argmax = target_probs[:, :max_k].argmax(dim=-1)
        accept = torch.where(is_greedy[:, None], target_argmax == drafts, accept)
        accept &= torch.arange(max_k, device=device)[None, :] < num_draft[:, None]
        num_accepted = accept.int().cumprod(dim=-1).sum(dim=-1)
    else:
        num_accepted = torch.zeros(num_rows, dtype=torch.long, device=device)
    # the position of the extra token: the first rejection, or the bonus after all drafts
    rows = torch.arange(num_rows, device=device)
    p_next = target_probs[rows, num_accepted]
    rejected = num_accepted < num_draft
    if draft_probs is not None and max_k > 0:
        q_next = draft_probs[rows, num_accepted.clamp_max(max_k - 1)]
    else:
        q_next = torch.zeros_like(p_next)
        if max_k > 0:
            one_hot_rows = drafts[rows, num_accepted.clamp_max(max_k - 1)]
            q_next[rows, one_hot_rows] = 1.0
    residual = (p_next - q_next).clamp_min(0)
    residual = torch.where(rejected[:, None], residual, p_next)
    # p == q exactly leaves nothing to reject with; numerically, fall back to p
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p_next, residual)
    residual = residual / residual.sum(dim=-1, keepdim=True)
    extra = random_sample(residual, generators or (), generator)  # the sampler's own draw
    extra = torch.where(is_greedy, p_next.argmax(dim=-1), extra)
    num_accepted_list = num_accepted.tolist()
    drafts_list = drafts.tolist()
    extra_list = extra.tolist()
    token_ids = [drafts_list[b][: num_accepted_list[b]] + [extra_list[b]] for b in range(num_rows)]
    return RejectionOutput(token_ids=token_ids, num_accepted=num_accepted_list)
