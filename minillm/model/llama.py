"""A Llama-family decoder (Llama 2/3, Qwen2, Qwen3) as an ordinary `nn.Module`.

`forward` runs one flat batch: the new tokens of many requests, prefill chunks and
decode tokens alike, packed into one `[num_tokens]` tensor with a position per token.
Attention reads and writes the paged KV cache through `AttentionMetadata`, so the
model never knows how the batch was formed. `forward_causal` is the textbook
`[batch, seq]` forward with no cache, for training and as a test oracle.

Parameter names match Hugging Face's, so a `transformers` checkpoint loads with
`load_state_dict` and our state_dict saves as one.

With the "triton" attention backend, RMSNorm and RoPE run as Triton kernels too
(`kernels.rmsnorm`, `kernels.rope`); with any other backend, as the PyTorch code below.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# first: on a machine without CUDA it switches Triton's interpreter on, which must happen
# before anything (here, torch._dynamo, which constructing a module can load) imports triton
import kernels  # noqa: F401
from minillm.model.attention import AttentionMetadata, get_attention_backend
from minillm.model.config import ModelConfig
from minillm.model.moe import SparseMoeBlock, attach_recorder
from minillm.model.rope import RotaryEmbedding, apply_rope_tables, rope_inv_freq, rope_tables

# backends whose model runs the RMSNorm and RoPE Triton kernels of `kernels/`
KERNEL_BACKENDS = frozenset({"triton"})

# (q, k) -> (q, k) rotated by the positions of the batch in flight
Rope = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich, 2019), computed in float32.

    With `residual`, returns (norm(x + residual), x + residual): a pre-norm block's residual
    add fused into the norm, as vLLM's `fused_add_rms_norm` (one kernel with `use_kernel`,
    which runs `kernels.rmsnorm.rms_norm` instead).
    """

    def __init__(self, hidden_size: int, eps: float, use_kernel: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_kernel = use_kernel

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.use_kernel:
            from kernels.rmsnorm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused call, the same arithmetic as below when nothing needs casting
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class FusedLinear:
    """Linear layers of one module (`owner`, by attribute name) on one input, computed by one
    GEMM: their weights (and biases) are views into one concatenated matrix, as vLLM's
    QKVParallelLinear and MergedColumnParallelLinear hold q/k/v and gate/up.

    The layers stay what they were (same names, same Parameters, now views), so loading,
    saving, LoRA, quantization and tensor parallelism see ordinary `nn.Linear` modules. The
    fused GEMM runs only while it computes exactly what the layers would: every layer still a
    plain hook-free `nn.Linear` whose tensors are the views made here (a replaced module, a
    LoRA hook, a reassigned or moved weight all fall back to one GEMM per layer), and no
    gradient is wanted (autograd would not reach the layers' own Parameters).
    """

    def __init__(self, owner: nn.Module, names: list[str]) -> None:
        linears = [getattr(owner, name) for name in names]
        if any(type(linear) is not nn.Linear for linear in linears):
            raise TypeError("FusedLinear fuses plain nn.Linear layers only")
        if len({linear.bias is None for linear in linears}) != 1:
            raise ValueError("FusedLinear needs all layers with a bias or all without")
        self.owner, self.names = owner, names
        self.sizes = [linear.out_features for linear in linears]
        with torch.no_grad():
            self.weight = torch.cat([linear.weight for linear in linears])
            self.bias = (
                None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])
            )
        start = 0
        for linear, size in zip(linears, self.sizes, strict=True):
            linear.weight = nn.Parameter(
                self.weight[start : start + size], requires_grad=linear.weight.requires_grad
            )
            if self.bias is not None:
                linear.bias = nn.Parameter(
                    self.bias[start : start + size], requires_grad=linear.bias.requires_grad
                )
            start += size
        self.views = [(linear.weight, linear.bias) for linear in linears]
        self.data_ptrs = [_data_ptrs(linear) for linear in linears]

    def __call__(
        self, x: torch.Tensor, unit: int = 1, sizes: list[int] | None = None
    ) -> list[torch.Tensor] | None:
        """[..., in_features] -> each layer's output, or None when the layers must run alone.

        With `unit` (a head size dividing every output), the outputs come as [..., size / unit,
        unit]: one view of the GEMM's output, split along the heads. With `sizes`, adding up
        to the layers' outputs, the output is cut into those widths instead: adjacent layers'
        outputs taken together (q and k, rotated by one RoPE call)."""
        if torch.is_grad_enabled():
            return None
        # read the modules' dicts directly: nn.Module.__getattr__ costs a lookup chain
        modules = self.owner._modules
        for name, (weight, bias), (weight_ptr, bias_ptr) in zip(
            self.names, self.views, self.data_ptrs, strict=True
        ):
            linear = modules.get(name)  # the layer there now, maybe replaced
            if (
                type(linear) is not nn.Linear
                or linear._forward_hooks
                or linear._forward_pre_hooks
                or linear._parameters.get("weight") is not weight
                or linear._parameters.get("bias") is not bias
                # `.data` reassigned, or the model moved
                or weight.data_ptr() != weight_ptr
                or (bias is not None and bias.data_ptr() != bias_ptr)
            ):
                return None
        out = F.linear(x, self.weight, self.bias)
        sizes = self.sizes if sizes is None else sizes
        if unit == 1:
            return out.split(sizes, dim=-1)
        return out.unflatten(-1, (-1, unit)).split([size // unit for size in sizes], dim=-2)


def _data_ptrs(linear: nn.Linear) -> tuple[int, int]:
    return linear.weight.data_ptr(), 0 if linear.bias is None else linear.bias.data_ptr()


class TableRope:
    """The rotation of one batch's positions, from tables every layer shares (`rope_tables`):
    called on q and k, or `rotate` on q and k heads side by side in one tensor, which rotates
    each element as the call would."""

    __slots__ = ("cos", "sin")

    def __init__(self, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, signed_sin

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(q), self.rotate(k)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., heads, head_dim], its positions those of the tables -> x rotated."""
        return apply_rope_tables(x, self.cos, self.sin)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention; Qwen2's q/k/v bias and Qwen3's q/k norm are switches."""

    def __init__(self, config: ModelConfig, backend_name: str) -> None:
        super().__init__()
        use_kernels = backend_name in KERNEL_BACKENDS
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        # Qwen2 biases q, k and v only; Llama and Qwen3 use attention_bias for o_proj too.
        o_bias = bias and config.architecture not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, use_kernels)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, use_kernels)
        self.qk_norm = config.qk_norm
        self.backend = get_attention_backend(backend_name)
        self.fused_qkv: FusedLinear | None = None  # set by `fuse_projections`
        # the fused output cut as [q and k, v] when q and k are rotated together (not when
        # they are normalized first, nor for the Triton kernels, which take them apart)
        self.joint_qk = None if config.qk_norm or use_kernels else [q_size + kv_size, kv_size]
        self.use_kernels = use_kernels

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        kv_cache_layer: torch.Tensor | None,
        meta: AttentionMetadata | None,
    ) -> torch.Tensor:
        """x: [num_tokens, hidden] with a cache, or [batch, seq, hidden] without (meta None)."""
        if self.fused_qkv is not None and self.joint_qk and isinstance(rope, TableRope):
            # q and k side by side in the GEMM's output: one rotation for both
            qkv = self.fused_qkv(x, self.head_dim, self.joint_qk)
            if qkv is not None:
                qk, v = qkv
                q, k = rope.rotate(qk).split([self.num_heads, self.num_kv_heads], dim=-2)
                return self._attend(q, k, v, kv_cache_layer, meta)
        qkv = None if self.fused_qkv is None else self.fused_qkv(x, self.head_dim)
        if qkv is None:
            lead = x.shape[:-1]
            q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)
            k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        elif self.use_kernels:  # the Triton kernels take contiguous rows
            q, k, v = (t.contiguous() for t in qkv)
        else:
            q, k, v = qkv
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, k)
        return self._attend(q, k, v, kv_cache_layer, meta)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache_layer: torch.Tensor | None,
        meta: AttentionMetadata | None,
    ) -> torch.Tensor:
        if meta is None:
            out = causal_attention(q, k, v, self.scale)
        else:
            out = self.backend.forward(q, k, v, kv_cache_layer, meta, self.scale)
        return self.o_proj(out.flatten(-2))


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [batch, seq, num_heads, d]; k, v: [batch, seq, num_kv_heads, d] -> like q."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)


