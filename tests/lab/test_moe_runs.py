"""The chapter's tiny MoE model loads in transformers with the same logits, and the expert
load of a run counts k experts for every token the model ran."""

from __future__ import annotations

import torch

from minillm.lab.moe_runs import expert_load_run, tiny_moe_checkpoint
from minillm.model.loader import load_model


def test_tiny_moe_matches_transformers_and_its_load_adds_up(tmp_path):
    import transformers

    path = tiny_moe_checkpoint(tmp_path / "moe")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.tensor([[1, 40, 41, 42, 300, 7, 99]])
    with torch.no_grad():
        want = hf(ids).logits
        got = load_model(path, "float32").model.forward_causal(ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)

    run = expert_load_run(path, ["def main():", "import os and then"], max_tokens=5)
    assert sorted(run.load) == [0, 1]
    for layer, counts in run.load.items():
        assert len(counts) == 8
        assert sum(counts) == run.num_tokens * 2  # top-2 routing
        assert run.imbalance(layer) == max(counts) / (sum(counts) / 8)
        assert run.imbalance(layer) > 1.0  # random routers do not balance
