"""The draft model proposer: a small model with its own paged KV cache proposes k tokens.

The draft's KV cache has its own tensors (the draft's layers, heads and head size) but the same
number of blocks and the same block size as the target's, and it is addressed through the
*target's* block tables: token t of a request lives in block table[t // block_size] in both
caches. So the scheduler's KV-cache manager stays the single owner of blocks: allocation,
prefix-cache hits, copy-on-write and the rollback of rejected tokens apply to both caches at
once, and the draft needs no block pool of its own.

Per request the proposer remembers how far its own KV is valid (`num_computed`): the draft
computes every token the target computes (prompt chunks included), but after a round in which
all k drafts were accepted it still lacks the last one, and after preemption or a prefix-cache
hit it starts where the target does. Each step it first catches up over the request's tokens
from there to the last one (one forward for the whole batch, prefill chunks alongside), then
proposes k tokens autoregressively: k - 1 more one-token forwards.

A request admitted on a prefix-cache hit starts its draft KV where its target KV starts,
trusting the cached blocks to hold the draft's keys and values too: the draft computed them
along with the target, except the last draft of a round whose k drafts were all accepted,
whose draft KV is written only in the request's next step. A request that finished right
after such a round leaves that one slot stale in the draft's cache; a later hit on the block
can only lower the draft's acceptance there, never change the output, which the target
verifies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from minillm.core.request import Request
from minillm.model.llama import LlamaForCausalLM
from minillm.worker.model_runner import allocate_kv_caches, prepare_inputs
from minillm.worker.sampler import SamplingState


@dataclass(slots=True)
class _Tokens:
    all_token_ids: list[int]


@dataclass(slots=True)
class TokenChunk:
    """Tokens num_computed_tokens .. + num_new_tokens - 1 of `request.all_token_ids`, in the
    shape `prepare_inputs` reads."""

    request: _Tokens
    num_computed_tokens: int
    num_new_tokens: int
    samples: bool
    block_ids: Sequence[int]


@dataclass(slots=True)
class DraftRow:
    """One request to propose for: its tokens, how many drafts, and how to sample them."""

    request: Request
    num_drafts: int
    block_ids: Sequence[int]
    generator: torch.Generator | None


class DraftModelProposer:
    """Runs the draft model over the target's block tables; see the module docstring."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int) -> None:
        self.model = model
        weight = next(model.parameters())
        self.device = weight.device
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(
            model.config, num_blocks, block_size, weight.dtype, self.device
        )
        self.num_computed: dict[str, int] = {}  # request id -> tokens with valid draft KV

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.num_computed.pop(request_id, None)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        for src, dst in copies:
            for kv_cache in self.kv_caches:
                kv_cache[:, dst] = kv_cache[:, src]

    def start(self, request_id: str, num_computed_tokens: int) -> int:
        """Where the draft's KV of a request ends: never past the target's."""
        return min(self.num_computed.get(request_id, num_computed_tokens), num_computed_tokens)

    def propose(
        self,
        catch_up: Sequence[tuple[str, Sequence[int], int, int, Sequence[int]]],
        rows: Sequence[DraftRow],
        distribution: Callable[[torch.Tensor, list[SamplingState]], torch.Tensor],
        states: Callable[[Request, list[int]], SamplingState],
        sample: Callable[[torch.Tensor, list[torch.Generator | None], torch.Tensor], torch.Tensor],
    ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Catch the draft's KV up and propose.

        catch_up: (request id, its tokens, start, end, block table) of every request the target
        computes in this step: the draft computes tokens start .. end - 1. rows: the requests
        to propose for, each of which is also in catch_up with end = its number of tokens, in
        the same order. distribution(logits, states) gives the processed probabilities, and
        sample(probs, generators, is_greedy) one token per row.
        Returns per row the draft tokens and their distributions q: [num_drafts, vocab].
        """
        proposing = {row.request.request_id for row in rows}
        chunks = [
            TokenChunk(_Tokens(list(tokens)), start, end - start, request_id in proposing, table)
            for request_id, tokens, start, end, table in catch_up
            if end > start
        ]
        proposals: list[list[int]] = [[] for _ in rows]
        q_rows: list[list[torch.Tensor]] = [[] for _ in rows]
        if not chunks:
            return proposals, []
        logits = self._run(chunks)  # one row per proposing request, in catch_up order
        for request_id, _tokens, _start, end, _table in catch_up:
            self.num_computed[request_id] = end
        active = list(range(len(rows)))
        for step in range(max((row.num_drafts for row in rows), default=0)):
            if step > 0:
                chunks = []
                for i in active:
                    row = rows[i]
                    # the newest proposal is the input; its KV goes to its own position
                    tokens = row.request.all_token_ids + proposals[i]
                    chunks.append(
                        TokenChunk(_Tokens(tokens), len(tokens) - 1, 1, True, row.block_ids)
                    )
                logits = self._run(chunks)
            seq_states = [states(rows[i].request, proposals[i]) for i in active]
            probs = distribution(logits, seq_states)
            greedy = torch.tensor(
                [rows[i].request.sampling_params.is_greedy for i in active], device=self.device
            )
            tokens = sample(probs, [rows[i].generator for i in active], greedy).tolist()
            for j, i in enumerate(active):
                proposals[i].append(tokens[j])
                q_rows[i].append(probs[j])
            active = [i for i in active if len(proposals[i]) < rows[i].num_drafts]
            if not active:
                break
        return proposals, [torch.stack(q) for q in q_rows]

    def accepted(self, request_id: str, num_tokens: int, num_drafts: int, num_accepted: int):
        """After verification: the draft's KV is valid for the request's first num_tokens
        tokens plus the accepted drafts it ran over (all but the last draft)."""
        self.num_computed[request_id] = num_tokens + min(num_accepted, num_drafts - 1)

    @torch.inference_mode()
    def _run(self, chunks: list[TokenChunk]) -> torch.Tensor:
        model_input = prepare_inputs(chunks, self.block_size, self.device)
        hidden = self.model(
            model_input.input_ids, model_input.positions, self.kv_caches, model_input.meta
        )
        return self.model.compute_logits(hidden[model_input.logits_indices]).float()
