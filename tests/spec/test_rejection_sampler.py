"""The rejection sampler keeps the target's distribution exactly, and the wrong rules do not.

On exact distributions over a vocabulary of 16: a target p (token 1, token 2 given token 1,
token 3 given both) and a different draft q. Draft tokens are drawn from q; the sampler's first
two emitted tokens (a second round where the first emitted only one) must follow p's joint
distribution of (token 1, token 2): a chi-square test over 40,000 samples, seeded, at a fixed
significance level of 0.001. The same harness rejects the rules that look plausible and are
wrong: accepting when p > q with no residual and no bonus, and resampling from p instead of
the residual.
"""

from __future__ import annotations

import pytest
import torch
from spec_models import chi_square_p_value

from minillm.spec.rejection_sampler import RejectionOutput, rejection_sample
from minillm.worker.sampler import random_sample

VOCAB = 16
NUM_SAMPLES = 40_000
ALPHA = 1e-3  # significance level: the exact sampler must pass, the broken ones must fail


def random_dist(generator: torch.Generator, *shape: int, sharpness: float = 1.5) -> torch.Tensor:
    logits = sharpness * torch.randn(*shape, VOCAB, generator=generator)
    return logits.softmax(dim=-1)


@pytest.fixture(scope="module")
def dists():
    g = torch.Generator().manual_seed(1234)
    p1 = random_dist(g)  # target, token 1
    p2 = random_dist(g, VOCAB)  # target, token 2 | token 1
    p3 = random_dist(g, VOCAB, VOCAB)  # target, token 3 | tokens 1, 2
    q1 = random_dist(g)  # draft
    q2 = random_dist(g, VOCAB)
    # a few tokens the draft never proposes and the target never emits, both ways
    p1[3], q1[5] = 0.0, 0.0
    p1 /= p1.sum()
    q1 /= q1.sum()
    return p1, p2, p3, q1, q2


def draw_at(target_probs, positions, generator) -> list[int]:
    """One draw per row from the target's distribution at that row's position."""
    rows = torch.arange(len(positions))
    return random_sample(target_probs[rows, torch.tensor(positions)], (), generator).tolist()


def broken_greedy_rule(target_probs, draft_tokens, num_draft, draft_probs, generator):
    """Wrong: accept when p > q (no coin), on rejection draw from p, no bonus token."""
    k = draft_tokens.shape[1]
    p = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    num_accepted = (p > q).int().cumprod(dim=-1).sum(dim=-1).tolist()
    fresh = draw_at(target_probs, [min(a, k) for a in num_accepted], generator)
    out = [
        draft_tokens[b, :a].tolist() + ([fresh[b]] if a < k else [])
        for b, a in enumerate(num_accepted)
    ]
    return RejectionOutput(out, num_accepted)


def no_residual_rule(target_probs, draft_tokens, num_draft, draft_probs, generator):
    """Wrong: the min(1, p/q) test, but a rejected draft is replaced by a draw from p."""
    result = rejection_sample(
        target_probs, draft_tokens, num_draft, draft_probs, generator=generator
    )
    k = draft_tokens.shape[1]
    fresh = draw_at(target_probs, result.num_accepted, generator)
    out = [
        tokens[:-1] + [fresh[b]] if result.num_accepted[b] < k else tokens
        for b, tokens in enumerate(result.token_ids)
    ]
    return RejectionOutput(out, result.num_accepted)


def exact_rule(target_probs, draft_tokens, num_draft, draft_probs, generator):
    return rejection_sample(target_probs, draft_tokens, num_draft, draft_probs, generator=generator)


