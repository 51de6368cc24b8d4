"""Bootstrap intervals over evaluation windows: is a difference between two variants real?

A perplexity measured on W held-out windows is one draw of what the model does on text of
that kind; a second set of W windows would give another number. The bootstrap (Efron,
1979) estimates that spread from the windows themselves: draw W windows with replacement,
recompute the statistic, repeat B times; the 2.5th and 97.5th percentiles of the B values
are a 95% interval (the percentile interval). Comparing two variants, the windows are
resampled together (paired): both variants are scored on the same resampled windows, so
the large differences between windows, which both variants share, cancel, and what remains
is the spread of the difference itself.

A difference whose interval includes 0 is not separated by these windows: "A beats B" on
them would be a coin's word.

- `bootstrap_interval`: any statistic of [W, C] per-window values, rows resampled together.
- `perplexity_difference`: perplexity of A minus perplexity of B, from per-window mean
  cross-entropies (all windows of one length).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

DEFAULT_RESAMPLES = 2000
RESAMPLE_CHUNK = 500  # resamples evaluated at once (bounded memory)


@dataclass(frozen=True, slots=True)
class Interval:
    """A statistic on the data, and its bootstrap percentile interval at `level`."""

    estimate: float
    low: float
    high: float
    level: float
    num_resamples: int

    @property
    def excludes_zero(self) -> bool:
        """True when the whole interval lies on one side of 0: the difference is separated."""
        return self.low > 0 or self.high < 0


def bootstrap_interval(
    values: torch.Tensor,
    statistic: Callable[[torch.Tensor], torch.Tensor],
    num_resamples: int = DEFAULT_RESAMPLES,
    level: float = 0.95,
    seed: int = 0,
) -> Interval:
    """values: [W] or [W, C] per-window numbers (C variants scored on the same windows);
    statistic: maps a batch of resampled data [B, W, C] to [B] (it is also applied to the
    data itself, as a batch of one). Rows (windows) are drawn with replacement, W per
    resample, the same rows for every column. Returns the statistic on the data and the
    (1 - level) / 2 and (1 + level) / 2 quantiles of its B resampled values."""
    if values.dim() == 1:
        values = values[:, None]
    if values.dim() != 2 or values.shape[0] < 2:
        raise ValueError(f"values must be [W] or [W, C] with W >= 2, got {list(values.shape)}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if num_resamples < 1:
        raise ValueError(f"num_resamples must be >= 1, got {num_resamples}")
    values = values.double()
    w = values.shape[0]
    estimate = float(statistic(values[None])[0])
    gen = torch.Generator().manual_seed(seed)
    resampled = []
    for start in range(0, num_resamples, RESAMPLE_CHUNK):
        b = min(RESAMPLE_CHUNK, num_resamples - start)
        rows = torch.randint(0, w, (b, w), generator=gen)
        resampled.append(statistic(values[rows]).double().reshape(b))
    stats = torch.cat(resampled)
    tail = (1 - level) / 2
    low, high = torch.quantile(stats, torch.tensor([tail, 1 - tail], dtype=torch.float64))
    return Interval(estimate, float(low), float(high), level, num_resamples)


def perplexity_difference(
    ce_a: torch.Tensor,
    ce_b: torch.Tensor,
    num_resamples: int = DEFAULT_RESAMPLES,
    level: float = 0.95,
    seed: int = 0,
) -> Interval:
    """Perplexity of A minus perplexity of B over the same windows, with its paired
    bootstrap interval. ce_a, ce_b: [W] mean next-token cross-entropy (nats) of each window,
    windows of equal length, so perplexity = exp(mean over windows)."""
    ce_a, ce_b = torch.as_tensor(ce_a), torch.as_tensor(ce_b)
    if ce_a.shape != ce_b.shape or ce_a.dim() != 1:
        raise ValueError(
            f"ce_a and ce_b must be [W] over the same windows, got {list(ce_a.shape)} "
            f"and {list(ce_b.shape)}"
        )

    def gap(batch: torch.Tensor) -> torch.Tensor:  # [B, W, 2] -> [B]
        return batch[..., 0].mean(dim=1).exp() - batch[..., 1].mean(dim=1).exp()

    return bootstrap_interval(torch.stack([ce_a, ce_b], dim=1), gap, num_resamples, level, seed)


def verdict(interval: Interval, a: str, b: str, lower_is_better: bool = True) -> str:
    """What an interval of "A minus B" allows a page to say about A and B."""
    if not interval.excludes_zero:
        return f"{a} and {b} are not separated (the interval includes zero)"
    a_lower = interval.high < 0
    better, worse = (a, b) if a_lower == lower_is_better else (b, a)
    return f"{better} beats {worse} (the interval excludes zero)"
