"""Multi-LoRA serving: adapters in PEFT's file layout, beside the base weights, per row.

A LoRA adapter (Hu et al., 2021) adds a low-rank update to some of the model's linear layers:
for a layer y = W x it holds A [r, in] and B [out, r], and the adapted layer computes
y = W x + scale * B (A x), scale = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA).
Merging W + scale * B A gives the same layer; serving several adapters at once instead keeps
W shared and adds each row's own low-rank term, so one batch mixes requests on different
adapters and on the base model.

`LoRAManager` hooks every LoRA-capable linear of a `LlamaForCausalLM` (q/k/v/o_proj,
gate/up/down_proj). Before a forward the model runner tells it which adapter each token's row
uses (`set_active`); the hook of a layer then gathers the rows of each adapter present in the
batch, computes (x A^T) B^T for them and adds it back at those rows (`index_add`). That loop
over adapters is the plain-PyTorch equivalent of Punica's SGMV/BGMV kernels (segmented and
batched gather matrix-vector products, which vLLM and S-LoRA run on a GPU); rows without an
adapter are left as the base layer computed them. The parameter names do not change, so the
base checkpoint still loads and saves as before.

Files: `adapter_config.json` (r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` with tensors named
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` / `...lora_B.weight`, the names
PEFT's `save_pretrained` writes for a Llama model. `save_lora_adapter` writes that layout.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
from dataclasses import dataclass

import safetensors.torch
import torch
from torch import nn

from minillm.lora.request import LoRARequest

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# the linear layers of a decoder layer an adapter may target (vLLM's Llama list, unpacked)
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter as loaded: per module name, A [r, in] and B [out, r], and its scale."""

    lora_name: str
    lora_int_id: int
    path: pathlib.Path
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter_config(path: pathlib.Path) -> dict:
    """adapter_config.json, checked for what this engine serves."""
    config_file = path / ADAPTER_CONFIG_FILE
    if not path.is_dir() or not config_file.is_file():
        raise ValueError(
            f"lora_path {str(path)!r} is not a LoRA adapter directory: expected "
            f"{ADAPTER_CONFIG_FILE} and {ADAPTER_WEIGHTS_FILE} in it"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"adapter {str(path)!r}: cannot read {ADAPTER_CONFIG_FILE}: {err}"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"adapter {str(path)!r}: {ADAPTER_CONFIG_FILE} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"adapter {str(path)!r}: peft_type must be 'LORA', got {peft_type!r}")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"adapter {str(path)!r}: r must be an int >= 1, got {rank!r}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise ValueError(f"adapter {str(path)!r}: lora_alpha must be a number, got {alpha!r}")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") not in ("none", None),
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    for key, present in unsupported.items():
        if present:
            raise ValueError(
                f"adapter {str(path)!r}: {key}={config[key]!r} is not supported; only plain "
                "LoRA on linear layers is served"
            )
    return config


def load_lora_adapter(lora_request: LoRARequest) -> LoRAAdapter:
    """Read a PEFT LoRA directory into float32 tensors (checked against its config)."""
    path = pathlib.Path(lora_request.lora_path).expanduser()
    config = read_adapter_config(path)
    weights_file = path / ADAPTER_WEIGHTS_FILE
    if not weights_file.is_file():
        raise ValueError(f"adapter {str(path)!r} has no {ADAPTER_WEIGHTS_FILE}")
    try:
        tensors = safetensors.torch.load_file(str(weights_file))
    except Exception as err:  # noqa: BLE001 - the library's errors for a corrupt file vary
        raise ValueError(
            f"adapter {str(path)!r}: cannot read {ADAPTER_WEIGHTS_FILE}: {type(err).__name__}: "
            f"{err}"
        ) from None
    rank = config["r"]
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise ValueError(
                f"adapter {str(path)!r}: tensor {name!r} is not named "
                f"{PEFT_PREFIX}<module>.lora_A.weight or .lora_B.weight"
            )
        halves.setdefault(match["module"], {})[match["ab"]] = tensor.float()
    weights = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {str(path)!r}: {module} needs both lora_A and lora_B")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(
                f"adapter {str(path)!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; expected [r, in] and [out, r] with r={rank}"
            )
        weights[module] = (a, b)
    if not weights:
        raise ValueError(f"adapter {str(path)!r} holds no LoRA weights")
    alpha = config.get("lora_alpha", 8)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoRAAdapter(
        lora_request.lora_name, lora_request.lora_int_id, path, rank, scaling, weights
    )


def save_lora_adapter(
    path: str | os.PathLike,
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
    lora_alpha: float,
    base_model_name_or_path: str | None = None,
) -> pathlib.Path:
    """Write an adapter in PEFT's layout: weights maps a module name
    ("model.layers.0.self_attn.q_proj") to (A [r, in], B [out, r]), all of one rank r."""
    ranks = {a.shape[0] for a, _ in weights.values()}
    if len(ranks) != 1:
        raise ValueError(f"every module of an adapter needs the same rank, got {sorted(ranks)}")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    targets = sorted({name.rsplit(".", 1)[-1] for name in weights})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": ranks.pop(),
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    (path / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2))
    tensors = {}
    for module, (a, b) in weights.items():
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.contiguous()
    safetensors.torch.save_file(tensors, str(path / ADAPTER_WEIGHTS_FILE))
    return path


class LoRASlotsBusy(ValueError):
    """Every loaded adapter is needed by an unfinished request: a new one can be loaded only
    once one of them is done. Not the adapter's fault: retry later (`LLM.generate` holds
    such requests back and adds them as adapters free up; the server answers 503 with
    Retry-After)."""