class LlamaMLP(nn.Module):
    """SwiGLU (Shazeer, 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.fused_gate_up: FusedLinear | None = None  # set by `fuse_projections`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = None if self.fused_gate_up is None else self.fused_gate_up(x)
        gate, up = gate_up or (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); the MLP of a
    mixture-of-experts layer is a `SparseMoeBlock`.

    `forward_fused` is the same block with every residual add moved into the norm that
    follows it (vLLM's `fused_add_rms_norm`): it takes the residual stream and the previous
    layer's MLP output unadded and returns its own MLP output and the stream likewise, so
    the next layer's input norm, or the model's final one, does the add.
    """

    def __init__(self, config: ModelConfig, backend_name: str, layer_idx: int = 0) -> None:
        super().__init__()
        use_kernels = backend_name in KERNEL_BACKENDS
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, use_kernels)
        self.self_attn = LlamaAttention(config, backend_name)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, use_kernels
        )
        moe = config.is_moe_layer(layer_idx)
        self.mlp = SparseMoeBlock(config, layer_idx) if moe else LlamaMLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        kv_cache_layer: torch.Tensor | None,
        meta: AttentionMetadata | None,
    ) -> torch.Tensor:
        """The block's output x + attn + mlp, from its input x."""
        mlp_out, residual = self.forward_fused(x, None, rope, kv_cache_layer, meta)
        return residual + mlp_out

    def forward_fused(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache_layer: torch.Tensor | None,
        meta: AttentionMetadata | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (mlp_out, residual): the block's input is x + residual (x alone
        when residual is None, in the first layer); its output is mlp_out + residual."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual=residual)
        attn_out = self.self_attn(h, rope, kv_cache_layer, meta)
        h, residual = self.post_attention_layernorm(attn_out, residual=residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm: token ids -> hidden states."""

    def __init__(self, config: ModelConfig, backend_name: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend_name, i) for i in range(config.num_hidden_layers)
        )
        self.routing = attach_recorder(self)  # expert load and routing replay; None if dense
        self.use_kernels = backend_name in KERNEL_BACKENDS
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.use_kernels)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.config = config
        self.cos_sin_cache: torch.Tensor | None = None  # the RoPE kernel's table, made on use

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        meta: AttentionMetadata | None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.make_rope(positions, x.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            kv_cache_layer = None if kv_caches is None else kv_caches[i]
            x, residual = layer.forward_fused(x, residual, rope, kv_cache_layer, meta)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm(x, residual=residual)[0]

    def make_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The rotation every layer applies to its q and k at this batch's positions."""
        if self.use_kernels:
            from kernels.rope import apply_rope as rope_kernel
            from kernels.rope import rope_cos_sin_cache

            if self.cos_sin_cache is None or self.cos_sin_cache.device != positions.device:
                # float32 and outside the state_dict, like RotaryEmbedding's frequencies
                config = self.config
                self.cos_sin_cache = rope_cos_sin_cache(
                    rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling),
                    config.max_position_embeddings,
                    positions.device,
                )
            cache = self.cos_sin_cache
            return lambda q, k: rope_kernel(q, k, positions, cache)
        return TableRope(*rope_tables(*self.rotary_emb(positions, dtype)))


