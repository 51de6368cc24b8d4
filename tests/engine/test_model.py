"""The minillm decoder against `transformers`' logits, without and with the paged KV cache."""

from __future__ import annotations

import json
import pathlib

import pytest
import safetensors.torch
import torch

from minillm.model.attention import AttentionMetadata
from minillm.model.config import ModelConfig
from minillm.model.llama import LlamaForCausalLM

ARCHS = ["llama", "qwen2", "qwen3"]
ATOL = 1e-4


def load_minillm(path: pathlib.Path, fused: bool = False) -> LlamaForCausalLM:
    config = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    model = LlamaForCausalLM(config).eval()
    state = safetensors.torch.load_file(path / "model.safetensors")
    missing, unexpected = model.load_state_dict(state, strict=False)
    # a tied checkpoint stores the shared matrix once, as the embedding
    assert missing == (["lm_head.weight"] if config.tie_word_embeddings else [])
    assert unexpected == []
    if fused:
        model.fuse_projections()
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_causal_matches_transformers(hf_checkpoint, arch):
    path, hf = hf_checkpoint(arch)
    model = load_minillm(path)
    input_ids = torch.randint(
        0, hf.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = hf(input_ids).logits
        actual = model.forward_causal(input_ids)
    assert actual.dtype == torch.float32
    assert actual.shape == (3, 40, hf.config.vocab_size)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


class PagedBatcher:
    """A minimal model runner: hands out blocks in scrambled order and builds flat batches.

    The KV cache starts as NaN, so reading any slot that was never written poisons the
    logits and fails the comparison.
    """

    def __init__(self, model: LlamaForCausalLM, block_size: int = 4, num_blocks: int = 64):
        config = model.config
        dtype = model.lm_head.weight.dtype
        self.device = model.lm_head.weight.device
        self.model = model
        self.block_size = block_size
        shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [
            torch.full(shape, float("nan"), dtype=dtype, device=self.device)
            for _ in range(config.num_hidden_layers)
        ]
        self.free_blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
        self.free_blocks = self.free_blocks.tolist()
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def step(self, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Run the new tokens of several sequences as one batch -> logits [q_len, vocab] each."""
        input_ids, positions, slots, query_start_loc, seq_lens = [], [], [], [0], []
        for seq_id, tokens in chunks.items():
            start = self.num_computed.setdefault(seq_id, 0)
            table = self.block_tables.setdefault(seq_id, [])
            while len(table) * self.block_size < start + len(tokens):
                table.append(self.free_blocks.pop())
            for pos in range(start, start + len(tokens)):
                slots.append(
                    table[pos // self.block_size] * self.block_size + pos % self.block_size
                )
            input_ids += tokens
            positions += range(start, start + len(tokens))
            query_start_loc.append(query_start_loc[-1] + len(tokens))
            seq_lens.append(start + len(tokens))
            self.num_computed[seq_id] = start + len(tokens)
        max_num_blocks = max(len(self.block_tables[s]) for s in chunks)
        block_tables = torch.zeros(len(chunks), max_num_blocks, dtype=torch.int32)
        for i, seq_id in enumerate(chunks):
            table = self.block_tables[seq_id]
            block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables,
            max_query_len=max(len(t) for t in chunks.values()),
            max_seq_len=max(seq_lens),
            block_size=self.block_size,
        )
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            setattr(meta, name, getattr(meta, name).to(self.device))
        with torch.no_grad():
            hidden = self.model(
                torch.tensor(input_ids, device=self.device),
                torch.tensor(positions, device=self.device),
                self.kv_caches,
                meta,
            )
            logits = self.model.compute_logits(hidden).cpu()
        return dict(zip(chunks, logits.split([len(t) for t in chunks.values()]), strict=True))


def random_tokens(vocab_size: int, n: int, seed: int) -> list[int]:
    return torch.randint(
        0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_paged_prefill_matches_transformers(hf_checkpoint, arch):
    path, hf = hf_checkpoint(arch)
    batcher = PagedBatcher(load_minillm(path))
    prompts = {"a": random_tokens(97, 13, seed=1), "b": random_tokens(97, 6, seed=2)}
    logits = batcher.step(prompts)
    for seq_id, tokens in prompts.items():
        torch.testing.assert_close(logits[seq_id], hf_logits(hf, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_paged_decode_matches_transformers_at_every_position(hf_checkpoint, arch):
    path, hf = hf_checkpoint(arch)
    batcher = PagedBatcher(load_minillm(path))
    # long enough to cross the llama3 rope_scaling's original context (32 positions)
    tokens = random_tokens(97, 45, seed=3)
    expected = hf_logits(hf, tokens)
    prompt_len = 7
    prefill = batcher.step({"s": tokens[:prompt_len]})["s"]
    torch.testing.assert_close(prefill, expected[:prompt_len], atol=ATOL, rtol=0)
    for pos in range(prompt_len, len(tokens)):
        step = batcher.step({"s": [tokens[pos]]})["s"]
        torch.testing.assert_close(step[0], expected[pos], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_projections_match_transformers(hf_checkpoint, arch):
    path, hf = hf_checkpoint(arch)
    model = load_minillm(path, fused=True)
    assert all(layer.self_attn.fused_qkv is not None for layer in model.model.layers)
    batcher = PagedBatcher(model)
    tokens = random_tokens(97, 20, seed=4)
    expected = hf_logits(hf, tokens)
    prefill = batcher.step({"s": tokens[:9]})["s"]
    torch.testing.assert_close(prefill, expected[:9], atol=ATOL, rtol=0)
    for pos in range(9, len(tokens)):
        step = batcher.step({"s": [tokens[pos]]})["s"]
        torch.testing.assert_close(step[0], expected[pos], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_fused_projections_compute_the_layers_or_step_aside(hf_checkpoint, arch):
    model = load_minillm(hf_checkpoint(arch)[0], fused=True)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    names = [name for name, _ in model.state_dict().items()]
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))

    def separate():
        return [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]

    with torch.no_grad():
        for got, want in zip(attn.fused_qkv(x), separate(), strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        gate, up = mlp.fused_gate_up(x)
        torch.testing.assert_close(gate, mlp.gate_proj(x), atol=1e-6, rtol=0)
        # the layers' Parameters are views: an in-place change reaches the fused GEMM
        attn.k_proj.weight.mul_(2.0)
        torch.testing.assert_close(attn.fused_qkv(x)[1], attn.k_proj(x), atol=1e-6, rtol=0)
        assert torch.is_grad_enabled() is False
    # with autograd on, the layers run alone (gradients must reach their Parameters)
    assert attn.fused_qkv(x) is None
    with torch.no_grad():
        handle = attn.v_proj.register_forward_hook(lambda m, a, out: out + 1)  # a LoRA hook
        assert attn.fused_qkv(x) is None
        handle.remove()
        assert attn.fused_qkv(x) is not None
        attn.q_proj.weight.data = attn.q_proj.weight.data.clone() * 3  # reassigned storage
        assert attn.fused_qkv(x) is None
        if arch == "qwen2":  # a bias's storage reassigned counts as much
            other = model.model.layers[1].self_attn
            assert other.fused_qkv(x) is not None
            other.v_proj.bias.data = other.v_proj.bias.data.clone()
            assert other.fused_qkv(x) is None
        # unchanged parameter names: checkpoints load and save as before
        assert [name for name, _ in model.state_dict().items()] == names
        mlp.up_proj = torch.nn.Linear(mlp.up_proj.in_features, mlp.up_proj.out_features)
        assert mlp.fused_gate_up(x) is None  # a replaced layer (a quantized one, say)


@pytest.mark.parametrize("arch", ARCHS)
def test_q_and_k_rotated_together_equal_rotated_apart(hf_checkpoint, arch):
    """The fused path cuts the QKV product as [q and k, v] and rotates q and k in one call;
    RoPE is elementwise, so every logit equals the one from rotating them apart."""
    path, _ = hf_checkpoint(arch)
    tokens = random_tokens(97, 16, seed=5)
    joint = load_minillm(path, fused=True)
    apart = load_minillm(path, fused=True)
    layers = [layer.self_attn for layer in apart.model.layers]
    for attn in layers:
        attn.joint_qk = None
    if arch != "qwen3":  # q/k norm comes before the rotation: nothing to rotate together
        assert all(layer.self_attn.joint_qk for layer in joint.model.layers)
    logits = {}
    for name, model in (("joint", joint), ("apart", apart)):
        batcher = PagedBatcher(model)
        steps = [batcher.step({"s": tokens[:9]})["s"]]
        steps += [batcher.step({"s": [t]})["s"] for t in tokens[9:]]
        logits[name] = torch.cat(steps)
    assert torch.equal(logits["joint"], logits["apart"])


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_equals_each_sequence_alone(hf_checkpoint, arch):
    path, hf = hf_checkpoint(arch)
    model = load_minillm(path)
    prompt_a = random_tokens(97, 20, seed=4)  # prefilled in chunks of 9, 11
    prompt_b = random_tokens(97, 10, seed=5)  # prefilled, then decoded
    decode_b = random_tokens(97, 3, seed=6)

    alone_a = PagedBatcher(model)
    alone_a.step({"a": prompt_a[:9]})
    expected_a = alone_a.step({"a": prompt_a[9:]})["a"]
    alone_b = PagedBatcher(model)
    alone_b.step({"b": prompt_b})
    expected_b = [alone_b.step({"b": [t]})["b"] for t in decode_b]

    mixed = PagedBatcher(model)
    mixed.step({"b": prompt_b, "a": prompt_a[:9]})
    # chunked prefill of a and a decode step of b in one flat batch
    both = mixed.step({"b": [decode_b[0]], "a": prompt_a[9:]})
    torch.testing.assert_close(both["a"], expected_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(both["b"], expected_b[0], atol=ATOL, rtol=0)
    for t, expected in zip(decode_b[1:], expected_b[1:], strict=True):
        torch.testing.assert_close(mixed.step({"b": [t]})["b"], expected, atol=ATOL, rtol=0)
    # and both agree with transformers over the full sequence
    torch.testing.assert_close(expected_a, hf_logits(hf, prompt_a)[9:], atol=ATOL, rtol=0)
    full_b = hf_logits(hf, prompt_b + decode_b)
    torch.testing.assert_close(torch.cat(expected_b), full_b[10:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_tied_and_untied_embeddings(hf_checkpoint, tie):
    path, hf = hf_checkpoint("llama", tie_word_embeddings=tie)
    model = load_minillm(path)
    shared = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert shared == tie
    input_ids = torch.tensor([random_tokens(97, 12, seed=7)])
    with torch.no_grad():
        torch.testing.assert_close(
            model.forward_causal(input_ids), hf(input_ids).logits, atol=ATOL, rtol=0
        )
    if not tie:
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ARCHS)
def test_half_precision_stays_close_to_float32(hf_checkpoint, arch, dtype):
    path, _ = hf_checkpoint(arch)
    model32 = load_minillm(path)
    model16 = load_minillm(path).to(dtype)
    tokens = random_tokens(97, 24, seed=8)
    with torch.no_grad():
        expected = model32.forward_causal(torch.tensor([tokens]))[0]
        causal = model16.forward_causal(torch.tensor([tokens]))[0]
    batcher = PagedBatcher(model16)
    paged = torch.cat(
        [batcher.step({"s": tokens[:16]})["s"], batcher.step({"s": tokens[16:]})["s"]]
    )
    assert causal.dtype == paged.dtype == torch.float32
    assert batcher.kv_caches[0].dtype == dtype
    # bf16 keeps 8 mantissa bits (unit roundoff 2^-8), fp16 11; logits here are O(1)
    atol = 0.15 if dtype == torch.bfloat16 else 0.02
    for actual in (causal, paged):
        torch.testing.assert_close(actual, expected, atol=atol, rtol=0)
        assert (actual.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_matches_cpu(hf_checkpoint, arch):
    path, _ = hf_checkpoint(arch)
    cpu = load_minillm(path)
    cuda = load_minillm(path).to("cuda")
    tokens = random_tokens(97, 30, seed=9)
    with torch.no_grad():
        expected = cpu.forward_causal(torch.tensor([tokens]))[0]
        causal = cuda.forward_causal(torch.tensor([tokens], device="cuda"))[0].cpu()
    batcher = PagedBatcher(cuda)
    paged = torch.cat(
        [batcher.step({"s": tokens[:20]})["s"], batcher.step({"s": tokens[20:]})["s"]]
    )
    # TF32 and other kernels: close, not bitwise
    torch.testing.assert_close(causal, expected, atol=1e-3, rtol=0)
    torch.testing.assert_close(paged, expected, atol=1e-3, rtol=0)
