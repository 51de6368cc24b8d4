"""`SpecDecodeRunner`: one engine step with speculative decoding.

The scheduler reserves, for every request in decode, KV slots for its next token plus up to
k draft tokens (`ScheduledRequest.num_lookahead_tokens`). This runner then

1. asks the proposer for the drafts (the draft model, which also catches its KV cache up over
   every chunk the target computes; or n-gram lookup), and writes them into the plan
   (`spec_token_ids`, `num_new_tokens = 1 + len(drafts)`);
2. runs the target once over the whole batch: prefill chunks as usual, and for each
   speculating request its last token and its drafts, k + 1 positions, each scored;
3. verifies the drafts with the rejection sampler on the *processed* distributions, made by
   the target's own `Sampler.processed_logits`: the request's min_tokens mask and penalties
   (with the drafts before each position counted as output, as vLLM does), then temperature,
   top-k and top-p, applied to the target's p and the draft's q alike;
4. returns, for each speculating request, the accepted drafts plus one recovered or bonus
   token; the scheduler appends them and rolls the rejected slots back in both caches.

min_p is refused with speculative decoding, as vLLM refuses it (its rejection sampler does not
apply min_p to the target's positions), and so are structured outputs here. Logprobs are the
target's at each emitted position, as the engine's logprobs_mode asks: raw (the default) or
processed, as the sampler reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from minillm.core.request import Request
from minillm.core.scheduler import ScheduledRequest, SchedulerOutput
from minillm.outputs import SampledToken
from minillm.sampling_params import SamplingParams
from minillm.spec.config import SpeculativeConfig
from minillm.spec.draft_proposer import DraftModelProposer, DraftRow, TokenChunk, _Tokens
from minillm.spec.ngram_proposer import NgramProposer
from minillm.spec.rejection_sampler import rejection_sample
from minillm.worker.model_runner import ModelRunner, prepare_inputs
from minillm.worker.sampler import SamplingState, top_logprobs


def unsupported_with_spec_decode(params: SamplingParams) -> str | None:
    """Why a request cannot run with speculative decoding, or None (vLLM's limits)."""
    if params.min_p > 0:
        return "min_p is not supported with speculative decoding (as in vLLM)"
    if getattr(params, "structured_outputs", None) is not None:
        return "structured_outputs are not supported with speculative decoding in minillm"
    return None


@dataclass(slots=True)
class SpecDecodingStats:
    """Engine-level counters of speculative decoding (vLLM's names), over the engine's life.

    num_drafts: verification rounds (one per speculating request per step); num_draft_tokens:
    tokens proposed; num_accepted_tokens: tokens accepted; num_accepted_tokens_per_pos[j]:
    rounds whose draft j (0-based) was accepted; num_emitted_tokens: tokens the rounds produced
    (accepted plus one each); num_target_forwards: target forward passes that verified at least
    one draft.
    """

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_emitted_tokens: int = 0
    num_target_forwards: int = 0

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted over proposed tokens (vLLM's spec_decode draft_acceptance_rate)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Per position j: the share of rounds whose draft j was accepted."""
        return [
            n / self.num_drafts if self.num_drafts else 0.0
            for n in self.num_accepted_tokens_per_pos
        ]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification round: 1 + accepted drafts per round (vLLM's
        mean_acceptance_length)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        """Tokens emitted by speculating requests per target forward that verified drafts,
        summed over the batch (one request alone: equal to mean_acceptance_length)."""
        if not self.num_target_forwards:
            return 0.0
        return self.num_emitted_tokens / self.num_target_forwards


class SpecDecodeRunner:
    """The engine's runner when speculative decoding is on; wraps the target's ModelRunner."""

    def __init__(
        self,
        target: ModelRunner,
        config: SpeculativeConfig,
        max_model_len: int,
        draft_model=None,
        num_blocks: int = 0,
    ) -> None:
        self.target = target
        self.config = config
        self.block_size = target.block_size
        self.device = target.device
        self.draft: DraftModelProposer | None = None
        self.ngram: NgramProposer | None = None
        if config.method == "draft_model":
            self.draft = DraftModelProposer(draft_model, num_blocks, target.block_size)
        else:
            self.ngram = NgramProposer(
                config.prompt_lookup_min, config.prompt_lookup_max, max_model_len
            )
        self.stats = SpecDecodingStats(config.num_speculative_tokens)

    # the engine calls these like ModelRunner's
    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.target.kv_caches

    @torch.inference_mode()
    def execute_model(self, plan: SchedulerOutput) -> dict[str, SampledToken | list[SampledToken]]:
        """One speculative step over the plan: tokens of plain rows, token lists of
        speculating rows, by request id."""
        for request_id in plan.finished_req_ids:
            self.target.generators.pop(request_id, None)
        if self.draft is not None:
            self.draft.forget(plan.finished_req_ids)
            self.draft.copy_blocks(plan.block_copies)
        self.target.copy_blocks(plan.block_copies)
        scheduled = plan.scheduled
        if not scheduled:
            return {}
        draft_q = self._propose(plan)
        spec_rows = [chunk for chunk in scheduled if chunk.spec_token_ids]
        chunks = [
            TokenChunk(
                _Tokens(chunk.request.all_token_ids + chunk.spec_token_ids)
                if chunk.spec_token_ids
                else chunk.request,
                chunk.num_computed_tokens,
                chunk.num_new_tokens,
                chunk.samples,
                chunk.block_ids,
            )
            for chunk in scheduled
        ]
        model_input = prepare_inputs(chunks, self.block_size, self.device)
        hidden = self.target.forward(model_input)
        # logits of plain sampling rows (their last token) and of every speculated position
        query_start = model_input.meta.query_start_loc.tolist()
        plain_indices, spec_indices = [], []
        for i, chunk in enumerate(scheduled):
            if chunk.spec_token_ids:
                spec_indices.append(range(query_start[i], query_start[i + 1]))
            elif chunk.samples:
                plain_indices.append(query_start[i + 1] - 1)
        flat_spec = [index for indices in spec_indices for index in indices]
        logits = self.target.model.compute_logits(hidden[plain_indices + flat_spec])
        plain_logits, spec_logits = logits[: len(plain_indices)], logits[len(plain_indices) :]
        sampled: dict = {}
        plain_rows = [c.sampling_seqs for c in scheduled if c.samples and not c.spec_token_ids]
        if plain_rows:
            sampled.update(self.target.sample(plain_logits, plain_rows))
        if spec_rows:
            sampled.update(self._verify(spec_rows, spec_logits, draft_q))
        return sampled

    def _propose(self, plan: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Fill in each speculating request's drafts; return the draft's q by request id."""
        wanting = [chunk for chunk in plan.scheduled if chunk.num_lookahead_tokens > 0]
        q_by_id: dict[str, torch.Tensor] = {}
        proposals: list[list[int]]
        if self.ngram is not None:
            proposals = [
                self.ngram.propose(chunk.request.all_token_ids, chunk.num_lookahead_tokens)
                for chunk in wanting
            ]
        else:
            catch_up = []
            for chunk in plan.scheduled:
                request = chunk.request
                start = self.draft.start(request.request_id, chunk.num_computed_tokens)
                # a speculating decode computes its last token; a chunk, its planned tokens
                end = chunk.num_computed_tokens + (
                    1 if chunk.num_lookahead_tokens else chunk.num_new_tokens
                )
                catch_up.append(
                    (request.request_id, request.all_token_ids, start, end, chunk.block_ids)
                )
            rows = [
                DraftRow(
                    chunk.request,
                    chunk.num_lookahead_tokens,
                    chunk.block_ids,
                    self.target._generator(chunk.request),
                )
                for chunk in wanting
            ]
            proposals, qs = self.draft.propose(
                catch_up, rows, self._processed_probs, self._state, self._sample
            )
            q_by_id = {chunk.request.request_id: q for chunk, q in zip(wanting, qs, strict=True)}
        # set, not adjusted: a step run again request by request proposes again
        for chunk, drafts in zip(wanting, proposals, strict=True):
            chunk.spec_token_ids = list(drafts)
            chunk.num_new_tokens = 1 + len(drafts)
        if wanting:
            plan.num_batched_tokens = sum(chunk.num_new_tokens for chunk in plan.scheduled)
        return q_by_id

    def _state(self, request: Request, extra_output: list[int]) -> SamplingState:
        return SamplingState(
            params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids + extra_output,
            generator=self.target._generator(request),
            eos_token_ids=request.eos_token_ids,
        )

    def _processed_probs(
        self, logits: torch.Tensor, states: Sequence[SamplingState]
    ) -> torch.Tensor:
        """The distribution each row samples from, as the target's sampler processes it."""
        return self.target.sampler.processed_logits(logits, states).softmax(dim=-1)

    def _sample(
        self,
        probs: torch.Tensor,
        generators: list[torch.Generator | None],
        is_greedy: torch.Tensor,
    ) -> torch.Tensor:
        sampled = self.target.sampler.draw(probs, generators)
        return torch.where(is_greedy, probs.argmax(dim=-1), sampled)

    def _verify(
        self,
        spec_rows: list[ScheduledRequest],
        logits: torch.Tensor,
        draft_q: dict[str, torch.Tensor],
    ) -> dict[str, list[SampledToken]]:
        """Rejection-sample every speculating request; logits: [sum(k_i + 1), vocab]."""
        states: list[SamplingState] = []
        for chunk in spec_rows:
            drafts = chunk.spec_token_ids
            states += [self._state(chunk.request, drafts[:j]) for j in range(len(drafts) + 1)]
        processed = self.target.sampler.processed_logits(logits, states)
        probs = processed.softmax(dim=-1)
        # what logprobs report (vLLM's logprobs_mode, as the sampler has it)
        mode = getattr(self.target.sampler, "logprobs_mode", "raw_logprobs")
        reported = {
            "raw_logprobs": lambda: logits.float().log_softmax(dim=-1),
            "raw_logits": lambda: logits.float(),
            "processed_logprobs": lambda: processed.log_softmax(dim=-1),
            "processed_logits": lambda: processed,
        }[mode]()
        max_k = max(len(chunk.spec_token_ids) for chunk in spec_rows)
        vocab = logits.shape[-1]
        num_rows = len(spec_rows)
        target_probs = torch.zeros(num_rows, max_k + 1, vocab, device=logits.device)
        draft_tokens = torch.full((num_rows, max_k), -1, dtype=torch.long, device=logits.device)
        draft_probs = None
        if self.draft is not None:
            draft_probs = torch.zeros(num_rows, max_k, vocab, device=logits.device)
        starts, offset = [], 0
        for b, chunk in enumerate(spec_rows):
            k = len(chunk.spec_token_ids)
            starts.append(offset)
            target_probs[b, : k + 1] = probs[offset : offset + k + 1]
            draft_tokens[b, :k] = torch.tensor(chunk.spec_token_ids, device=logits.device)
            if draft_probs is not None:
                draft_probs[b, :k] = draft_q[chunk.request.request_id]
            offset += k + 1
        result = rejection_sample(
            target_probs,
            draft_tokens,
            [len(chunk.spec_token_ids) for chunk in spec_rows],
            draft_probs,
            torch.tensor([c.request.sampling_params.is_greedy for c in spec_rows]),
            [self.target._generator(chunk.request) for chunk in spec_rows],
            self.target.sampler.generator,
        )
        self.stats.num_target_forwards += 1
        out: dict[str, list[SampledToken]] = {}
        for b, chunk in enumerate(spec_rows):
            request = chunk.request
            k = len(chunk.spec_token_ids)
            num_accepted = result.num_accepted[b]
            self.stats.observe(k, num_accepted)
            if self.draft is not None:
                self.draft.accepted(request.request_id, request.num_tokens, k, num_accepted)
            tokens = result.token_ids[b]
            num_top = request.sampling_params.logprobs
            logprob_rows = reported[starts[b] : starts[b] + len(tokens)]
            tops = top_logprobs(logprob_rows, [num_top] * len(tokens))
            entries = []
            for j, token_id in enumerate(tokens):
                logprobs = None
                if num_top is not None:
                    logprobs = {token_id: float(logprob_rows[j, token_id])}
                    logprobs.update(tops[j] or [])
                entries.append(SampledToken(token_id, logprobs))
            out[request.request_id] = entries
        return out