def first_two_tokens(rule, dists, seed: int) -> torch.Tensor:
    """Counts [VOCAB, VOCAB] of (token 1, token 2) over NUM_SAMPLES speculative rounds of k = 2
    drafts, with a second round of one draft for rows whose first round emitted one token."""
    p1, p2, p3, q1, q2 = dists
    g = torch.Generator().manual_seed(seed)
    n = NUM_SAMPLES
    d1 = torch.multinomial(q1.expand(n, VOCAB), 1, generator=g).squeeze(-1)
    d2 = torch.multinomial(q2[d1], 1, generator=g).squeeze(-1)
    target = torch.stack([p1.expand(n, VOCAB), p2[d1], p3[d1, d2]], dim=1)
    draft = torch.stack([q1.expand(n, VOCAB), q2[d1]], dim=1)
    first = rule(target, torch.stack([d1, d2], dim=1), [2] * n, draft, g).token_ids
    t1 = torch.tensor([tokens[0] for tokens in first])
    t2 = torch.tensor([tokens[1] if len(tokens) > 1 else -1 for tokens in first])
    again = (t2 < 0).nonzero().squeeze(-1)
    if len(again):
        x1 = t1[again]
        e = torch.multinomial(q2[x1], 1, generator=g).squeeze(-1)
        second = rule(
            torch.stack([p2[x1], p3[x1, e]], dim=1),
            e[:, None],
            [1] * len(again),
            q2[x1][:, None],
            g,
        ).token_ids
        t2[again] = torch.tensor([tokens[0] for tokens in second])
    counts = torch.zeros(VOCAB, VOCAB)
    counts.index_put_((t1, t2), torch.ones(n), accumulate=True)
    return counts


def test_emitted_tokens_follow_the_target_distribution(dists):
    p1, p2 = dists[0], dists[1]
    counts = first_two_tokens(exact_rule, dists, seed=0)
    assert chi_square_p_value(counts.sum(dim=1), p1) > ALPHA  # token 1
    assert chi_square_p_value(counts, p1[:, None] * p2) > ALPHA  # (token 1, token 2)
    assert counts[3].sum() == 0  # p1 = 0: never emitted, though the draft proposes it


@pytest.mark.parametrize("rule", [broken_greedy_rule, no_residual_rule])
def test_the_same_test_rejects_wrong_acceptance_rules(dists, rule):
    p1, p2 = dists[0], dists[1]
    counts = first_two_tokens(rule, dists, seed=0)
    assert chi_square_p_value(counts, p1[:, None] * p2) < ALPHA


def test_one_hot_drafts_keep_the_distribution():
    """A deterministic proposer (n-gram lookup: q = one-hot of the draft) accepts with
    probability p(draft) and replaces from p without the draft."""
    g = torch.Generator().manual_seed(7)
    p = random_dist(g)
    n = NUM_SAMPLES
    drafts = torch.arange(n)[:, None] % VOCAB
    target = torch.stack([p.expand(n, VOCAB), p.expand(n, VOCAB)], dim=1)
    out = rejection_sample(target, drafts, [1] * n, None, generator=g)
    first = torch.tensor([tokens[0] for tokens in out.token_ids])
    assert chi_square_p_value(torch.bincount(first, minlength=VOCAB), p) > ALPHA
    accepted = torch.tensor(out.num_accepted, dtype=torch.float)
    # acceptance rate of a one-hot draft: the mean of p over the drafts
    assert abs(accepted.mean() - p.mean()) < 4 * (0.25 / n) ** 0.5


def test_greedy_rows_accept_while_the_argmax_matches():
    target = torch.zeros(3, 4, VOCAB)
    argmaxes = [[2, 5, 7, 9], [4, 4, 4, 4], [1, 2, 3, 4]]
    for b, row in enumerate(argmaxes):
        for j, token in enumerate(row):
            target[b, j, token] = 1.0
    drafts = torch.tensor([[2, 5, 8], [4, 4, 4], [0, 2, 3]])
    out = rejection_sample(target, drafts, [3, 3, 3], None, torch.tensor([True, True, True]))
    assert out.num_accepted == [2, 3, 0]
    # accepted drafts, then the target's argmax: the correction, or the bonus after all three
    assert out.token_ids == [[2, 5, 7], [4, 4, 4, 4], [1]]


def test_rows_with_fewer_drafts_ignore_the_padding():
    target = torch.zeros(2, 3, VOCAB)
    target[:, :, 6] = 1.0
    drafts = torch.tensor([[6, 6], [6, -1]])
    out = rejection_sample(target, drafts, [2, 1], None, torch.tensor([False, False]))
    assert out.num_accepted == [2, 1]
    assert out.token_ids == [[6, 6, 6], [6, 6]]


def test_seeded_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    target = random_dist(g, 4, 3)
    draft = random_dist(g, 4, 2)
    drafts = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]])

    def run(rows):
        gens = [torch.Generator().manual_seed(100 + b) for b in rows]
        return rejection_sample(
            target[rows], drafts[rows], [2] * len(rows), draft[rows], None, gens
        ).token_ids

    assert run([0, 1, 2, 3])[2] == run([2])[0]
