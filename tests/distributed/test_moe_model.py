"""The mixture-of-experts decoder (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE)
against transformers' logits, its routing against a brute-force top-k, and its checkpoint
names both ways."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from dist_testing import MOE_CONFIGS, build_moe, save_checkpoint

from minillm.model.config import ModelConfig
from minillm.model.loader import load_model, save_pretrained
from minillm.model.moe import RoutingRecorder, select_experts


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for i, arch in enumerate(MOE_CONFIGS):
        model = build_moe(arch, seed=i)
        out[arch] = (save_checkpoint(model, tmp_path_factory.mktemp(arch)), model)
    return out


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_moe_logits_match_transformers(checkpoints, arch):
    path, hf = checkpoints[arch]
    loaded = load_model(path, "float32")
    config = loaded.config
    hf_experts = MOE_CONFIGS[arch].get("num_experts", MOE_CONFIGS[arch].get("num_local_experts"))
    assert config.is_moe and config.num_experts == hf_experts
    token_ids = torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(token_ids).logits
        actual = loaded.model.forward_causal(token_ids)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
    # the dense layer of Qwen2-MoE's mlp_only_layers, and the shared expert, are there
    if arch == "qwen2_moe":
        assert not config.is_moe_layer(1) and config.is_moe_layer(2)
        assert loaded.model.model.layers[0].mlp.shared_expert is not None


def test_expert_load_matches_transformers_router(checkpoints):
    path, hf = checkpoints["qwen3_moe"]
    model = load_model(path, "float32").model
    token_ids = torch.randint(0, 101, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model.forward_causal(token_ids)
        router_logits = hf(token_ids, output_router_logits=True).router_logits
    load = model.model.routing.load_lists()
    assert sorted(load) == [0, 1]
    for layer, logits in enumerate(router_logits):
        top2 = torch.topk(logits.reshape(40, 6), 2, dim=-1).indices
        assert load[layer] == torch.bincount(top2.flatten(), minlength=6).tolist()
        assert sum(load[layer]) == 40 * 2


@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts_against_brute_force(renormalize):
    logits = torch.randn(30, 7, generator=torch.Generator().manual_seed(5))
    weights, ids = select_experts(logits, 3, renormalize)
    probs = torch.softmax(logits, dim=-1)
    for row in range(30):
        order = sorted(range(7), key=lambda e: -probs[row, e].item())[:3]
        assert ids[row].tolist() == order
        want = probs[row, order]
        want = want / want.sum() if renormalize else want
        torch.testing.assert_close(weights[row], want)


def test_replay_forces_recorded_routes():
    recorder = RoutingRecorder(num_experts=5)
    logits = torch.randn(6, 5, generator=torch.Generator().manual_seed(6))
    recorder.start_record()
    _, ids = recorder.route(0, logits, 2, True)
    trace = recorder.stop_record()
    recorder.start_replay(trace)
    weights, replayed = recorder.route(0, -logits, 2, True)  # a router that disagrees
    assert torch.equal(replayed, ids)
    torch.testing.assert_close(weights.sum(-1), torch.ones(6))
    with pytest.raises(ValueError, match="more"):
        recorder.route(0, logits, 2, True)  # a second pass the trace does not hold


def test_mixtral_names_round_trip(checkpoints, tmp_path):
    path, _ = checkpoints["mixtral"]
    loaded = load_model(path, "float32")
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in loaded.model.state_dict()
    out = save_pretrained(loaded.model, loaded.config, loaded.tokenizer, tmp_path / "again")
    original = safetensors.torch.load_file(path / "model.safetensors")
    saved = safetensors.torch.load_file(out / "model.safetensors")
    assert sorted(saved) == sorted(original)
    assert "model.layers.1.block_sparse_moe.experts.2.w3.weight" in saved
    for name, tensor in original.items():
        assert torch.equal(saved[name], tensor), name
    assert load_model(out, "float32").config.to_hf_config() == loaded.config.to_hf_config()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(num_local_experts=0), "num_experts must be an int"),
        (dict(num_local_experts=None), "num_experts must be an int"),
    ],
)
def test_bad_moe_configs(checkpoints, changes, message):
    cfg = checkpoints["mixtral"][1].config.to_dict()
    cfg.update(changes)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(cfg)


def test_missing_expert_count(checkpoints):
    cfg = checkpoints["qwen3_moe"][1].config.to_dict()
    cfg.pop("num_experts", None)
    cfg.pop("num_local_experts", None)
    with pytest.raises(ValueError, match="num_experts"):
        ModelConfig.from_hf_config(cfg)