class LoRAManager:
    """Adapters of rank <= `max_lora_rank` beside one model, applied per row.

    Adapters are loaded on first use (`add_lora`) and kept, up to `max_cpu_loras` of them
    (vLLM's name; by default `max_loras`, the most one batch uses, which the scheduler
    enforces). A new adapter beyond that evicts the least recently used one that no
    unfinished request needs; when every loaded adapter is needed, it is refused with
    LoRASlotsBusy. Per forward, `set_active` gives each token row its adapter id (0: none).
    """

    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int | None = None,
    ) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        # in order of last use, least recent first
        self.adapters: dict[int, LoRAAdapter] = {}
        self.modules: dict[str, nn.Linear] = {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in LORA_TARGET_MODULES
        }
        # per module: lora_int_id -> (A [r, in], scale * B [out, r]) in the layer's dtype
        self.weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {
            name: {} for name in self.modules
        }
        # the forward in flight: (lora_int_id, rows of that adapter) per adapter in the batch
        self.groups: list[tuple[int, torch.Tensor]] = []
        self.handles = [
            module.register_forward_hook(self._hook(name)) for name, module in self.modules.items()
        ]

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def add_lora(
        self, lora_request: LoRARequest, in_use: set[int] | frozenset[int] = frozenset()
    ) -> LoRAAdapter:
        """Load the adapter unless it is loaded; ValueError when it cannot be served,
        LoRASlotsBusy (a ValueError) when it can but every loaded one is in use.

        `in_use`: the adapter ids unfinished requests need, which are never evicted."""
        adapter = self.check_lora(lora_request)
        if adapter.lora_int_id in self.adapters:
            self.adapters[adapter.lora_int_id] = self.adapters.pop(adapter.lora_int_id)  # used
            return adapter
        if len(self.adapters) >= self.max_cpu_loras:
            idle = [lora_id for lora_id in self.adapters if lora_id not in in_use]
            if not idle:
                raise LoRASlotsBusy(
                    f"cannot load adapter {lora_request.lora_name!r} now: all "
                    f"max_cpu_loras={self.max_cpu_loras} loaded adapters "
                    f"({', '.join(sorted(repr(a.lora_name) for a in self.adapters.values()))}) "
                    "are used by unfinished requests; it can be loaded once one of those "
                    "finishes (LLM.generate waits for that by itself), or raise max_cpu_loras"
                )
            self.remove_lora(idle[0])  # the least recently used
        weight = next(iter(self.modules.values())).weight
        for name, (a, b) in adapter.weights.items():
            self.weights[name][adapter.lora_int_id] = (
                a.to(weight.device, weight.dtype),
                (adapter.scaling * b).to(weight.device, weight.dtype),
            )
        self.adapters[adapter.lora_int_id] = adapter
        return adapter

    def check_lora(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The adapter, loaded and checked but not kept (the loaded one if it is loaded);
        ValueError when it cannot be served: not a LoRARequest, its id taken by another
        adapter, a rank above max_lora_rank, a layer this model does not have."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be a LoRARequest, got {type(lora_request).__name__}"
            )
        loaded = self.adapters.get(lora_request.lora_int_id)
        if loaded is not None:
            same = (
                loaded.lora_name == lora_request.lora_name
                and loaded.path == pathlib.Path(lora_request.lora_path).expanduser()
            )
            if not same:
                raise ValueError(
                    f"lora_int_id {lora_request.lora_int_id} is already adapter "
                    f"{loaded.lora_name!r} from {str(loaded.path)!r}"
                )
            return loaded
        adapter = load_lora_adapter(lora_request)
        if adapter.rank > self.max_lora_rank:
            raise ValueError(
                f"adapter {lora_request.lora_name!r} has rank {adapter.rank}, above "
                f"max_lora_rank={self.max_lora_rank}"
            )
        for name, (a, b) in adapter.weights.items():
            module = self.modules.get(name)
            if module is None:
                raise ValueError(
                    f"adapter {lora_request.lora_name!r} targets {name!r}, which is not a "
                    f"LoRA-capable linear layer of this model ({', '.join(LORA_TARGET_MODULES)})"
                )
            if a.shape[1] != module.in_features or b.shape[0] != module.out_features:
                raise ValueError(
                    f"adapter {lora_request.lora_name!r}: {name} expects lora_A [r, "
                    f"{module.in_features}] and lora_B [{module.out_features}, r], got "
                    f"{tuple(a.shape)} and {tuple(b.shape)}"
                )
        return adapter

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; False if it was not loaded."""
        if self.adapters.pop(lora_int_id, None) is None:
            return False
        for per_module in self.weights.values():
            per_module.pop(lora_int_id, None)
        return True

    def set_active(self, token_lora_ids: list[int], device: torch.device) -> None:
        """The next forward's rows: token_lora_ids[i] is row i's adapter id, 0 for none."""
        rows: dict[int, list[int]] = {}
        for row, lora_id in enumerate(token_lora_ids):
            if lora_id:
                rows.setdefault(lora_id, []).append(row)
        for lora_id in rows:
            if lora_id not in self.adapters:
                raise ValueError(f"adapter id {lora_id} is not loaded")
        self.groups = [
            (lora_id, torch.tensor(indices, dtype=torch.int64, device=device))
            for lora_id, indices in rows.items()
        ]

    def clear(self) -> None:
        self.groups = []

    def _hook(self, name: str):
        per_module = self.weights[name]

        def add_lora_rows(module: nn.Module, args: tuple, output: torch.Tensor):
            if not self.groups:
                return None
            x = args[0].reshape(-1, module.in_features)
            out = output.reshape(-1, module.out_features)
            for lora_id, rows in self.groups:
                pair = per_module.get(lora_id)
                if pair is None:
                    continue  # this adapter leaves this layer alone
                a, b = pair
                out = out.index_add(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
            return out.view(output.shape)

        return add_lora_rows
