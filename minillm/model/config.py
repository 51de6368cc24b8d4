"""Model configuration: the numbers that fix a Llama-family decoder's shape.

`ModelConfig` is read from a Hugging Face `config.json` and written back to one, so a
minillm checkpoint loads in `transformers` and a `transformers` checkpoint loads here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map "float32" | "bfloat16" | "float16" (or a torch dtype) to the torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; expected one of {sorted(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def as_id_list(value: int | list[int] | None) -> list[int]:
    """A config's token id field, which may be absent, one id or a list, as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


@dataclass(slots=True)
class ModelConfig:
    architecture: str  # "LlamaForCausalLM" | "Qwen2ForCausalLM" | "Qwen3ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # config["head_dim"] or hidden_size // num_attention_heads
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # HF dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: q/k/v projections have a bias
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"  # "float32" | "bfloat16" | "float16"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"expected one of {list(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        torch_dtype(self.torch_dtype)
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") != "llama3":
            raise ValueError(
                f"unsupported rope_scaling {self.rope_scaling!r}; expected None or "
                '{"rope_type": "llama3", ...}'
            )

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one key/value head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V one token occupies over all layers: 2 * layers * kv_heads * head_dim."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelConfig:
        """Build from a parsed Hugging Face `config.json` (transformers 4.x or 5.x layout)."""
        architectures = cfg.get("architectures") or []
        if len(architectures) != 1:
            raise ValueError(
                f"config.json must name exactly one architecture in 'architectures', "
                f"got {architectures!r}; expected one of {list(SUPPORTED_ARCHITECTURES)}"
            )
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture!r}; "
                f"expected one of {list(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; expected 'silu'")
        if cfg.get("mlp_bias", False):
            raise ValueError(
                "mlp_bias=true is not supported; expected MLP projections without bias"
            )

        # transformers 5 folds rope_theta and rope_scaling into one rope_parameters dict.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type == "default" else rope
        if rope_scaling is not None:
            rope_scaling["rope_type"] = rope_type
            rope_scaling.pop("type", None)

        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2's config has no attention_bias key: its q/k/v projections always have one.
            attention_bias=bool(cfg.get("attention_bias", architecture == "Qwen2ForCausalLM")),
            qk_norm=architecture == "Qwen3ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=as_id_list(cfg.get("eos_token_id")),
            torch_dtype=dtype,
        )

    def to_hf_config(self) -> dict:
        """The `config.json` dict that `transformers` (4.45+ and 5.x) loads as this model."""
        if self.qk_norm != (self.architecture == "Qwen3ForCausalLM"):
            raise ValueError("qk_norm is only expressible in config.json as Qwen3ForCausalLM")
        if self.architecture == "Qwen2ForCausalLM" and not self.attention_bias:
            raise ValueError("Qwen2ForCausalLM always has a q/k/v bias; set attention_bias=True")
        eos: int | list[int] | None = self.eos_token_ids or None
        if eos is not None and len(eos) == 1:
            eos = eos[0]
        cfg = {
            "architectures": [self.architecture],
            "model_type": MODEL_TYPES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": self.torch_dtype,
        }
        if self.architecture != "Qwen2ForCausalLM":
            cfg["attention_bias"] = self.attention_bias
        return cfg
