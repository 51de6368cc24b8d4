"""The step breakdown's arithmetic: shares that partition a step, FLOPs counted independently."""

from __future__ import annotations

import itertools
import pathlib
import sys

import pytest
import torch
from torch import nn

from minillm.lab.step_breakdown import PARTS, StepRecord, StepRecorder, breakdown, step_flops
from minillm.model.config import ModelConfig
from minillm.model.llama import LlamaForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "engine"))
from tiny_llama import build_tiny_llama  # noqa: E402


def test_breakdown_partitions_the_steps_time():
    steps = [
        StepRecord(step_s=10.0, model_s=8.0, attention_s=3.0, linear_s=4.0, flops=100.0),
        StepRecord(step_s=6.0, model_s=4.0, attention_s=1.0, linear_s=2.0, flops=60.0),
    ]
    b = breakdown(steps)
    assert b.num_steps == 2 and b.step_s == 16.0 and b.flops == 160.0
    assert b.shares == {
        "attention": 4 / 16,
        "linear": 6 / 16,
        "other model": 2 / 16,
        "outside the model": 4 / 16,
    }
    assert sum(b.shares.values()) == pytest.approx(1.0)
    assert b.flops_per_s == 10.0
    assert breakdown([]).shares == dict.fromkeys(PARTS, 0.0)


def test_recorder_with_a_fake_clock_accounts_for_every_tick(tmp_path):
    from minillm.llm import LLM
    from minillm.sampling_params import SamplingParams

    build_tiny_llama(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_num_seqs=4)
    ticks = itertools.count()
    recorder = StepRecorder(llm.engine, clock=lambda: float(next(ticks))).install()
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm.generate([[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]], params, use_tqdm=False)
    recorder.uninstall()
    steps = recorder.steps
    assert len(steps) == 5  # one prefill step, then four decode steps of all three
    assert [s.decode_only for s in steps] == [False] + [True] * 4
    assert [s.num_seqs for s in steps] == [3] * 5
    for s in steps:  # nested spans: each part fits inside the one around it
        assert 0 < s.attention_s and 0 < s.linear_s
        assert s.attention_s + s.linear_s < s.model_s < s.step_s
    shares = breakdown(steps).shares
    assert sum(shares.values()) == pytest.approx(1.0)
    assert all(share > 0 for share in shares.values())
    # uninstalled: the engine runs unwrapped, and the recorder sees nothing more
    assert "step" not in vars(llm.engine) and "forward" not in vars(llm.engine.model_runner)
    llm.generate([[5, 6]], params, use_tqdm=False)
    assert len(recorder.steps) == 5


def count_flops_by_hand(model: LlamaForCausalLM, query_lens, seq_lens, num_sampled):
    """2 FLOPs per weight of every nn.Linear below the LM head per token, 2 per LM-head weight
    per sampled row, and 4 * heads * head_dim per visible (query, key) pair per layer."""
    body = sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.startswith("model.layers.")
    )
    linear = 2 * body * sum(query_lens) + 2 * model.lm_head.weight.numel() * num_sampled
    pairs = 0
    for q, s in zip(query_lens, seq_lens, strict=True):
        for position in range(s - q, s):
            pairs += sum(1 for key in range(s) if key <= position)
    c = model.config
    return linear, 4 * c.num_attention_heads * c.head_dim * c.num_hidden_layers * pairs


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_flop_count_matches_the_models_own_shapes(kv_heads):
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    query_lens, seq_lens = [1, 1, 7, 3], [20, 5, 7, 12]  # decodes, a prompt, a later chunk
    got = step_flops(config, query_lens, seq_lens, num_sampled=3)
    assert got == count_flops_by_hand(model, query_lens, seq_lens, 3)


def test_the_overhead_share_counts_aten_operators_only(tmp_path, monkeypatch):
    """A traced forward's own profiler scope ("forward", the TorchScript interpreter between
    operators) is overhead, not operator time."""
    from minillm.engine.args import EngineArgs
    from minillm.engine.llm_engine import LLMEngine
    from minillm.lab import step_profile
    from minillm.lab.step_breakdown import python_overhead_share
    from minillm.lab.step_profile import OpTime

    build_tiny_llama(tmp_path)
    engine = LLMEngine(EngineArgs(model=tmp_path, device="cpu", dtype="float32"))
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    share = python_overhead_share(engine, prompts, repeats=3)
    assert 0.0 <= share < 1.0

    def interpreter_only(step):
        step()
        ops = [OpTime("forward", 1, 1e12), OpTime("aten::mm", 6, 0.0)]
        return ops, 1e12

    monkeypatch.setattr(step_profile, "profile_step", interpreter_only)
    assert python_overhead_share(engine, prompts, repeats=3) == 1.0
    assert not engine.has_unfinished_requests()
