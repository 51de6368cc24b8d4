"""The sampler-trainer logprob gap of RL rollouts, measured on the bundled model.

In reinforcement learning from an inference engine's rollouts, the engine samples tokens and
reports their logprobs (in bfloat16, batched, with its own kernels); the trainer recomputes the
same tokens' logprobs with a full-sequence forward of its own (here in float32: minillm's
model without a KV cache on the book's page, transformers' Llama in the tests). The
policy-gradient ratio pi_trainer / pi_sampler should be 1 for on-policy data; the numerical
gap makes it differ per token. `rollout_gap` measures that gap, and
`greedy_near_ties` the cases where "greedy is identical" can fail: positions whose two best
logits are closer than bfloat16 can resolve.

The pure functions (`token_logprobs`, `bf16_spacing`, `near_tie_mask`) are what the
measurement rests on; tests pin them on constructed inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

BF16_MANTISSA_BITS = 7  # bfloat16 keeps 7 explicit mantissa bits (8 with the implicit one)


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """[n] float64: log softmax(logits[i])[token_ids[i]] for each row i of [n, vocab] logits."""
    if logits.ndim != 2 or logits.shape[0] != len(token_ids):
        raise ValueError(
            f"expected [{len(token_ids)}, vocab] logits, one row per token, got "
            f"{tuple(logits.shape)}"
        )
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    return log_probs[torch.arange(len(token_ids)), torch.as_tensor(token_ids)]


def bf16_spacing(values: torch.Tensor) -> torch.Tensor:
    """The gap between adjacent bfloat16 numbers at each |value| (its unit in the last place):
    2 ** (floor(log2 |x|) - 7) for a normal x."""
    magnitude = values.double().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - BF16_MANTISSA_BITS)


def near_tie_mask(logits: torch.Tensor) -> torch.Tensor:
    """[n] bool: rows of [n, vocab] logits whose best two values differ by less than the
    bfloat16 spacing at the best one (bfloat16 rounding alone could swap them)."""
    top = logits.double().topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]) < bf16_spacing(top[:, 0])


def trainer_logits(model, sequence: Sequence[int]) -> torch.Tensor:
    """[len(sequence) - 1, vocab] float32 logits of a full-sequence forward: row i predicts
    sequence[i + 1]. `model` is minillm's `LlamaForCausalLM` (its `forward_causal`: one pass
    over the whole sequence, no KV cache) or a transformers causal LM."""
    with torch.no_grad():
        ids = torch.tensor([list(sequence)])
        if hasattr(model, "forward_causal"):
            return model.forward_causal(ids)[0, :-1].float()
        return model(ids).logits[0, :-1].float()


@dataclass
class RolloutGap:
    """Per generated token: the sampler's logprob minus the trainer's (nats)."""

    deltas: np.ndarray
    num_sequences: int

    @property
    def abs_mean(self) -> float:
        return float(np.abs(self.deltas).mean())

    def abs_quantile(self, q: float) -> float:
        return float(np.quantile(np.abs(self.deltas), q))

    @property
    def abs_max(self) -> float:
        return float(np.abs(self.deltas).max())

    @property
    def ratio_spread(self) -> tuple[float, float]:
        """The smallest and largest importance ratio pi_trainer / pi_sampler = exp(-delta)."""
        return float(np.exp(-self.deltas.max())), float(np.exp(-self.deltas.min()))


def rollout_gap(llm, model, prompts: Sequence[str], max_tokens: int, seed: int = 0) -> RolloutGap:
    """Sample rollouts with the engine (batched decode, its dtype, temperature 1, raw
    logprobs of each sampled token) and recompute each token's logprob with `model`'s
    full-sequence forward; the deltas, sampler minus trainer."""
    from minillm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed, logprobs=0)
    outputs = llm.generate(list(prompts), params, use_tqdm=False)
    deltas = []
    for output in outputs:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        sampled = [entry[token] for entry, token in zip(completion.logprobs, tokens, strict=True)]
        logits = trainer_logits(model, [*output.prompt_token_ids, *tokens])
        trainer = token_logprobs(logits[len(output.prompt_token_ids) - 1 :], tokens)
        deltas.append(np.asarray(sampled, dtype=np.float64) - trainer.numpy())
    return RolloutGap(np.concatenate(deltas), len(outputs))


@dataclass
class GreedyTies:
    """Along the engine's greedy outputs: how many positions were near-ties, and the
    positions where the trainer's float32 argmax is another token (a flip)."""

    num_positions: int
    num_near_ties: int
    flips: list[dict]  # prompt index, position, engine token, float32 token, their logits


def greedy_near_ties(llm, model, prompts: Sequence[str], max_tokens: int) -> GreedyTies:
    """Greedy decode with the engine; at every position, the trainer's float32 logits of the
    same prefix: a near-tie count (`near_tie_mask`) and the positions whose float32 argmax
    differs from the engine's token."""
    from minillm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(list(prompts), params, use_tqdm=False)
    positions = ties = 0
    flips = []
    for index, output in enumerate(outputs):
        tokens = list(output.outputs[0].token_ids)
        prompt = list(output.prompt_token_ids)
        logits = trainer_logits(model, [*prompt, *tokens])[len(prompt) - 1 :]
        tie = near_tie_mask(logits)
        positions += len(tokens)
        ties += int(tie.sum())
        best = logits.argmax(dim=-1).tolist()
        for position, (engine_token, fp32_token) in enumerate(zip(tokens, best, strict=True)):
            if engine_token != fp32_token:
                flips.append(
                    {
                        "prompt": index,
                        "position": position,
                        "engine_token": engine_token,
                        "fp32_token": fp32_token,
                        "engine_logit": float(logits[position, engine_token]),
                        "fp32_logit": float(logits[position, fp32_token]),
                        "near_tie": bool(tie[position]),
                        "prefix": [*prompt, *tokens[:position]],
                    }
                )
    return GreedyTies(positions, ties, flips)
