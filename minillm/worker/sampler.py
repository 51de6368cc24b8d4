"""The sampler: one batch of logits in, one token per row out.

Each step of a row is a chain of logits processors followed by one draw, in vLLM V0's order
(vLLM V1 runs min-p right after temperature, before top-k and top-p):

    raw logits -> grammar mask -> min_tokens mask -> penalties -> temperature -> top-k -> top-p
           -> min-p -> sample

Greedy rows (temperature 0) take the argmax of the penalized logits and skip the rest. The
grammar mask (constrained decoding, `SamplingParams.structured_outputs`) sets every token the
request's grammar does not allow next to -inf (`minillm.structured`).

The logprobs the sampler reports follow vLLM's `logprobs_mode`: "raw_logprobs" (the default,
as vLLM V1 returns them) is the model's log-softmax before any processing; "raw_logits" the
model's logits themselves; "processed_logprobs" and "processed_logits" are taken from the
logits the token is finally drawn from: after the grammar mask, min_tokens, penalties,
temperature and top-k/top-p/min-p (-inf where masked or filtered). For a greedy row that is
after the penalties (greedy rows skip temperature and the filters, as in vLLM). One difference:
vLLM V1 applies the grammar bitmask to the logits before its sampler, so its raw logprobs are
already -inf where the grammar forbids; minillm's raw logprobs are the model's own.

Every processor is a function of the whole batch, with the per-row parameters as tensors:
`logits: [num_rows, vocab_size]`, `temperature: [num_rows]` and so on. Python loops remain only
where rows are ragged (token histories) or own separate state (random generators).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minillm.sampling_params import LOGPROBS_MODES, SamplingParams


@dataclass(slots=True)
class SamplingState:
    """What the sampler needs to know about one row of the batch."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # the request's own, when it has a seed; see make_generator
    eos_token_ids: Sequence[int] = ()  # masked with params.stop_token_ids until min_tokens
    request_id: str | None = None  # names the row's grammar state (structured outputs)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # logprob of each sampled token (raw or processed: logprobs_mode); None when no row asked
    # for logprobs, so that a step without them computes no log-softmax
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]] | None]  # params.logprobs best (id, logprob)


def make_generator(
    seed: int | None, index: int, device: str | torch.device
) -> torch.Generator | None:
    """The random generator of child `index` of a request (0 when n = 1), or None if unseeded.

    Child i of a seeded request draws from its own generator seeded with seed + i (vLLM V1's
    parallel-sampling rule), so its tokens depend on nothing else in the batch.
    """
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed + index)


def apply_min_tokens(logits: torch.Tensor, requests: Sequence[SamplingState]) -> torch.Tensor:
    """Forbid stop tokens in rows that have produced fewer than params.min_tokens tokens.

    The stop tokens are params.stop_token_ids plus the row's eos_token_ids (unless
    params.ignore_eos). Masking them, rather than ignoring them when they are sampled, keeps
    stop tokens out of the output.
    """
    logits = logits.clone()
    for row, request in enumerate(requests):
        params = request.params
        if len(request.output_token_ids) < params.min_tokens:
            stop_ids = list(params.stop_token_ids)
            if not params.ignore_eos:
                stop_ids += list(request.eos_token_ids)
            logits[row, stop_ids] = float("-inf")
    return logits


