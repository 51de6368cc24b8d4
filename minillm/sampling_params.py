"""`SamplingParams`: how one request turns logits into tokens, and when it stops.

Names, defaults and ranges follow vLLM's `SamplingParams`, so a reader's request code
transfers. Bad values are rejected here, where they enter, rather than deep inside the sampler.
The object is frozen: a value changed after construction would skip this validation.
"""

from __future__ import annotations

import enum
import json
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the compilers are imported where a constraint is compiled
    from minillm.structured.cfg import ContextFreeGrammar


class RequestOutputKind(enum.IntEnum):
    """Which outputs a request gets while it runs (vLLM's names and values).

    CUMULATIVE: after every step that adds to it, everything so far (text, token ids,
    logprobs) and the new text in `delta_text`. DELTA: after every such step, only what is
    new since the previous output. FINAL_ONLY: one output, when the request finishes;
    `LLM.generate` asks for this, so that a step builds no output nobody reads.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# Temperatures below this are greedy: dividing logits by a tiny temperature overflows
# (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE_EPS = 1e-5

# The sampler computes in float32: a temperature above float32's largest value becomes inf
# there, and a masked logit -inf / inf is NaN.
FLOAT32_MAX = float.fromhex("0x1.fffffep+127")  # about 3.4e38
# vLLM accepts any repetition penalty > 0. A logit is divided or multiplied by it in float32,
# so minillm bounds it to keep that finite for any logit a model can produce.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# top_k becomes an integer tensor column (vLLM's is int32); any value >= the vocabulary size
# already keeps every token.
MAX_TOP_K = 2**31 - 1
# vLLM's default max_logprobs.
MAX_LOGPROBS = 20
# torch.Generator.manual_seed accepts exactly these ints (a negative seed s is s + 2**64).
# Completion i of a request seeds its generator with seed + i, so seed + n - 1 must fit too.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
# stop_token_ids become int64 indices into the logits.
MAX_TOKEN_ID = 2**63 - 1
# what logprobs report (vLLM's logprobs_mode, an engine option): the model's own, or those of
# the distribution the token is drawn from after masks, penalties, temperature and filters
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """A constraint on the text of a request: exactly one of regex, json, choice or grammar.

    vLLM's names since v0.10.2, which renamed `guided_decoding=GuidedDecodingParams` (the old
    names were dropped in v0.12). Fields:
    `regex` (the whole output matches it, `minillm.structured.regex` lists the subset), `json`
    (a JSON schema, as a dict or its text, in the subset of `minillm.structured.json_schema`;
    the output is one JSON value in `json.dumps`'s layout), `choice` (the output is one of
    the strings) and `grammar` (the output is a sentence of a context-free grammar in the EBNF
    subset of `minillm.structured.cfg`). The first three are compiled to one regex, a grammar
    to a `ContextFreeGrammar` (`pattern`, either way), checked and compiled here, so a bad
    constraint is a ValueError where it enters.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    pattern: str | ContextFreeGrammar = field(init=False, repr=False, compare=False, default="")

    def __post_init__(self) -> None:
        # imported here, so that `import minillm.sampling_params` loads no compiler
        from minillm.structured.cfg import compile_grammar
        from minillm.structured.json_schema import schema_to_regex
        from minillm.structured.regex import compile_regex, escape

        names = ("json", "regex", "choice", "grammar")
        given = [name for name in names if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of json, regex, choice or grammar, "
                f"got {given}"
            )
        if self.grammar is not None:
            _require(
                isinstance(self.grammar, str), "structured_outputs.grammar", self.grammar, "a str"
            )
            try:
                compiled = compile_grammar(self.grammar)
            except ValueError as err:
                raise type(err)(f"structured_outputs.grammar: {err}") from None
            object.__setattr__(self, "pattern", compiled)
            return
        if self.regex is not None:
            _require(isinstance(self.regex, str), "structured_outputs.regex", self.regex, "a str")
            pattern = self.regex
        elif self.choice is not None:
            choice = self.choice
            ok = (
                isinstance(choice, list | tuple)
                and choice
                and all(isinstance(c, str) and c for c in choice)
            )
            _require(ok, "structured_outputs.choice", choice, "a non-empty list of non-empty str")
            object.__setattr__(self, "choice", tuple(choice))
            pattern = "|".join(f"(?:{escape(c)})" for c in choice)
        else:
            _require(
                isinstance(self.json, dict | str),
                "structured_outputs.json",
                self.json,
                "a JSON schema (a dict or its JSON text)",
            )
            if isinstance(self.json, dict):
                try:
                    json.dumps(self.json, allow_nan=False)
                except (TypeError, ValueError) as err:
                    raise ValueError(
                        f"structured_outputs.json holds a value JSON cannot: {err}"
                    ) from None
            pattern = schema_to_regex(self.json)
        compile_regex(pattern)  # RegexError (a ValueError) for a pattern outside the subset
        object.__setattr__(self, "pattern", pattern)


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """Options of `LLM.beam_search`, with vLLM's names and defaults.

    beam_width beams are kept per step; each beam is scored by get_beam_search_score:
    cumulative logprob / (sequence length ** length_penalty), the sequence being the prompt and
    the generated tokens (an EOS at the end not counted). The search asks the engine for
    2 * beam_width logprobs per beam, so beam_width is at most 10 here (logprobs <= 20).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        beam_allowed = f"an int in [1, {MAX_LOGPROBS // 2}]"
        beam_width = _as_int("beam_width", self.beam_width, beam_allowed)
        _require(1 <= beam_width <= MAX_LOGPROBS // 2, "beam_width", self.beam_width, beam_allowed)
        max_tokens = _as_int("max_tokens", self.max_tokens, "an int >= 1")
        _require(max_tokens >= 1, "max_tokens", self.max_tokens, "an int >= 1")
        temperature = _as_float("temperature", self.temperature, "a float >= 0")
        _require(temperature >= 0, "temperature", self.temperature, "a float >= 0")
        length_penalty = _as_float("length_penalty", self.length_penalty, "a finite float")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            _require(isinstance(getattr(self, name), bool), name, getattr(self, name), "a bool")
        for name, value in (
            ("beam_width", beam_width),
            ("max_tokens", max_tokens),
            ("temperature", temperature),
            ("length_penalty", length_penalty),
        ):
            object.__setattr__(self, name, value)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling and stopping options.

    The sampler applies them in vLLM V0's order: penalties on the raw logits, then temperature,
    then the top-k, top-p and min-p filters, then one random draw (or argmax when greedy).
    vLLM V1 applies min-p before top-k and top-p; the two differ when min-p and top-p are set.

    Where minillm is stricter than vLLM, it is so that every accepted value works in the
    sampler: temperature <= FLOAT32_MAX, repetition_penalty in [0.01, 100], top_k <= 2**31 - 1,
    logprobs <= 20, and seed + i within [-2**63, 2**64 - 1] for each completion i < n.
    Integer fields take any integer (numpy's too) but not a bool; float fields take any real
    number but not a bool. `stop` and `stop_token_ids` are stored as tuples.
    """

    n: int = 1  # completions per prompt; completion i of a seeded request uses seed + i
    temperature: float = 1.0  # 0 means greedy; at most FLOAT32_MAX
    top_p: float = 1.0  # (0, 1]; 1 is off
    top_k: int = 0  # 0 or -1 is off; at most 2**31 - 1; >= the vocabulary size keeps all tokens
    min_p: float = 0.0  # [0, 1]; 0 is off
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # [0.01, 100]; 1 is off
    seed: int | None = None  # seed + n - 1 within [-2**63, 2**64 - 1]
    max_tokens: int | None = 16  # None: until a stop condition or the model's length limit
    min_tokens: int = 0  # stop tokens are masked until this many tokens are out
    stop: str | Sequence[str] | None = None  # normalized to a tuple of non-empty str
    stop_token_ids: Sequence[int] | None = None  # normalized to a tuple of ids
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs to return besides the sampled token's; <= 20
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # constrained decoding: the output matches a regex, a JSON schema or one of a few choices
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # which outputs, and when

    def __post_init__(self) -> None:
        n = _as_int("n", self.n, "an int >= 1")
        _require(n >= 1, "n", self.n, "an int >= 1")
        temperature_allowed = f"a float in [0, {FLOAT32_MAX:.4g}] (0 is greedy)"
        temperature = _as_float("temperature", self.temperature, temperature_allowed)
        _require(
            0 <= temperature <= FLOAT32_MAX, "temperature", self.temperature, temperature_allowed
        )
        top_p = _as_float("top_p", self.top_p, "a float in (0, 1]")
        _require(0 < top_p <= 1, "top_p", self.top_p, "a float in (0, 1]")
        top_k_allowed = f"an int in [1, {MAX_TOP_K}], or 0 or -1 to turn it off"
        top_k = _as_int("top_k", self.top_k, top_k_allowed)
        _require(-1 <= top_k <= MAX_TOP_K, "top_k", self.top_k, top_k_allowed)
        min_p = _as_float("min_p", self.min_p, "a float in [0, 1]")
        _require(0 <= min_p <= 1, "min_p", self.min_p, "a float in [0, 1]")
        penalties = {}
        for name in ("presence_penalty", "frequency_penalty"):
            penalties[name] = _as_float(name, getattr(self, name), "a float in [-2, 2]")
            _require(-2 <= penalties[name] <= 2, name, getattr(self, name), "a float in [-2, 2]")
        repetition_allowed = (
            f"a float in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}] (1 is off)"
        )
        repetition_penalty = _as_float(
            "repetition_penalty", self.repetition_penalty, repetition_allowed
        )
        _require(
            MIN_REPETITION_PENALTY <= repetition_penalty <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            self.repetition_penalty,
            repetition_allowed,
        )
        seed = None
        if self.seed is not None:
            seed_allowed = (
                f"None or an int in [-2**63, 2**64 - n] (completion i seeds a 64-bit torch "
                f"generator with seed + i; here n={n})"
            )
            seed = _as_int("seed", self.seed, seed_allowed)
            _require(MIN_SEED <= seed and seed + n - 1 <= MAX_SEED, "seed", self.seed, seed_allowed)
        max_tokens = None
        if self.max_tokens is not None:
            max_tokens = _as_int("max_tokens", self.max_tokens, "None or an int >= 1")
            _require(max_tokens >= 1, "max_tokens", self.max_tokens, "None or an int >= 1")
        min_tokens = _as_int("min_tokens", self.min_tokens, "an int >= 0")
        _require(min_tokens >= 0, "min_tokens", self.min_tokens, "an int >= 0")
        if max_tokens is not None and min_tokens > max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={min_tokens} "
                f"and max_tokens={max_tokens}"
            )
        logprobs = None
        if self.logprobs is not None:
            logprobs_allowed = f"None or an int in [0, {MAX_LOGPROBS}]"
            logprobs = _as_int("logprobs", self.logprobs, logprobs_allowed)
            _require(0 <= logprobs <= MAX_LOGPROBS, "logprobs", self.logprobs, logprobs_allowed)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            _require(isinstance(value, bool), name, value, "True or False")
        _require(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            self.structured_outputs,
            "None or a StructuredOutputsParams",
        )
        _require(
            isinstance(self.output_kind, RequestOutputKind),
            "output_kind",
            self.output_kind,
            "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)",
        )

        normalized = {
            "n": n,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            **penalties,
            "repetition_penalty": repetition_penalty,
            "seed": seed,
            "max_tokens": max_tokens,
            "min_tokens": min_tokens,
            "logprobs": logprobs,
            "stop": _normalize_stop(self.stop),
            "stop_token_ids": _normalize_stop_token_ids(self.stop_token_ids),
        }
        for name, value in normalized.items():
            object.__setattr__(self, name, value)  # frozen: the one place fields are set

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS


def _require(ok: bool, name: str, value: object, allowed: str) -> None:
    # written as "not ok" so that NaN, which fails every comparison, is rejected too
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _as_int(name: str, value: object, allowed: str) -> int:
    """value as a Python int; any integer type but bool (True is not a count of 1)."""
    _require(
        isinstance(value, numbers.Integral) and not isinstance(value, bool), name, value, allowed
    )
    return int(value)


def _as_float(name: str, value: object, allowed: str) -> float:
    """value as a finite Python float; any real number but bool."""
    _require(isinstance(value, numbers.Real) and not isinstance(value, bool), name, value, allowed)
    try:
        result = float(value)
    except OverflowError:  # an int too large for a float
        result = math.inf
    _require(math.isfinite(result), name, value, allowed)
    return result


def _normalize_stop(stop: object) -> tuple[str, ...]:
    """None -> (), "x" -> ("x",), a list or tuple of non-empty strings -> a tuple of them."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be None, a str or a list of str, got {stop!r}")
    if "" in stop:
        raise ValueError(f"stop strings must be non-empty, got {stop!r}")
    return tuple(stop)


def _normalize_stop_token_ids(stop_token_ids: object) -> tuple[int, ...]:
    """None -> (), a list or tuple of token ids (ints in [0, 2**63 - 1]) -> a tuple of ints."""
    if stop_token_ids is None:
        return ()
    if not isinstance(stop_token_ids, list | tuple) or not all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID
        for t in stop_token_ids
    ):
        raise ValueError(
            f"stop_token_ids must be None or a list of ints in [0, 2**63 - 1], "
            f"got {stop_token_ids!r}"
        )
    return tuple(int(t) for t in stop_token_ids)
