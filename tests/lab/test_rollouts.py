"""The rollout-gap measurement's functions on inputs whose answers are worked out by hand, and
the measurement itself on a tiny engine against an exact float32 control."""

import math

import numpy as np
import pytest
import torch

from minillm.lab.rollouts import (
    RolloutGap,
    bf16_spacing,
    greedy_near_ties,
    near_tie_mask,
    rollout_gap,
    token_logprobs,
)


def test_token_logprobs_on_a_uniform_and_a_peaked_row():
    logits = torch.tensor(
        [[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, -math.inf, 0.0]], dtype=torch.float64
    )
    got = token_logprobs(logits, [2, 0]).tolist()
    # uniform over 4: log 1/4; peaked: e^{log 3} / (3 + 1 + 0 + 1) = 3/5
    assert got == pytest.approx([math.log(0.25), math.log(0.6)], abs=1e-12)
    with pytest.raises(ValueError, match="one row per token"):
        token_logprobs(logits, [0])


def test_bf16_spacing_is_the_gap_between_neighbouring_bfloat16_values():
    values = torch.tensor([1.0, 1.5, 10.0, -10.0, 0.5, 300.0])
    # 1 and 1.5 in [1, 2): 2^-7; 10 in [8, 16): 2^(3-7); 0.5 in [0.5, 1): 2^-8; 300: 2^(8-7)
    assert bf16_spacing(values).tolist() == [2**-7, 2**-7, 2**-4, 2**-4, 2**-8, 2.0]
    # the same number from bfloat16 itself: the next bit pattern up, minus the value
    for value in (1.0, 1.5, 10.0, 0.5, 300.0):
        bits = torch.tensor([value], dtype=torch.bfloat16).view(torch.int16)
        up = (bits + 1).view(torch.bfloat16).double()
        assert float(up - value) == bf16_spacing(torch.tensor([value])).item()


def test_near_ties_are_gaps_below_the_spacing_at_the_top_logit():
    logits = torch.tensor(
        [
            [10.0, 9.95, 0.0],  # gap 0.05 < 2^-4: a near-tie
            [10.0, 9.9, 0.0],  # gap 0.1 > 2^-4
            [0.2, 0.5, 0.497],  # top 0.5, gap 0.003 < 2^-8
            [1.0, 1.0, -1.0],  # an exact tie
            [-3.0, 1.0, 0.99],  # gap 0.01 > 2^-7 at 1.0
        ]
    )
    assert near_tie_mask(logits).tolist() == [True, False, True, True, False]


def test_rollout_gap_summaries():
    gap = RolloutGap(np.array([0.01, -0.02, 0.0, 0.04]), 2)
    assert gap.abs_mean == pytest.approx(0.0175)
    assert gap.abs_max == pytest.approx(0.04)
    assert gap.ratio_spread == pytest.approx((math.exp(-0.04), math.exp(0.02)))


@pytest.fixture(scope="module")
def models():
    transformers = pytest.importorskip("transformers")
    from minillm import LLM
    from minillm.model.loader import BUNDLED_MODELS_DIR

    path = BUNDLED_MODELS_DIR / "minillm-stdlib-target"
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return LLM("minillm-stdlib-target", dtype="float32"), LLM("minillm-stdlib-target"), hf


PROMPTS = ["def parse(text):", "import os\n", "class Point:"]


def test_a_float32_engine_matches_the_float32_trainer_and_bfloat16_does_not(models):
    fp32, bf16, hf = models
    exact = rollout_gap(fp32, hf, PROMPTS, 16)
    rounded = rollout_gap(bf16, hf, PROMPTS, 16)
    assert len(exact.deltas) >= 20 and exact.abs_max < 2e-5
    assert rounded.abs_mean > 100 * exact.abs_mean  # the gap is bfloat16's
    assert rounded.abs_max < 0.5  # and small: the same model


def test_minillms_full_sequence_forward_is_a_float32_trainer_too(models):
    from minillm.model.loader import load_model

    fp32, _, _ = models
    trainer = load_model("minillm-stdlib-target", dtype="float32").model
    assert rollout_gap(fp32, trainer, PROMPTS, 16).abs_max < 2e-5


def test_greedy_in_float32_has_no_flips(models):
    fp32, _, hf = models
    ties = greedy_near_ties(fp32, hf, PROMPTS, 16)
    assert ties.num_positions == 48
    assert ties.flips == []