class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head that turns hidden states into next-token logits."""

    def __init__(self, config: ModelConfig, attention_backend: str = "torch") -> None:
        super().__init__()
        self.config = config
        self.attention_backend = attention_backend
        self.model = LlamaModel(config, attention_backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            # one Parameter under two names, as in transformers
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One flat batch through the paged KV cache.

        input_ids, positions: [num_tokens]; kv_caches: one [2, num_blocks, block_size,
        num_kv_heads, head_dim] tensor per layer -> hidden states [num_tokens, hidden_size].
        """
        if len(kv_caches) != self.config.num_hidden_layers:
            raise ValueError(
                f"expected one KV-cache tensor per layer ({self.config.num_hidden_layers}), "
                f"got {len(kv_caches)}"
            )
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden_size] -> logits [n, vocab_size] in float32."""
        return self.lm_head(hidden).float()

    def fuse_projections(self) -> None:
        """Give every layer one GEMM for q/k/v and one for gate/up (`FusedLinear`), where the
        projections are plain `nn.Linear` layers; quantized layers, and the experts of a
        mixture-of-experts layer, keep one GEMM each. Call it once the weights are loaded."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            if all(type(linear) is nn.Linear for linear in qkv):
                attn.fused_qkv = FusedLinear(attn, ["q_proj", "k_proj", "v_proj"])
            if isinstance(mlp, LlamaMLP) and all(
                type(linear) is nn.Linear for linear in (mlp.gate_proj, mlp.up_proj)
            ):
                mlp.fused_gate_up = FusedLinear(mlp, ["gate_proj", "up_proj"])

    def forward_causal(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain causal forward without a cache: input_ids [batch, seq] -> logits
        [batch, seq, vocab_size] float32. Every sequence starts at position 0."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.model(input_ids, positions, None, None)
        return self.compute_logits(hidden)
