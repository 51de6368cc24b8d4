"""Token quotas: one token bucket per API key, counting tokens rather than requests.

A bucket holds up to `burst` tokens and refills continuously at `rate` tokens per second
(`tokens_per_minute / 60`). A request is admitted when the bucket holds what it may cost:
its prompt tokens plus `max_tokens` for every completion it asks for (n of them), the most
it can ever use. That much is taken at admission; when the request ends, the part it did
not use (it stopped early, at EOS or a stop string) is given back. A client therefore pays
for what it generated, but a request that cannot fit its worst case in what is left waits.

Past the limit the server answers 429 with OpenAI's error body (type "tokens", code
"rate_limit_exceeded") and `Retry-After`: the whole seconds until the bucket has refilled
enough for this very request, if nothing else draws on it meanwhile. A request larger than
the burst can never fit: it gets 429 with no Retry-After, as OpenAI refuses a request larger
than its tokens-per-minute limit.

How this compares with a hosted API: OpenAI meters tokens per minute (TPM) and requests per
minute per organization and model, counts the prompt and the requested max_tokens against
TPM when the request arrives, and tells the state in `x-ratelimit-limit-tokens`,
`x-ratelimit-remaining-tokens` and `x-ratelimit-reset-tokens` headers, which this server also
sends on a 429. Gateways (Envoy, Kong, cloud API gateways) commonly limit requests, not
tokens; an LLM server must count tokens, because one request may cost a thousand times
another. Here the key is the bearer token of the Authorization header when the server
checks API keys (`--api-key`, repeated for several clients); without keys, every client
shares one bucket, since a bearer token nobody checks could be made up anew for each request.

The buckets live in the memory of the process that keeps them. Kept in each of N replicas,
they give a key N times its quota, so in a deployment with replicas the quota belongs in
front of them, where every request passes: `minillm router --rate-limit-tokens-per-minute`
(minillm.serve.router) or a gateway. The per-replica option (`minillm serve
--rate-limit-tokens-per-minute`) is for one server alone, or as a replica's own guard
against overload behind a router that already meters keys.

Everything here is plain Python with an injectable clock, so that tests replay arrivals
at exact times.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# float slack: a refill that should reach n exactly may land a few ulps short
EPSILON = 1e-9
# past it, full buckets are dropped (a full one equals a new one); the next drop waits until
# the buckets left have doubled, so that a new key costs O(1) on average however many are busy
MAX_IDLE_BUCKETS = 10_000


class TokenBucket:
    """`burst` tokens at most, refilled at `rate` tokens per second; starts full."""

    def __init__(
        self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not isinstance(rate, int | float) or isinstance(rate, bool) or not rate > 0:
            raise ValueError(f"rate must be a number > 0 (tokens per second), got {rate!r}")
        if not isinstance(burst, int | float) or isinstance(burst, bool) or not burst > 0:
            raise ValueError(f"burst must be a number > 0 (tokens), got {burst!r}")
        self.rate = float(rate)
        self.burst = float(burst)
        self.clock = clock
        self._level = float(burst)
        self._stamp = clock()

    @property
    def level(self) -> float:
        """The tokens in the bucket now."""
        now = self.clock()
        if now > self._stamp:
            self._level = min(self.burst, self._level + (now - self._stamp) * self.rate)
            self._stamp = now
        return self._level

    def wait_s(self, tokens: float) -> float:
        """Seconds until `tokens` fit (0: now; inf: never, more than the burst)."""
        if tokens > self.burst + EPSILON:
            return math.inf
        missing = tokens - self.level
        return 0.0 if missing <= EPSILON else missing / self.rate

    def try_take(self, tokens: float) -> float:
        """Take `tokens` and return 0.0, or take nothing and return the seconds to wait."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens!r}")
        wait = self.wait_s(tokens)
        if wait == 0.0:
            self._level = max(0.0, self._level - tokens)
        return wait

    def give_back(self, tokens: float) -> None:
        """Return tokens taken and not used (the bucket never holds more than the burst)."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens!r}")
        self._level = min(self.burst, self.level + tokens)


class RateLimited(Exception):
    """A request refused by its key's bucket."""

    def __init__(self, requested: int, limit_per_minute: float, remaining: float, wait_s: float):
        self.requested, self.limit_per_minute = requested, limit_per_minute
        self.remaining, self.wait_s = remaining, wait_s
        if math.isinf(wait_s):
            text = (
                f"Request too large on tokens per min (TPM): Limit {limit_per_minute:g}, "
                f"burst {remaining:g}, Requested {requested}. Lower max_tokens or the prompt "
                "(without max_tokens a request reserves all that max_model_len leaves)."
            )
        else:
            text = (
                f"Rate limit reached on tokens per min (TPM): Limit {limit_per_minute:g}, "
                f"Remaining {int(remaining)}, Requested {requested}. "
                f"Please try again in {wait_s:.3g}s."
            )
        super().__init__(text)

    @property
    def retry_after_s(self) -> int | None:
        """Whole seconds for the Retry-After header (None: retrying cannot help)."""
        return None if math.isinf(self.wait_s) else max(1, math.ceil(self.wait_s - EPSILON))


