"""Model configuration: the numbers that fix a Llama-family decoder's shape.

`ModelConfig` is read from a Hugging Face `config.json` and written back to one, so a
minillm checkpoint loads in `transformers` and a `transformers` checkpoint loads here.
"""

from __future__ import annotations

import json
import math
import numbers
import pathlib
from dataclasses import dataclass, field

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    # mixture-of-experts decoders (minillm.model.moe)
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# config.json keys without which a decoder's shape is unknown
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
# the sizes ModelConfig holds, each an int >= 1
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
# sizes index int32 tensors in the kernels, and no model comes near this
MAX_SIZE = 2**31 - 1
LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map "float32" | "bfloat16" | "float16" (or a torch dtype) to the torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; expected one of {sorted(DTYPES)}")
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def read_json(path: pathlib.Path) -> dict:
    """A model directory's JSON file, which must hold an object (config.json and its kin).

    Raises FileNotFoundError when it is missing, and one ValueError naming the file when it
    is not UTF-8, not JSON, or not a JSON object.
    """
    if not path.is_file():
        raise FileNotFoundError(f"expected {path.name} in {path.parent}")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def is_int(value: object) -> bool:
    """An integer, but not a bool (JSON's true is not a count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_id_list(value: object, name: str = "eos_token_id") -> list[int]:
    """A config's token id field, which may be absent, one id or a list, as a list.

    Raises ValueError (naming the field) for anything else, or for a negative id.
    """
    ids = [] if value is None else [value] if is_int(value) else value
    if not isinstance(ids, list) or not all(is_int(v) and v >= 0 for v in ids):
        raise ValueError(
            f"{name} must be null, a token id (an int >= 0) or a list of them, got {value!r}"
        )
    return [int(v) for v in ids]


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
    # mixture of experts (0 experts: a dense model); see minillm.model.moe
    num_experts: int = 0  # routed experts per MoE layer
    num_experts_per_tok: int = 0  # top-k: experts each token is sent to
    moe_intermediate_size: int = 0  # one expert's MLP width
    norm_topk_prob: bool = True  # renormalize the top-k router probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen2-MoE has one)
    mlp_only_layers: list[int] = field(default_factory=list)  # layers with a dense MLP
    decoder_sparse_step: int = 1  # every n-th layer is an MoE layer

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"expected one of {list(SUPPORTED_ARCHITECTURES)}"
            )
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if not (is_int(value) and 1 <= value <= MAX_SIZE):
                raise ValueError(f"{name} must be an int in [1, 2**31 - 1], got {value!r}")
            setattr(self, name, int(value))
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not _is_positive_number(value):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
            setattr(self, name, float(value))
        for name in ("tie_word_embeddings", "attention_bias", "qk_norm"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not (isinstance(self.torch_dtype, str) and self.torch_dtype in DTYPES):
            raise ValueError(
                f"torch_dtype must be one of {sorted(DTYPES)}, got {self.torch_dtype!r}"
            )
        self._check_rope_scaling()
        self._check_moe()
        # token ids index the embedding and the logits: an id >= vocab_size fails there
        if self.bos_token_id is not None and not (
            is_int(self.bos_token_id) and 0 <= self.bos_token_id < self.vocab_size
        ):
            raise ValueError(
                f"bos_token_id must be null or an int in [0, vocab_size={self.vocab_size}), "
                f"got {self.bos_token_id!r}"
            )
        self.eos_token_ids = as_id_list(self.eos_token_ids)
        out_of_vocab = [i for i in self.eos_token_ids if i >= self.vocab_size]
        if out_of_vocab:
            raise ValueError(
                f"eos_token_id must be ids in [0, vocab_size={self.vocab_size}), got {out_of_vocab}"
            )

    def _check_rope_scaling(self) -> None:
        """None, or llama3 scaling with its four numbers (rope.rope_inv_freq reads them)."""
        scaling = self.rope_scaling
        if scaling is None:
            return
        if not isinstance(scaling, dict) or scaling.get("rope_type") != "llama3":
            raise ValueError(
                f"unsupported rope_scaling {scaling!r}; expected None or "
                '{"rope_type": "llama3", ...}'
            )
        for key in LLAMA3_ROPE_KEYS:
            value = scaling.get(key)
            if not _is_positive_number(value):
                raise ValueError(
                    f"rope_scaling[{key!r}] must be a finite number > 0 for llama3 scaling, "
                    f"got {value!r}"
                )
        if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
            raise ValueError(
                "rope_scaling's high_freq_factor must be > its low_freq_factor, got "
                f"{scaling['high_freq_factor']!r} and {scaling['low_freq_factor']!r}"
            )

    def _check_moe(self) -> None:
        """Expert counts and widths: all set for an MoE architecture, all zero otherwise."""
        moe = self.architecture in MOE_ARCHITECTURES
        if not moe:
            if self.num_experts or self.num_experts_per_tok or self.moe_intermediate_size:
                raise ValueError(f"{self.architecture} has no experts; num_experts must be 0")
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if not (is_int(value) and 1 <= value <= MAX_SIZE):
                raise ValueError(f"{name} must be an int in [1, 2**31 - 1], got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts "
                f"({self.num_experts})"
            )
        value = self.shared_expert_intermediate_size
        if not (is_int(value) and 0 <= value <= MAX_SIZE):
            raise ValueError(f"shared_expert_intermediate_size must be an int >= 0, got {value!r}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob must be true or false, got {self.norm_topk_prob!r}")
        if not (is_int(self.decoder_sparse_step) and self.decoder_sparse_step >= 1):
            raise ValueError(
                f"decoder_sparse_step must be an int >= 1, got {self.decoder_sparse_step!r}"
            )
        layers = self.mlp_only_layers
        if not isinstance(layers, list) or not all(is_int(i) and i >= 0 for i in layers):
            raise ValueError(f"mlp_only_layers must be a list of layer indices, got {layers!r}")

    @property
    def is_moe(self) -> bool:
        return self.architecture in MOE_ARCHITECTURES

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` routes to experts (else it has a dense MLP), as
        transformers' Qwen2-/Qwen3-MoE decide it."""
        return (
            self.is_moe
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one key/value head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V one token occupies over all layers: 2 * layers * kv_heads * head_dim."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str | pathlib.Path = "config.json") -> ModelConfig:
        """Build from a parsed Hugging Face `config.json` (transformers 4.x or 5.x layout).

        Every problem raises one ValueError that starts with `source` (the file's path when
        the loader reads one) and names the key.
        """
        try:
            return cls._from_hf_config(cfg)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None

    @classmethod
    def _from_hf_config(cls, cfg: dict) -> ModelConfig:
        if not isinstance(cfg, dict):
            raise ValueError(f"expected a JSON object, got {type(cfg).__name__}")
        architectures = cfg.get("architectures") or []
        if not isinstance(architectures, list) or len(architectures) != 1:
            raise ValueError(
                f"'architectures' must name exactly one architecture, "
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
        if cfg.get("mlp_bias", False) is not False:
            raise ValueError(
                f"mlp_bias={cfg['mlp_bias']!r} is not supported; expected MLP projections "
                "without bias"
            )
        missing = [key for key in REQUIRED_KEYS if key not in cfg]
        if missing:
            raise ValueError(f"required keys are missing: {missing}")

        # transformers 5 folds rope_theta and rope_scaling into one rope_parameters dict.
        rope_key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
        rope = cfg.get(rope_key) or {}
        if not isinstance(rope, dict):
            raise ValueError(f"{rope_key} must be null or a JSON object, got {rope!r}")
        rope = dict(rope)
        rope_theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type == "default" else rope
        if rope_scaling is not None:
            rope_scaling["rope_type"] = rope_type
            rope_scaling.pop("type", None)

        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            hidden_size = cfg["hidden_size"]
            for name, value in (("hidden_size", hidden_size), ("num_attention_heads", num_heads)):
                if not (is_int(value) and 1 <= value <= MAX_SIZE):
                    raise ValueError(f"{name} must be an int in [1, 2**31 - 1], got {value!r}")
            head_dim = hidden_size // num_heads
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        moe = {}
        if architecture in MOE_ARCHITECTURES:
            moe = _moe_fields(architecture, cfg)
        if architecture == "Qwen2MoeForCausalLM":
            attention_bias = cfg.get("qkv_bias", True)
        else:
            # Qwen2's config has no attention_bias key: its q/k/v projections always have one.
            attention_bias = cfg.get("attention_bias", architecture == "Qwen2ForCausalLM")
        return cls(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=attention_bias,
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=as_id_list(cfg.get("eos_token_id")),
            torch_dtype=dtype,
            **moe,
        )

    def to_hf_config(self) -> dict:
        """The `config.json` dict that `transformers` (4.45+ and 5.x) loads as this model."""
        if self.qk_norm != (self.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")):
            raise ValueError(
                "qk_norm is only expressible in config.json as Qwen3ForCausalLM or "
                "Qwen3MoeForCausalLM"
            )
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
        if self.architecture == "Qwen2MoeForCausalLM":
            cfg["qkv_bias"] = self.attention_bias
        elif self.architecture != "Qwen2ForCausalLM":
            cfg["attention_bias"] = self.attention_bias
        if self.is_moe:
            cfg.update(_moe_hf_fields(self))
        return cfg


def _moe_fields(architecture: str, cfg: dict) -> dict:
    """The expert fields of an MoE config.json: Mixtral names its expert count
    num_local_experts and always renormalizes the top-k; Qwen-MoE names it num_experts and
    gives each expert moe_intermediate_size."""
    if architecture == "MixtralForCausalLM":
        for key in ("num_local_experts", "num_experts_per_tok"):
            if key not in cfg:
                raise ValueError(f"required keys are missing: [{key!r}]")
        return {
            "num_experts": cfg["num_local_experts"],
            "num_experts_per_tok": cfg["num_experts_per_tok"],
            "moe_intermediate_size": cfg["intermediate_size"],
            "norm_topk_prob": True,
        }
    missing = [key for key in ("num_experts_per_tok", "moe_intermediate_size") if key not in cfg]
    if "num_experts" not in cfg and "num_local_experts" not in cfg:
        missing.insert(0, "num_experts")
    if missing:
        raise ValueError(f"required keys are missing: {missing}")
    fields = {
        "num_experts": cfg.get("num_experts", cfg.get("num_local_experts")),
        "num_experts_per_tok": cfg["num_experts_per_tok"],
        "moe_intermediate_size": cfg["moe_intermediate_size"],
        "norm_topk_prob": cfg.get("norm_topk_prob", False),
        "mlp_only_layers": cfg.get("mlp_only_layers") or [],
        "decoder_sparse_step": cfg.get("decoder_sparse_step", 1),
    }
    if architecture == "Qwen2MoeForCausalLM":
        fields["shared_expert_intermediate_size"] = cfg.get("shared_expert_intermediate_size", 0)
    return fields


def _moe_hf_fields(config: ModelConfig) -> dict:
    """The inverse of _moe_fields."""
    if config.architecture == "MixtralForCausalLM":
        if config.moe_intermediate_size != config.intermediate_size or not config.norm_topk_prob:
            raise ValueError(
                "MixtralForCausalLM's experts are intermediate_size wide and renormalize the "
                "top-k probabilities"
            )
        return {
            "num_local_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
        }
    fields = {
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "norm_topk_prob": config.norm_topk_prob,
        "mlp_only_layers": list(config.mlp_only_layers),
        "decoder_sparse_step": config.decoder_sparse_step,
    }
    if config.architecture == "Qwen2MoeForCausalLM":
        fields["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    return fields


def _is_positive_number(value: object) -> bool:
    """A real number (not a bool) > 0 that is finite as a float."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value)) and value > 0
    except OverflowError:  # an int beyond float's range
        return False