def token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """counts[b, t] = how often token t occurs in token_ids[b]. Returns [num_rows, vocab_size]."""
    counts = torch.zeros(len(token_ids), vocab_size, device=device)
    for row, ids in enumerate(token_ids):
        if ids:
            ids_tensor = torch.tensor(ids, device=device)
            counts[row] = torch.bincount(ids_tensor, minlength=vocab_size).to(counts.dtype)
    return counts


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    repetition_penalty: torch.Tensor,
) -> torch.Tensor:
    """Penalize tokens the request has already seen, on the raw logits (vLLM's conventions).

    Repetition penalty r (Keskar et al., 2019, CTRL), for every token t in prompt or output:
        l_t <- l_t / r  if l_t > 0,   l_t * r  otherwise
    so r > 1 makes a seen token less likely whatever the sign of its logit.
    Frequency penalty f and presence penalty p (OpenAI), over the output tokens only:
        l_t <- l_t - f * count_t - p * [count_t > 0]

    logits: [num_rows, vocab_size]; the penalties: [num_rows]; token ids: one list per row.
    """
    vocab_size = logits.shape[-1]
    output_counts = token_counts(output_token_ids, vocab_size, logits.device)
    output_mask = output_counts > 0
    seen = (token_counts(prompt_token_ids, vocab_size, logits.device) > 0) | output_mask
    r = torch.where(seen, repetition_penalty[:, None], 1.0)
    logits = torch.where(logits > 0, logits / r, logits * r)
    logits = logits - frequency_penalty[:, None] * output_counts
    return logits - presence_penalty[:, None] * output_mask


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Scale logits by 1 / T: softmax(l / T)_i is proportional to p_i ** (1 / T).

    T < 1 sharpens the distribution towards the argmax, T > 1 flattens it towards uniform.
    logits: [num_rows, vocab_size]; temperature: [num_rows], > 0.
    """
    return logits / temperature[:, None]


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the k most likely tokens (Fan et al., 2018, "Hierarchical Neural Story Generation").

        keep t  iff  l_t >= l_(k), the k-th largest logit of the row

    Tokens tied with the k-th largest all stay (so a row can keep more than k), as in vLLM and
    Hugging Face. top_k <= 0 or >= vocab_size keeps every token.
    logits: [num_rows, vocab_size]; top_k: [num_rows] int64. Dropped tokens get logit -inf.
    """
    vocab_size = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)
    sorted_logits = logits.sort(dim=-1, descending=True).values
    cutoff = sorted_logits.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < cutoff, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter (Holtzman et al., 2020, "The Curious Case of Neural Text Degeneration").

    Keep the smallest set of most likely tokens whose total probability reaches top_p:
        keep t  iff  sum of p_s over tokens s with p_s > p_t  <  top_p
    The most likely token always stays, and tokens tied at the cutoff stay or go together.
    top_p = 1 keeps every token.
    logits: [num_rows, vocab_size]; top_p: [num_rows] in (0, 1]. Dropped tokens get -inf.
    """
    probs = logits.softmax(dim=-1)
    sorted_probs = probs.sort(dim=-1, descending=True).values
    cumulative = sorted_probs.cumsum(dim=-1)
    # the top token stays; each next one stays while the mass before it is below top_p
    num_kept = 1 + (cumulative[:, :-1] < top_p[:, None]).sum(dim=-1)
    cutoff = sorted_probs.gather(-1, (num_kept - 1)[:, None])
    # top_p = 1 keeps all, even where rounding makes the cumulative sum reach 1.0 early
    cutoff = torch.where(top_p[:, None] < 1, cutoff, 0.0)
    return logits.masked_fill(probs < cutoff, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens at least min_p times as likely as the most likely one (Nguyen et al., 2024,
    "Turning Up the Heat: Min-p Sampling for Creative and Coherent LLM Outputs").

        keep t  iff  p_t >= min_p * max_s p_s

    The cutoff scales with the model's confidence: strict when one token dominates, loose when
    many are close. min_p = 0 keeps every token.
    logits: [num_rows, vocab_size]; min_p: [num_rows] in [0, 1]. Dropped tokens get -inf.
    """
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def random_sample(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token per row of probs: [num_rows, vocab_size] by the exponential race.

        token = argmax_t p_t / E_t,   E_t ~ Exp(1) independent

    E_t / p_t is exponential with rate p_t, and the smallest of independent exponentials is
    the t-th with probability p_t / sum_s p_s: an exact sample, and tokens with p_t = 0 never
    win. Row b draws its noise from generators[b] when it has one, so its token does not depend
    on the other rows; rows without one share `generator` (torch's default when None).
    Returns [num_rows] int64.
    """
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for row, row_generator in enumerate(generators):
        if row_generator is not None:
            noise[row].exponential_(generator=row_generator)
    # a draw of exactly 0 would make p / E infinite, or NaN where p = 0
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def top_logprobs(
    logprobs: torch.Tensor, num_top: Sequence[int | None]
) -> list[list[tuple[int, float]] | None]:
    """The num_top[b] best (token id, logprob) pairs of row b, best first (None where None).

    logprobs: [num_rows, vocab_size].
    """
    wanted = [n for n in num_top if n is not None]
    if not wanted:
        return [None] * len(num_top)
    k = min(max(wanted), logprobs.shape[-1])
    values, ids = (t.tolist() for t in logprobs.topk(k, dim=-1))
    return [
        None if n is None else list(zip(ids[row][:n], values[row][:n], strict=True))
        for row, n in enumerate(num_top)
    ]


class Sampler:
    """Turns a batch of logits into one token per row, each row with its own SamplingParams."""

    def __init__(
        self,
        generator: torch.Generator | None = None,
        structured_output_manager=None,
        logprobs_mode: str = "raw_logprobs",
    ) -> None:
        """structured_output_manager: a `minillm.structured.grammar.StructuredOutputManager`,
        needed by rows with structured_outputs; logprobs_mode: one of LOGPROBS_MODES."""
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}"
            )
        # shared by rows without a seed; torch's default generator when None
        self.generator = generator
        self.structured_output_manager = structured_output_manager
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, requests: Sequence[SamplingState]) -> SamplerOutput:
        """logits: [num_rows, vocab_size], the raw model logits; requests: one state per row."""
        if logits.ndim != 2 or logits.shape[0] != len(requests):
            raise ValueError(
                f"expected logits of shape [{len(requests)}, vocab_size] (one row per request), "
                f"got {tuple(logits.shape)}"
            )
        if logits.dtype != torch.float32:  # .float() of float32 logits is still a call
            logits = logits.float()
        mode = self.logprobs_mode
        params = [request.params for request in requests]
        wants_logprobs = any(p.logprobs is not None for p in params)
        reported = logits
        if wants_logprobs and mode == "raw_logprobs":
            reported = logits.log_softmax(dim=-1)

        processed = self.processed_logits(logits, requests)
        token_ids = processed.argmax(dim=-1)  # greedy; ties go to the lowest token id
        if not all(p.is_greedy for p in params):
            is_greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
            sampled = self.draw(processed.softmax(dim=-1), [r.generator for r in requests])
            token_ids = torch.where(is_greedy, token_ids, sampled)
        if not wants_logprobs:
            return SamplerOutput(token_ids.tolist(), None, [None] * len(params))
        if mode == "processed_logprobs":
            reported = processed.log_softmax(dim=-1)
        elif mode == "processed_logits":
            reported = processed

        return SamplerOutput(
            token_ids=token_ids.tolist(),
            logprobs=reported.gather(-1, token_ids[:, None]).squeeze(-1).tolist(),
            top_logprobs=top_logprobs(reported, [p.logprobs for p in params]),
        )

    def processed_logits(
        self, logits: torch.Tensor, requests: Sequence[SamplingState]
    ) -> torch.Tensor:
        """The logits each row draws from: the chain of processors in the module docstring's
        order (grammar mask, min_tokens, penalties, then temperature, top-k, top-p and min-p).

        Greedy rows stop after the penalties: their token is the argmax of these logits.
        Speculative decoding verifies drafts against exactly these (`minillm.spec`).
        logits: [num_rows, vocab_size], raw; returns float32 [num_rows, vocab_size].
        """
        if logits.dtype != torch.float32:
            logits = logits.float()
        params = [request.params for request in requests]
        grammar_mask = None
        if any(p.structured_outputs is not None for p in params):
            grammar_mask = self.grammar_masks(requests, logits)
            logits = logits.masked_fill(~grammar_mask, float("-inf"))
        if any(len(r.output_token_ids) < r.params.min_tokens for r in requests):
            constrained = logits
            logits = apply_min_tokens(logits, requests)
            if grammar_mask is not None:
                # where the grammar allows only stop tokens, it wins over min_tokens
                dead = ~torch.isfinite(logits).any(dim=-1, keepdim=True)
                logits = torch.where(dead, constrained, logits)
        if any(
            p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1 for p in params
        ):
            logits = apply_penalties(
                logits,
                [r.prompt_token_ids for r in requests],
                [r.output_token_ids for r in requests],
                self._column(params, "presence_penalty", logits),
                self._column(params, "frequency_penalty", logits),
                self._column(params, "repetition_penalty", logits),
            )
        if all(p.is_greedy for p in params):
            return logits
        is_greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
        return torch.where(is_greedy[:, None], logits, self._filter(logits, params, is_greedy))

    def draw(
        self, probs: torch.Tensor, generators: Sequence[torch.Generator | None]
    ) -> torch.Tensor:
        """One token per row of probs: [num_rows, vocab_size] (`random_sample`); row b draws
        from generators[b] when it has one, the others from the sampler's shared generator."""
        return random_sample(probs, generators, self.generator)

    def grammar_masks(
        self, requests: Sequence[SamplingState], logits: torch.Tensor
    ) -> torch.Tensor:
        """[num_rows, vocab_size] bool: the tokens each row's grammar allows next (all tokens
        in rows without structured_outputs). Stop tokens are allowed in accepting states."""
        manager = self.structured_output_manager
        vocab_size = logits.shape[-1]
        rows = []
        for request in requests:
            constraint = request.params.structured_outputs
            if constraint is None:
                rows.append(torch.ones(vocab_size, dtype=torch.bool))
                continue
            if manager is None or request.request_id is None:
                raise ValueError(
                    "structured_outputs needs a Sampler with a structured_output_manager and "
                    "rows with a request_id"
                )
            stop_ids = [*request.eos_token_ids, *request.params.stop_token_ids]
            mask = manager.allowed_mask(
                request.request_id, constraint.pattern, request.output_token_ids, stop_ids
            )
            rows.append(mask[:vocab_size])
        return torch.stack(rows).to(logits.device)

    def _filter(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], is_greedy: torch.Tensor
    ) -> torch.Tensor:
        """Temperature, then the filters that some row asks for (the sampling rows' part of
        the chain)."""
        temperature = self._column(params, "temperature", logits)
        # greedy rows' results are discarded; T = 1 just keeps their arithmetic finite
        logits = apply_temperature(logits, torch.where(is_greedy, 1.0, temperature))
        if any(p.top_k > 0 for p in params):
            logits = apply_top_k(logits, self._column(params, "top_k", logits, torch.int64))
        if any(p.top_p < 1 for p in params):
            logits = apply_top_p(logits, self._column(params, "top_p", logits))
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, self._column(params, "min_p", logits))
        return logits

    @staticmethod
    def _column(
        params: Sequence[SamplingParams],
        name: str,
        like: torch.Tensor,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """One sampling parameter of every row, as a [num_rows] tensor on like's device."""
        return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=like.device)
