"""Pre-quantized Hugging Face checkpoints in the public GPTQ and AWQ layouts.

Both store, for each quantized linear layer `<name>` (W: [N, K], groups of g input channels,
G = K / g), 4-bit codes q in [0, 15] packed eight to an int32 (lowest nibble first), float16
scales s and zero points z, with w = s * (q - z), in `model.safetensors`; `config.json`
carries a `quantization_config`. They differ in the packing:

GPTQ (AutoGPTQ, GPTQModel; `quant_method: "gptq"`):
  <name>.qweight  int32 [K / 8, N]  packed along the input dim: nibble j of row r is
                                    q[k = 8 r + j, n]
  <name>.qzeros   int32 [G, N / 8]  packed along the output dim, in order; the "gptq"
                                    checkpoint_format (v1, the default) stores z - 1,
                                    "gptq_v2" stores z
  <name>.scales   float16 [G, N]
  <name>.g_idx    int32 [K]         the group of each input channel: k // g, or with
                                    act-order (desc_act) the group in quantization order
  config: bits, group_size (-1: one group), desc_act, sym, checkpoint_format

AWQ (AutoAWQ "gemm" version; `quant_method: "awq"`):
  <name>.qweight  int32 [K, N / 8]  packed along the output dim, interleaved: nibble i of
                                    column c is q[k, n = 8 c + [0, 2, 4, 6, 1, 3, 5, 7][i]]
  <name>.qzeros   int32 [G, N / 8]  the same interleaved packing, z stored as is
  <name>.scales   float16 [G, N]
  config: bits (or w_bit), group_size (or q_group_size), zero_point, version

Checked against AutoGPTQ's `QuantLinear.pack` (qlinear_cuda_old: `zeros -= 1`, rows of 32 /
bits codes along K), vLLM's `GPTQLinearMethod` (qweight [K / pack, N], qzeros [G, N / pack],
scales [G, N], zeros + 1 when dequantizing v1) and AutoAWQ's `WQLinear_GEMM.from_linear`
(qweight [K, N / 8], order_map [0, 2, 4, 6, 1, 3, 5, 7] for weights and zeros).
A bias, where a layer has one, is stored as `<name>.bias`.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import safetensors.torch
import torch
from torch import nn

from minillm.model.quantization.linear import Int4Linear, linear_layers
from minillm.model.quantization.quantize import LINEAR_NAMES, set_submodule

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column 8c + AWQ_ORDER[i] goes to nibble i
FORMATS = ("gptq", "awq")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def pack_nibbles(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, C] integers in [0, 15], C a multiple of 8 -> [R, C / 8] int32: nibble i of word
    c holds values[:, 8 c + order[i]]."""
    r, c = values.shape
    if c % 8:
        raise ValueError(f"cannot pack {c} columns eight to an int32")
    if values.numel() and (values.min() < 0 or values.max() > 15):
        raise ValueError("packed values must lie in [0, 15]")
    v = values.to(torch.int64).view(r, c // 8, 8)[:, :, list(order)]
    words = (v << (4 * torch.arange(8))).sum(dim=2)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_nibbles(words: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """The inverse of `pack_nibbles`: [R, C / 8] int32 -> [R, C] int32."""
    r, c8 = words.shape
    nibbles = (words.to(torch.int64)[:, :, None] >> (4 * torch.arange(8))) & 0xF
    values = torch.empty_like(nibbles)
    values[:, :, list(order)] = nibbles
    return values.view(r, c8 * 8).to(torch.int32)


def gptq_tensors(layer: Int4Linear, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """One layer in the GPTQ layout (qweight, qzeros, scales, g_idx)."""
    k = layer.in_features
    codes, zeros = layer.codes(), layer.zeros()  # codes in stored (input_perm) order
    g_idx = torch.arange(k, dtype=torch.int32) // layer.group_size
    if layer.input_perm is not None:  # stored column j is input channel input_perm[j]
        codes = torch.empty_like(codes).index_copy_(1, layer.input_perm, codes)
        g_idx = torch.empty_like(g_idx).index_copy_(0, layer.input_perm, g_idx)
    if checkpoint_format == "gptq":
        if (zeros == 0).any():
            raise ValueError(
                "a zero point of 0 cannot be stored as z - 1 in the 'gptq' (v1) format; "
                "write checkpoint_format='gptq_v2'"
            )
        zeros = zeros - 1
    return {
        "qweight": pack_nibbles(codes).T.contiguous(),
        "qzeros": pack_nibbles(zeros.T.contiguous()),
        "scales": layer.scales.to(torch.float16).contiguous(),  # [G, N] already
        "g_idx": g_idx,
    }


def awq_tensors(layer: Int4Linear) -> dict[str, torch.Tensor]:
    """One layer in AutoAWQ's GEMM layout (qweight, qzeros, scales)."""
    if layer.input_perm is not None:
        raise ValueError("the AWQ layout has no input permutation (act-order)")
    return {
        "qweight": pack_nibbles(layer.codes().T.contiguous(), AWQ_ORDER),
        "qzeros": pack_nibbles(layer.zeros().T.contiguous(), AWQ_ORDER),
        "scales": layer.scales.to(torch.float16).contiguous(),  # [G, N] already
    }


def save_quantized(
    model: nn.Module,
    config,
    source_dir: str | pathlib.Path,
    out_dir: str | pathlib.Path,
    checkpoint_format: str = "gptq",
) -> pathlib.Path:
    """Write a model whose decoder linears are all `Int4Linear` as a GPTQ ("gptq" or
    "gptq_v2") or AWQ ("awq") checkpoint directory; tokenizer and generation config are
    copied from `source_dir`. config: the model's `ModelConfig`."""
    if checkpoint_format not in ("gptq", "gptq_v2", "awq"):
        raise ValueError(f"checkpoint_format must be gptq, gptq_v2 or awq, got {checkpoint_format}")
    layers = linear_layers(model)
    expected = {
        f"model.layers.{i}.{name}" for i in range(len(model.model.layers)) for name in LINEAR_NAMES
    }
    if set(layers) != expected or not all(isinstance(m, Int4Linear) for m in layers.values()):
        raise ValueError("every decoder linear must be an Int4Linear (quantization='int4')")
    group_sizes = {m.group_size for m in layers.values()}
    if len(group_sizes) != 1:
        raise ValueError(f"expected one group size for the whole model, got {group_sizes}")
    state = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    float_dtype = next(iter(state.values())).dtype
    for name, layer in layers.items():
        tensors = (
            awq_tensors(layer)
            if checkpoint_format == "awq"
            else gptq_tensors(layer, checkpoint_format)
        )
        if layer.bias is not None:
            tensors["bias"] = layer.bias
        state.update({f"{name}.{key}": t.contiguous().cpu() for key, t in tensors.items()})

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_config = config.to_hf_config()
    hf_config["torch_dtype"] = str(float_dtype).removeprefix("torch.")
    hf_config["quantization_config"] = quantization_config(
        checkpoint_format, group_sizes.pop(), layers.values()
    )
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    safetensors.torch.save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (pathlib.Path(source_dir) / name).is_file():
            shutil.copyfile(pathlib.Path(source_dir) / name, out / name)
    return out


def quantization_config(checkpoint_format: str, group_size: int, layers) -> dict:
    """config.json's `quantization_config` for the layers being written."""
    if checkpoint_format == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": any(m.input_perm is not None for m in layers),
        "sym": all(m.zero_points is None for m in layers),
        "checkpoint_format": checkpoint_format,
        "lm_head": False,
    }


def read_quantization_config(cfg: dict) -> tuple[str, int, str]:
    """(method, group_size or -1, zeros convention) from a `quantization_config`; raises
    ValueError for what this loader does not read."""
    if not isinstance(cfg, dict):
        raise ValueError(f"quantization_config must be a JSON object, got {cfg!r}")
    method = str(cfg.get("quant_method", "")).lower()
    if method == "gptq":
        bits, group_size = cfg.get("bits"), cfg.get("group_size")
        zeros = cfg.get("checkpoint_format", "gptq")
        if zeros not in ("gptq", "gptq_v2"):
            raise ValueError(f"unsupported GPTQ checkpoint_format {zeros!r}")
        if cfg.get("lm_head"):
            raise ValueError("GPTQ checkpoints with a quantized lm_head are not supported")
    elif method == "awq":
        bits = cfg.get("bits", cfg.get("w_bit"))
        group_size = cfg.get("group_size", cfg.get("q_group_size"))
        zeros = "awq"
        if cfg.get("version", "gemm").lower() != "gemm":
            raise ValueError(f"only AWQ's 'gemm' layout is supported, got {cfg.get('version')!r}")
        if not cfg.get("zero_point", True):
            raise ValueError("AWQ checkpoints without zero points are not supported")
    else:
        raise ValueError(f"unsupported quant_method {method!r}; expected 'gptq' or 'awq'")
    if bits != 4:
        raise ValueError(f"only 4-bit {method.upper()} checkpoints are supported, got {bits}")
    if not isinstance(group_size, int) or (group_size < 1 and group_size != -1):
        raise ValueError(f"invalid group_size {group_size!r} in quantization_config")
    return method, group_size, zeros


def load_quantized_linears(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    quantization_config: dict,
    dtype: torch.dtype,
    device: str | torch.device,
) -> dict[str, torch.Tensor]:
    """Replace the model's decoder linears by `Int4Linear`s read from a GPTQ or AWQ state
    dict; returns the rest of the state dict (embeddings, norms, LM head) for the ordinary
    loading path. The model may live on the meta device."""
    method, group_size, zeros_format = read_quantization_config(quantization_config)
    state = dict(state)
    for i, layer in enumerate(model.model.layers):
        for name in LINEAR_NAMES:
            prefix = f"model.layers.{i}.{name}"
            linear = layer.get_submodule(name)
            keys = ["qweight", "qzeros", "scales"] + (["g_idx"] if method == "gptq" else [])
            missing = [f"{prefix}.{key}" for key in keys if f"{prefix}.{key}" not in state]
            if missing:
                raise ValueError(f"the {method.upper()} checkpoint lacks {missing}")
            tensors = {key: state.pop(f"{prefix}.{key}") for key in keys}
            bias = state.pop(f"{prefix}.bias", None)
            if (bias is not None) != (linear.bias is not None):
                raise ValueError(f"{prefix}: bias present in only one of config and checkpoint")
            module = read_layer(
                method,
                tensors,
                linear.in_features,
                linear.out_features,
                group_size,
                zeros_format,
                bias,
                dtype,
                prefix,
            )
            set_submodule(layer, name, module.to(device))
    return state


def read_layer(
    method: str,
    tensors: dict[str, torch.Tensor],
    k: int,
    n: int,
    group_size: int,
    zeros_format: str,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    prefix: str,
) -> Int4Linear:
    """One Int4Linear from its checkpoint tensors, shapes checked against [N, K]."""
    g = k if group_size == -1 else group_size
    if k % g or n % 8 or k % 8:
        raise ValueError(f"{prefix}: [{n}, {k}] does not fit groups of {g} and int32 packing")
    if method == "gptq":
        shapes = {
            "qweight": (k // 8, n),
            "qzeros": (k // g, n // 8),
            "scales": (k // g, n),
            "g_idx": (k,),
        }
    else:
        shapes = {"qweight": (k, n // 8), "qzeros": (k // g, n // 8), "scales": (k // g, n)}
    for key, shape in shapes.items():
        if tuple(tensors[key].shape) != shape:
            raise ValueError(
                f"{prefix}.{key} has shape {list(tensors[key].shape)}, expected {list(shape)}"
            )
    if method == "gptq":
        codes = unpack_nibbles(tensors["qweight"].T.contiguous())
        zeros = unpack_nibbles(tensors["qzeros"]).T + (1 if zeros_format == "gptq" else 0)
    else:
        codes = unpack_nibbles(tensors["qweight"], AWQ_ORDER).T
        zeros = unpack_nibbles(tensors["qzeros"], AWQ_ORDER).T
    if zeros.numel() and (zeros.min() < 0 or zeros.max() > 15):
        raise ValueError(f"{prefix}.qzeros holds zero points outside [0, 15]")
    perm = None
    if method == "gptq":
        g_idx = tensors["g_idx"].to(torch.int64)
        if not torch.equal(g_idx, torch.arange(k) // g):
            if g_idx.min() < 0 or g_idx.max() >= k // g or (g_idx.bincount() != g).any():
                raise ValueError(f"{prefix}.g_idx must give every group {g} input channels")
            perm = torch.argsort(g_idx, stable=True)  # groups contiguous in stored order
            codes = codes[:, perm]
    symmetric = bool((zeros == 8).all())
    return Int4Linear(
        codes.contiguous(),
        tensors["scales"].T.float(),
        None if symmetric else zeros.contiguous(),
        g,
        bias,
        dtype,
        perm,
    )
