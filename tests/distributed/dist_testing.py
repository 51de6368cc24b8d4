"""Helpers for the multi-process tests: random `transformers` checkpoints (no downloads) and a
two-rank gloo group spawned for a function.

The engines under test spawn their own workers; `run_on_ranks` is for checking one layer or
one model shard against an oracle without an engine around it.
"""

from __future__ import annotations

import json
import pathlib
import pickle
import traceback

import tokenizers
import torch
import torch.multiprocessing as mp

ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
}


def build_hf_model(arch: str, seed: int = 0, **config):
    """A random float32 `transformers` model; norms and biases random too, so they matter."""
    import transformers

    config_name, model_name = ARCHITECTURES[arch]
    defaults = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    hf_config = getattr(transformers, config_name)(**{**defaults, **config})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(hf_config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model


MOE_CONFIGS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
    "qwen3_moe": dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False
    ),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=3,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        norm_topk_prob=True,
        num_hidden_layers=3,
        mlp_only_layers=[1],
    ),
}


def build_moe(arch: str, seed: int = 0, **overrides):
    """A random transformers MoE model whose routers are random too (transformers starts
    some at zero, where every expert ties)."""
    model = build_hf_model(arch, seed=seed, **{**MOE_CONFIGS[arch], **overrides})
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                param.normal_(0.0, 1.0)
    return model


def save_checkpoint(model, out: pathlib.Path) -> pathlib.Path:
    """The model and a word-level tokenizer (<s> = 1, </s> = 2) in a directory."""
    model.save_pretrained(out)
    vocab_size = model.config.vocab_size
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.save(str(out / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _rank_main(rank, fn, args, port, results):
    from minillm.distributed.parallel_state import init_process_group

    torch.set_num_threads(1)
    init_process_group(rank, 2, port, "cpu")
    try:
        # pickled here: a tensor put on the queue as is would be shared memory that dies with
        # this process
        results.put((rank, "ok", pickle.dumps(fn(rank, *args))))
    except BaseException:  # noqa: BLE001 - shown by the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        torch.distributed.destroy_process_group()


def run_on_ranks(fn, *args) -> list:
    """fn(rank, *args) on two gloo ranks (spawned processes); their results in rank order.
    fn must be importable by name (a module-level function)."""
    from minillm.distributed.parallel_state import free_port

    results = mp.get_context("spawn").SimpleQueue()
    context = mp.start_processes(
        _rank_main,
        args=(fn, args, free_port(), results),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    answers = sorted((results.get() for _ in range(2)), key=lambda answer: answer[0])
    while not context.join():
        pass
    errors = [value for _, status, value in answers if status == "error"]
    assert not errors, "\n".join(errors)
    return [pickle.loads(value) for _, _, value in answers]


def sharded_causal_logits(rank: int, checkpoints: list[str], token_ids: torch.Tensor) -> list:
    """Each checkpoint loaded, cut to this rank's tensor-parallel shard, and run causally."""
    from minillm.distributed.parallel_state import Communicator
    from minillm.distributed.tensor_parallel import shard_model
    from minillm.model.loader import load_model

    comm = Communicator(rank, 2)
    logits = []
    for path in checkpoints:
        shard = shard_model(load_model(path, "float32").model, rank, comm)
        with torch.no_grad():
            logits.append(shard.forward_causal(token_ids))
    return logits


def moe_sharded_causal_logits(rank: int, checkpoints: list[str], token_ids: torch.Tensor) -> list:
    """Each MoE checkpoint cut to this rank's shard, experts cut in width (tensor parallel)
    and spread whole (expert parallel), run causally: [(logits, collective calls)] per
    checkpoint and mode."""
    from minillm.distributed.parallel_state import Communicator
    from minillm.distributed.tensor_parallel import shard_model
    from minillm.model.loader import load_model

    results = []
    for path in checkpoints:
        for expert_parallel in (False, True):
            comm = Communicator(rank, 2)
            full = load_model(path, "float32").model
            shard = shard_model(full, rank, comm, expert_parallel)
            experts = sorted(int(e) for e in shard.model.layers[0].mlp.experts)
            with torch.no_grad():
                logits = shard.forward_causal(token_ids)
            results.append((logits, dict(comm.counts.calls), experts))
    return results


def early_receives(rank: int, compute_s: float):
    """Rank 1 posts the receives of a plan's two micro-batches (3 and 2 rows) as the plan
    arrives (`pipeline.EarlyReceives`), computes for compute_s, then takes them; rank 0
    sends both and waits until they are received. Rank 0 returns how long that took, rank 1
    what it took."""
    import time
    from types import SimpleNamespace as Chunk

    from minillm.distributed.parallel_state import Communicator
    from minillm.distributed.pipeline import EarlyReceives

    comm = Communicator(rank, 2)
    if rank == 0:
        hidden = [torch.arange(12.0).view(3, 4), -torch.arange(8.0).view(2, 4)]
        start = time.monotonic()
        for work in [comm.send(x, 1) for x in hidden]:
            work.wait()
        return time.monotonic() - start
    receives = EarlyReceives(comm, 4, torch.float32, "cpu")
    receives.post([[Chunk(num_new_tokens=3)], [Chunk(num_new_tokens=1), Chunk(num_new_tokens=1)]])
    time.sleep(compute_s)
    return [receives.take(3).clone(), receives.take(2).clone()]