@dataclass
class Reservation:
    """Tokens taken for one request; `settle(used)` gives back the rest, once."""

    limiter: RateLimiter
    key: str
    tokens: int
    settled: bool = False

    def settle(self, used: int | None) -> None:
        """The request ended having used `used` tokens (None: unknown, keep it all)."""
        if self.settled:
            return
        self.settled = True
        if used is not None and used < self.tokens:
            self.limiter.give_back(self.key, self.tokens - used)


class RateLimiter:
    """One TokenBucket per key: `tokens_per_minute` sustained, `burst_tokens` at once
    (default: a minute's worth). Thread-safe."""

    def __init__(
        self,
        tokens_per_minute: float,
        burst_tokens: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (
            not isinstance(tokens_per_minute, int | float)
            or isinstance(tokens_per_minute, bool)
            or not tokens_per_minute > 0
        ):
            raise ValueError(
                f"rate_limit_tokens_per_minute must be a number > 0, got {tokens_per_minute!r}"
            )
        burst = tokens_per_minute if burst_tokens is None else burst_tokens
        if not isinstance(burst, int | float) or isinstance(burst, bool) or not burst > 0:
            raise ValueError(f"rate_limit_burst_tokens must be a number > 0, got {burst!r}")
        self.tokens_per_minute = float(tokens_per_minute)
        self.burst_tokens = float(burst)
        self.clock = clock
        self.buckets: dict[str, TokenBucket] = {}
        self.prune_at = MAX_IDLE_BUCKETS  # how many buckets trigger the next drop of full ones
        self._lock = threading.Lock()

    def _bucket(self, key: str) -> TokenBucket:
        bucket = self.buckets.get(key)
        if bucket is None:
            if len(self.buckets) >= self.prune_at:
                full = [k for k, b in self.buckets.items() if b.level >= b.burst - EPSILON]
                for k in full:
                    del self.buckets[k]
                self.prune_at = max(MAX_IDLE_BUCKETS, 2 * len(self.buckets))
            bucket = TokenBucket(self.tokens_per_minute / 60.0, self.burst_tokens, self.clock)
            self.buckets[key] = bucket
        return bucket

    def acquire(self, key: str, tokens: int) -> Reservation:
        """Take `tokens` from `key`'s bucket, or raise RateLimited (nothing taken)."""
        with self._lock:
            bucket = self._bucket(key)
            wait = bucket.try_take(tokens)
            if wait > 0.0:
                remaining = bucket.burst if math.isinf(wait) else bucket.level
                raise RateLimited(tokens, self.tokens_per_minute, remaining, wait)
        return Reservation(self, key, tokens)

    def give_back(self, key: str, tokens: int) -> None:
        with self._lock:
            self._bucket(key).give_back(tokens)

    def remaining(self, key: str) -> float:
        with self._lock:
            return self._bucket(key).level
