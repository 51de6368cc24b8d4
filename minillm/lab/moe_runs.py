"""A tiny random mixture-of-experts model and the engine's per-expert load on it, for the
chapter's measured section.

`tiny_moe_checkpoint` writes a randomly initialized Qwen3-MoE-layout model (no download, no
training) with the bundled model's tokenizer; `expert_load_run` serves a few prompts on it and
returns what the engine recorded: tokens routed to each expert of each MoE layer, and the
imbalance of that load (the busiest expert over the mean), the number EPLB-style replication
works on. With `tensor_parallel_size=2, enable_expert_parallel=True` the engine records the
same counts (the tests check it), so a one-process run shows what the expert-parallel ranks
would receive.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import torch

from minillm import LLM, SamplingParams
from minillm.model.config import ModelConfig
from minillm.model.llama import LlamaForCausalLM
from minillm.model.loader import load_model, save_pretrained


def tiny_moe_config(vocab_size: int, num_experts: int = 8, top_k: int = 2) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=True,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    )


@torch.no_grad()
def tiny_moe_checkpoint(
    out_dir: str | os.PathLike,
    tokenizer_model: str = "minillm-stdlib-target",
    num_experts: int = 8,
    top_k: int = 2,
    seed: int = 0,
) -> pathlib.Path:
    """A random Qwen3-MoE model directory with `tokenizer_model`'s tokenizer; the routers
    are drawn wide (std 1) so that tokens spread over the experts unevenly, as real ones do."""
    base = load_model(tokenizer_model, "float32", weights=False)
    config = tiny_moe_config(base.config.vocab_size, num_experts, top_k)
    config = dataclasses.replace(
        config, bos_token_id=base.config.bos_token_id, eos_token_ids=list(base.eos_token_ids)
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    for name, param in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            param.normal_(0.0, 1.0)
    return save_pretrained(model, config, base.tokenizer, out_dir)


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertLoadRun:
    load: dict[int, list[int]]  # {layer: tokens routed to each expert}
    num_tokens: int  # tokens the model ran (prompt and generated, every pass)
    top_k: int

    def imbalance(self, layer: int) -> float:
        """The busiest expert's load over the mean load of the layer."""
        counts = self.load[layer]
        return max(counts) / (sum(counts) / len(counts))


def expert_load_run(
    model: str | os.PathLike, prompts: list[str], max_tokens: int = 16, **engine_options
) -> ExpertLoadRun:
    """Serve `prompts` greedily and return the engine's expert load of the run."""
    llm = LLM(str(model), dtype="float32", **engine_options)
    try:
        llm.engine.clear_parallel_stats()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        load = llm.engine.expert_load()
        top_k = llm.engine.config.num_experts_per_tok
    finally:
        llm.shutdown()
    # every token but the last sampled one of each request went through the model once
    num_tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outputs)
    return ExpertLoadRun(load, num_tokens, top_k)
