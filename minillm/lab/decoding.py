"""What chapter 7 computes about decoding: models and measurements, not engine features.

- the sampler's filters applied to one distribution (`processed_distribution`), with the
  engine's own processors from `minillm.worker.sampler`;
- the speculative-decoding model of Leviathan et al. (2023): expected tokens per
  verification, the speed-up with a draft's cost, the best number of draft tokens, and the
  acceptance rate estimated from the engine's counters (`SpecDecodingStats`);
- a distribution check of the engine's rejection sampler (`first_token_counts`) and the
  chi-square test it is judged by;
- the roofline of verification: how much longer a target step of k + 1 tokens per sequence
  takes than a decode step, by batch size (chapter 2's `minillm.lab.roofline`);
- the UTF-8 pieces of a token sequence, and the time of grammar token masks.
"""

from __future__ import annotations

import codecs
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minillm.lab import roofline
from minillm.lab.hardware import DeviceSpec
from minillm.model.config import ModelConfig
from minillm.spec.rejection_sampler import rejection_sample
from minillm.worker.sampler import apply_min_p, apply_temperature, apply_top_k, apply_top_p


def processed_distribution(
    probs: Sequence[float] | torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """The distribution the engine's sampler draws from, for one row of probabilities.

    The logits are log(probs); then temperature, top-k, top-p and min-p in the sampler's order,
    each with the engine's processor, and a softmax. Returns float64 probabilities.
    """
    p = torch.as_tensor(probs, dtype=torch.float64)
    if p.ndim != 1 or (p < 0).any() or not math.isclose(float(p.sum()), 1.0, abs_tol=1e-6):
        raise ValueError("probs must be one row of non-negative probabilities summing to 1")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 here (greedy is the argmax), got {temperature}")
    logits = p.log()[None, :]
    logits = apply_temperature(logits, torch.tensor([temperature], dtype=torch.float64))
    logits = apply_top_k(logits, torch.tensor([top_k]))
    logits = apply_top_p(logits, torch.tensor([top_p], dtype=torch.float64))
    logits = apply_min_p(logits, torch.tensor([min_p], dtype=torch.float64))
    return logits.softmax(dim=-1)[0]


def expected_accepted_length(alpha: float, k: int) -> float:
    """Tokens one verification emits when each draft is accepted with probability alpha,
    independently: 1 + alpha + ... + alpha**k = (1 - alpha**(k + 1)) / (1 - alpha)."""
    if not 0 <= alpha <= 1 or k < 0:
        raise ValueError(f"expected 0 <= alpha <= 1 and k >= 0, got alpha={alpha}, k={k}")
    if alpha == 1:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def alpha_from_tokens_per_round(tokens_per_round: float, k: int) -> float:
    """The alpha at which k independent drafts would yield `tokens_per_round` tokens a round
    (the inverse of expected_accepted_length, by bisection; it increases with alpha)."""
    if not 1 <= tokens_per_round <= k + 1:
        raise ValueError(f"tokens_per_round must be in [1, {k + 1}], got {tokens_per_round!r}")
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if expected_accepted_length(mid, k) < tokens_per_round:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def speedup(alpha: float, k: int, draft_cost: float) -> float:
    """Leviathan et al.'s expected speed-up over the target alone: the tokens of one
    verification over its cost, k draft steps of `draft_cost` (a draft step's time over a
    target step's) plus one target step: E[tokens] / (1 + k * draft_cost).

    It assumes the verification of k + 1 tokens costs one decode step, which holds while the
    step is bandwidth-bound (small batches on a GPU; see `verification_slowdown`)."""
    if draft_cost < 0:
        raise ValueError(f"draft_cost must be >= 0, got {draft_cost}")
    return expected_accepted_length(alpha, k) / (1 + k * draft_cost)


def best_num_speculative_tokens(alpha: float, draft_cost: float, max_k: int = 16) -> int:
    """The k in 1 .. max_k with the largest `speedup` (the smallest k on a tie)."""
    return max(range(1, max_k + 1), key=lambda k: (speedup(alpha, k, draft_cost), -k))


def acceptance_rate_estimate(num_drafts: int, num_accepted_tokens_per_pos: Sequence[int]) -> float:
    """The per-token acceptance rate alpha that best explains the engine's counters.

    Draft j is tried only when drafts 0 .. j - 1 were accepted, so position j saw
    num_accepted_tokens_per_pos[j - 1] trials (num_drafts for j = 0). With independent
    acceptances the maximum-likelihood alpha is accepted over tried, pooled over positions.
    (The engine's draft_acceptance_rate divides by every token proposed, tried or not.)
    """
    tried = num_drafts + sum(num_accepted_tokens_per_pos[:-1])
    return sum(num_accepted_tokens_per_pos) / tried if tried else 0.0


def chi_square_p_value(counts: Sequence[int], probs: Sequence[float]) -> tuple[float, float]:
    """Pearson's chi-square statistic of counts against probs, and its p-value (df = number of
    cells with probs > 0, minus 1). Cells with probs == 0 must have counts == 0."""
    counts_t = torch.as_tensor(counts, dtype=torch.float64)
    probs_t = torch.as_tensor(probs, dtype=torch.float64)
    support = probs_t > 0
    if (counts_t[~support] > 0).any():
        return math.inf, 0.0
    n = counts_t.sum()
    expected = n * probs_t[support]
    statistic = float(((counts_t[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(statistic / 2)))
    return statistic, p_value


def first_token_counts(
    p: torch.Tensor, q: torch.Tensor, k: int, num_samples: int, seed: int = 0
) -> tuple[list[int], float]:
    """Run the engine's rejection sampler num_samples times, as one batch, on a context-free
    target p and draft q (the same distributions at every position), with k drafts drawn from
    q. Returns how often each token came out first, and the mean tokens per verification."""
    generator = torch.Generator().manual_seed(seed)
    vocab = p.shape[0]
    drafts = torch.multinomial(
        q.expand(num_samples, vocab), k, replacement=True, generator=generator
    )
    target = p.float().expand(num_samples, k + 1, vocab).contiguous()
    draft = q.float().expand(num_samples, k, vocab).contiguous()
    out = rejection_sample(
        target, drafts, [k] * num_samples, draft_probs=draft, generator=generator
    )
    first = torch.tensor([ids[0] for ids in out.token_ids])
    counts = torch.bincount(first, minlength=vocab).tolist()
    return counts, 1 + sum(out.num_accepted) / num_samples


def resample_from_target(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The first token's distribution under a broken rule: accept by min(1, p/q), but on a
    rejection draw from p itself instead of the residual. min(p, q) + (1 - sum min(p, q)) p,
    which is not p unless p == q."""
    overlap = torch.minimum(p, q)
    return overlap + (1 - overlap.sum()) * p


def verification_slowdown(
    config: ModelConfig, device: DeviceSpec, batch_size: int, k: int, context_len: int
) -> float:
    """Roofline time of a target step scoring k + 1 tokens per sequence over that of a decode
    step (one token each), for batch_size sequences of context_len tokens, bfloat16.

    Near 1 while decode is bandwidth-bound (the weights are read once either way); it grows
    towards k + 1 once the batch's k + 1 tokens make the step compute-bound."""
    peak = device.peak_flops_per_s["bfloat16"]
    bandwidth = device.memory_bandwidth_bytes_per_s
    verify = roofline.step_cost(config, batch_size, k + 1, context_len + k)
    decode = roofline.decode_step_cost(config, batch_size, context_len)
    return roofline.step_time_floor_s(verify, peak, bandwidth) / roofline.step_time_floor_s(
        decode, peak, bandwidth
    )


def utf8_pieces(token_bytes: Sequence[bytes]) -> list[tuple[bytes, str]]:
    """Each token's bytes and the text a stream may show once that token arrives: the UTF-8
    characters it completes (a token that ends inside a character shows nothing until the
    token that completes it). Invalid bytes show as U+FFFD."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return [(data, decoder.decode(data)) for data in token_bytes]


@dataclass(frozen=True, slots=True)
class MaskTiming:
    """Median and range (seconds) of building token masks cold and reading them cached."""

    num_states: int
    cold_median_s: float
    cold_min_s: float
    cold_max_s: float
    cached_median_s: float
    cached_min_s: float
    cached_max_s: float


def time_token_masks(grammar_factory, states: Sequence[int], repeats: int = 5) -> MaskTiming:
    """Time the token masks of `states`: cold (a fresh grammar from grammar_factory() walks
    the vocabulary trie for each state) and cached (the same masks looked up again), the two
    interleaved, repeats times. Times are per state."""
    cold, cached = [], []
    for _ in range(repeats):
        grammar = grammar_factory()
        start = time.perf_counter()
        for state in states:
            grammar.token_mask(state)
        cold.append((time.perf_counter() - start) / len(states))
        start = time.perf_counter()
        for state in states:
            grammar.token_mask(state)
        cached.append((time.perf_counter() - start) / len(states))
    return MaskTiming(
        len(states),
        statistics.median(cold),
        min(cold),
        max(cold),
        statistics.median(cached),
        min(cached),
        max(cached),
    )
