"""End to end through the engine: with temperature 1 and a draft that is a different random
model, the generated tokens follow the target's exact distribution.

A random target with a vocabulary of 16, and a second random model as its draft. Every request
has the same prompt and max_tokens=4: its first token comes from the prompt's forward, then a
speculative round of k = 2 drafts yields tokens 2 and 3 (and a bonus). The exact distribution
of (token 2, token 3) comes from transformers' forward over every possible prefix, and a
chi-square test at significance 0.001 compares it with 3,000 engine samples. The same engine
with a broken acceptance rule fails the test.
"""

from __future__ import annotations

import pytest
import torch
from spec_models import build_llama, chi_square_p_value

import minillm.spec.spec_runner as spec_runner
from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.sampling_params import SamplingParams
from minillm.spec.rejection_sampler import RejectionOutput

VOCAB = 16
PROMPT = [0, 3, 7]
NUM_REQUESTS = 3000
ALPHA = 1e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-dist")
    target = build_llama(root / "target", VOCAB, seed=10, initializer_range=0.1)
    build_llama(root / "draft", VOCAB, seed=11, initializer_range=0.1)
    # the oracle: P(t1) P(t2 | t1) P(t3 | t1, t2) from transformers, over all prefixes
    with torch.no_grad():
        pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
        ids = torch.cat([torch.tensor(PROMPT).expand(len(pairs), 3), pairs], dim=1)
        probs = target(ids).logits.double().softmax(dim=-1)
    p1 = probs[0, 2]
    p2 = probs[::VOCAB, 3]  # [t1, t2]
    p3 = probs[:, 4].reshape(VOCAB, VOCAB, VOCAB)  # [t1, t2, t3]
    joint23 = (p1[:, None, None] * p2[:, :, None] * p3).sum(dim=0)
    return root / "target", root / "draft", joint23


def sample_tokens_2_and_3(models, num_requests: int = NUM_REQUESTS) -> tuple[torch.Tensor, object]:
    target, draft, _ = models
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    engine = LLMEngine(
        EngineArgs(
            target,
            speculative_config=spec,
            max_num_seqs=500,
            max_num_batched_tokens=2048,
            num_gpu_blocks=1100,
            seed=123,
        )
    )
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(str(i), PROMPT, params)
    counts = torch.zeros(VOCAB, VOCAB)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens = output.outputs[0].token_ids
                counts[tokens[1], tokens[2]] += 1
    return counts, engine.spec_decode_stats()


def test_tokens_2_and_3_follow_the_target(models):
    counts, stats = sample_tokens_2_and_3(models)
    joint23 = models[2]
    assert counts.sum() == NUM_REQUESTS
    assert chi_square_p_value(counts.sum(dim=1), joint23.sum(dim=1)) > ALPHA
    assert chi_square_p_value(counts, joint23) > ALPHA
    # both outcomes of the coin happened: the residual and the bonus were both used
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_accepted_tokens_per_pos[1] > 0


def broken_rule(target_probs, draft_tokens, num_draft_tokens, draft_probs, *args, **kwargs):
    """Accept a draft when p > q, else emit nothing more: no coin, no residual, no bonus."""
    k = draft_tokens.shape[1]
    p = target_probs[:, :k].gather(-1, draft_tokens.clamp_min(0)[..., None]).squeeze(-1)
    q = draft_probs.gather(-1, draft_tokens.clamp_min(0)[..., None]).squeeze(-1)
    accepted = (p > q).int().cumprod(dim=-1).sum(dim=-1).tolist()
    fallback = target_probs[:, 0].argmax(dim=-1).tolist()
    tokens = [draft_tokens[b, :a].tolist() or [fallback[b]] for b, a in enumerate(accepted)]
    return RejectionOutput(tokens, accepted)


def test_the_same_test_fails_a_broken_acceptance_rule(models, monkeypatch):
    monkeypatch.setattr(spec_runner, "rejection_sample", broken_rule)
    counts, _ = sample_tokens_2_and_3(models, num_requests=1000)  # fails by far at fewer
    assert chi_square_p_value(counts, models[2]) < ALPHA
