"""`SamplingParams`: how one request turns logits into tokens, and when it stops.

Names, defaults and ranges follow vLLM's `SamplingParams`, so a reader's request code
transfers. Bad values are rejected here, where they enter, rather than deep inside the sampler.
"""

from dataclasses import dataclass

# Temperatures below this are greedy: dividing logits by a tiny temperature overflows
# (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping options.

    The sampler applies them in vLLM's order: penalties on the raw logits, then temperature,
    then the top-k, top-p and min-p filters, then one random draw (or argmax when greedy).
    """

    n: int = 1  # completions per prompt; child i of a seeded request uses seed + i
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # (0, 1]; 1 is off
    top_k: int = 0  # 0 or -1 is off
    min_p: float = 0.0  # [0, 1]; 0 is off
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 is off
    seed: int | None = None
    max_tokens: int | None = 16  # None: until a stop condition or the model's length limit
    min_tokens: int = 0  # stop tokens are masked until this many tokens are out
    stop: str | list[str] | None = None  # normalized to a list
    stop_token_ids: list[int] | None = None  # normalized to a list
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs to return besides the sampled token's
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _require(isinstance(self.n, int) and self.n >= 1, "n", self.n, "an int >= 1")
        _require(self.temperature >= 0, "temperature", self.temperature, ">= 0 (0 is greedy)")
        _require(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _require(
            isinstance(self.top_k, int) and self.top_k >= -1,
            "top_k",
            self.top_k,
            "an int >= 1, or 0 or -1 to turn it off",
        )
        _require(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(-2 <= value <= 2, name, value, "in [-2, 2]")
        _require(
            self.repetition_penalty > 0,
            "repetition_penalty",
            self.repetition_penalty,
            "> 0 (1 is off)",
        )
        _require(
            self.seed is None or isinstance(self.seed, int), "seed", self.seed, "None or an int"
        )
        _require(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            self.max_tokens,
            "None or an int >= 1",
        )
        _require(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            "min_tokens",
            self.min_tokens,
            "an int >= 0",
        )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}"
            )
        _require(
            self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
            "logprobs",
            self.logprobs,
            "None or an int >= 0",
        )
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_stop_token_ids(self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS


def _require(ok: bool, name: str, value: object, allowed: str) -> None:
    # written as "not ok" so that NaN, which fails every comparison, is rejected too
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _normalize_stop(stop: object) -> list[str]:
    """None -> [], "x" -> ["x"], a list of non-empty strings -> a copy of it."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be None, a str or a list of str, got {stop!r}")
    if "" in stop:
        raise ValueError(f"stop strings must be non-empty, got {stop!r}")
    return list(stop)


def _normalize_stop_token_ids(stop_token_ids: object) -> list[int]:
    """None -> [], a list of token ids (ints >= 0) -> a copy of it."""
    if stop_token_ids is None:
        return []
    if not isinstance(stop_token_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_token_ids
    ):
        raise ValueError(
            f"stop_token_ids must be None or a list of ints >= 0, got {stop_token_ids!r}"
        )
    return list(stop_token_ids)
