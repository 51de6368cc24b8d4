"""Hugging Face-format model directories: find one, load it, write one.

A model directory holds `config.json`, the weights as `model.safetensors` (or shards
listed in `model.safetensors.index.json`), `tokenizer.json` (+ `tokenizer_config.json`)
and optionally `generation_config.json`: the layout `transformers` reads and writes, so the
bundled models, checkpoints from the Hub and models we train all load the same way.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from dataclasses import dataclass, field

import safetensors
import safetensors.torch
import tokenizers
import torch

from minillm.model.config import ModelConfig, as_id_list, read_json, torch_dtype
from minillm.model.llama import LlamaForCausalLM
from minillm.model.moe import rename_checkpoint_tensors
from minillm.model.tokenizer import Tokenizer

BUNDLED_MODELS_DIR = pathlib.Path(__file__).parent.parent / "bundled"
DEFAULT_MODEL = "minillm-stdlib-target"

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
# Computed from the config at run time; some older checkpoints still store it.
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM | None  # None when loaded with weights=False
    config: ModelConfig
    tokenizer: Tokenizer
    generation_config: dict
    path: pathlib.Path
    eos_token_ids: list[int] = field(default_factory=list)  # config's and generation config's


def resolve_model_path(model: str | os.PathLike) -> pathlib.Path:
    """A local directory, else a bundled model's name, else a Hugging Face Hub repo id."""
    if not isinstance(model, str | os.PathLike) or not str(model).strip():
        raise ValueError(
            "model must be a model directory, a bundled model's name or a Hugging Face Hub "
            f"repo id, got {model!r}"
        )
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        return path
    bundled = BUNDLED_MODELS_DIR / str(model)
    if bundled.is_dir():
        return bundled
    bundled_names = (
        sorted(p.name for p in BUNDLED_MODELS_DIR.iterdir() if p.is_dir())
        if BUNDLED_MODELS_DIR.is_dir()
        else []
    )
    hint = (
        f"{str(model)!r} is not a local directory, nor a bundled model ({bundled_names}); "
        "pass a local directory holding config.json, *.safetensors and tokenizer.json"
    )
    if path.exists() or str(model).startswith((".", "/", "~")):
        raise FileNotFoundError(hint)
    try:
        from huggingface_hub import snapshot_download
    except ImportError as err:
        raise FileNotFoundError(
            f"{hint}, or install huggingface_hub to fetch it from the Hugging Face Hub"
        ) from err
    try:
        snapshot = snapshot_download(
            str(model), allow_patterns=["*.json", "*.safetensors", "tokenizer*"]
        )
    except (OSError, ValueError) as err:  # offline, unknown repo, invalid repo id
        raise FileNotFoundError(
            f"{hint}; fetching it from the Hugging Face Hub failed: {err}"
        ) from err
    return pathlib.Path(snapshot)


def load_safetensors_file(file: pathlib.Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, on the CPU; one ValueError naming it if corrupt."""
    try:
        return safetensors.torch.load_file(file)
    except (safetensors.SafetensorError, OSError) as err:
        raise ValueError(f"{file} is not a valid safetensors file: {err}") from None


def load_safetensors(path: pathlib.Path) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors`, or of the shards its index lists, on the CPU."""
    if (path / SAFETENSORS_FILE).is_file():
        return load_safetensors_file(path / SAFETENSORS_FILE)
    index_file = path / SAFETENSORS_INDEX_FILE
    if not index_file.is_file():
        raise FileNotFoundError(
            f"expected {SAFETENSORS_FILE} or {SAFETENSORS_INDEX_FILE} with its shards in {path}"
        )
    weight_map = read_json(index_file).get("weight_map")
    if not (
        isinstance(weight_map, dict)
        and weight_map
        and all(isinstance(shard, str) for shard in weight_map.values())
    ):
        raise ValueError(
            f"{index_file}: weight_map must be a non-empty object of tensor name -> shard file, "
            f"got {weight_map!r:.200}"
        )
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        shard_file = path / shard
        if shard_file.parent != path:
            raise ValueError(f"{index_file}: shard {shard!r} is not a file name in {path}")
        if not shard_file.is_file():
            raise FileNotFoundError(f"shard {shard} listed in {SAFETENSORS_INDEX_FILE} is missing")
        state.update(load_safetensors_file(shard_file))
    return state


def weights_source(path: pathlib.Path) -> pathlib.Path:
    """The file that names a directory's weights: model.safetensors, or the shards' index."""
    single = path / SAFETENSORS_FILE
    return single if single.is_file() else path / SAFETENSORS_INDEX_FILE


def check_state_dict(
    model: LlamaForCausalLM, state: dict[str, torch.Tensor], source: pathlib.Path
) -> None:
    """Raise ValueError unless `state` has exactly the model's tensors, with its shapes."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")  # the embedding matrix, stored once
    for name, shape in expected.items():  # in model order: the first mismatch a reader expects
        if name in state and tuple(state[name].shape) != shape:
            raise ValueError(
                f"{source}: tensor {name} has shape {tuple(state[name].shape)}, "
                f"expected {shape} from config.json"
            )
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{source} lacks tensors the config requires: {missing}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(f"{source} has tensors this architecture does not use: {unexpected}")


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device named by `device` ("cpu", "cuda", "cuda:1" ...), checked to exist."""
    try:
        result = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {device!r}"
        ) from None
    if result.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {device!r} asked for, but this torch sees no CUDA GPU "
                f"(torch {torch.__version__}, CUDA {torch.version.cuda}); use device='cpu'"
            )
        if result.index is not None and result.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r} asked for, but only {torch.cuda.device_count()} "
                "CUDA GPU(s) are visible"
            )
    elif result.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {device!r} asked for, but this torch has no MPS device")
    elif result.type not in ("cpu", "meta"):
        raise ValueError(
            f"device must be 'cpu', a CUDA device such as 'cuda' or 'cuda:1', or 'mps', "
            f"got {device!r}"
        )
    return result


def resolve_dtype(
    requested: str | torch.dtype | None, checkpoint_dtype: str, device: torch.device
) -> torch.dtype:
    """The dtype to run in: the requested one, else the checkpoint's.

    bfloat16 needs a GPU of compute capability 8.0 or newer; on older ones (Colab's T4) a
    bfloat16 checkpoint runs in float16 when no dtype was asked for, as vLLM does, and asking
    for bfloat16 explicitly is an error.
    """
    dtype = torch_dtype(requested if requested is not None else checkpoint_dtype)
    no_bf16 = device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False)
    if dtype == torch.bfloat16 and no_bf16:
        if requested is not None:
            raise ValueError(
                f"{torch.cuda.get_device_name(device)} has no bfloat16 support; "
                "use dtype='float16' or 'float32'"
            )
        return torch.float16
    return dtype


def load_model(
    model: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attention_backend: str = "torch",
    weights: bool = True,
) -> LoadedModel:
    """Load a model directory (or bundled/Hub name); dtype defaults to config's torch_dtype.

    weights=False reads the config and the tokenizer only (`model` is None): what an engine
    whose worker processes hold the weights needs."""
    device = resolve_device(device)
    path = resolve_model_path(model)
    config_file = path / "config.json"
    hf_config = read_json(config_file)
    config = ModelConfig.from_hf_config(hf_config, source=config_file)
    dtype = resolve_dtype(dtype, config.torch_dtype, device)
    config.torch_dtype = str(dtype).removeprefix("torch.")
    lm = None
    if weights:
        lm = load_weights(path, hf_config, config, dtype, device, attention_backend)
    tokenizer = Tokenizer(path)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"{tokenizer.path} has {tokenizer.vocab_size} tokens, more than the "
            f"vocab_size={config.vocab_size} of {config_file}: they are not from one model"
        )
    generation_config_path = path / "generation_config.json"
    generation_config = (
        read_json(generation_config_path) if generation_config_path.is_file() else {}
    )
    # a generation stops at any of them: Qwen3 ends chat turns and documents differently
    eos_token_ids = config.eos_token_ids + generation_eos_ids(
        generation_config, generation_config_path, config.vocab_size
    )
    eos_token_ids = list(dict.fromkeys(eos_token_ids))
    if not eos_token_ids and tokenizer.eos_token_id is not None:
        eos_token_ids = [tokenizer.eos_token_id]
    config.eos_token_ids = eos_token_ids
    return LoadedModel(lm, config, tokenizer, generation_config, path, list(eos_token_ids))


def load_weights(
    path: pathlib.Path,
    hf_config: dict,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str,
) -> LlamaForCausalLM:
    """The model of a directory, its checkpoint's tensors checked against the config."""
    state = rename_checkpoint_tensors(load_safetensors(path), config.architecture)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {
        name: tensor for name, tensor in state.items() if not name.endswith(IGNORED_TENSOR_SUFFIXES)
    }
    # Built without memory, then given the checkpoint's tensors: no random init to overwrite.
    with torch.device("meta"):
        lm = LlamaForCausalLM(config, attention_backend)
    if "quantization_config" in hf_config:
        # a GPTQ or AWQ checkpoint: its packed linears become Int4Linear modules here, and the
        # rest of the state dict (embeddings, norms, LM head) loads as usual below
        from minillm.model.quantization.checkpoint import load_quantized_linears

        try:
            state = load_quantized_linears(
                lm, state, hf_config["quantization_config"], dtype, device
            )
        except ValueError as err:
            raise ValueError(f"{weights_source(path)}: {err}") from err
    check_state_dict(lm, state, weights_source(path))
    state = {name: t.to(device=device, dtype=dtype) for name, t in state.items()}
    lm.load_state_dict(state, strict=False, assign=True)  # check_state_dict did the checking
    if config.tie_word_embeddings:
        lm.lm_head.weight = lm.model.embed_tokens.weight
    lm.eval()
    lm.fuse_projections()  # q/k/v and gate/up as one GEMM each, same Parameters

    return lm


def generation_eos_ids(generation_config: dict, source: pathlib.Path, vocab_size: int) -> list[int]:
    """generation_config.json's eos_token_id as a list of ids < vocab_size."""
    try:
        ids = as_id_list(generation_config.get("eos_token_id"))
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
    out_of_vocab = [i for i in ids if i >= vocab_size]
    if out_of_vocab:
        raise ValueError(
            f"{source}: eos_token_id must be ids in [0, vocab_size={vocab_size}), "
            f"got {out_of_vocab}"
        )
    return ids


def save_pretrained(
    model: LlamaForCausalLM,
    config: ModelConfig,
    tokenizer: str | os.PathLike | Tokenizer | tokenizers.Tokenizer,
    out_dir: str | os.PathLike,
    generation_config: dict | None = None,
) -> pathlib.Path:
    """Write a Hugging Face-format directory that `load_model` and `transformers` both load.

    tokenizer: a tokenizer.json path (or its directory: tokenizer_config.json and
    special_tokens_map.json beside it are copied too), a minillm `Tokenizer`, or a
    `tokenizers.Tokenizer`. Without a tokenizer_config.json one is written naming the
    config's bos/eos tokens. generation_config defaults to the config's bos/eos ids.
    """
    from minillm.model.quantization.linear import linear_layers

    if linear_layers(model):  # their packed tensors are not in state_dict()
        raise ValueError(
            "the model has quantized layers; write it with "
            "minillm.model.quantization.checkpoint.save_quantized"
        )
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # a copy of each tensor: fused projections are views of one matrix, which safetensors
    # would refuse as shared storage
    state = {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")  # safetensors refuses two names for one storage
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) != 1:
        raise ValueError(f"expected one parameter dtype to record in config.json, got {dtypes}")
    hf_config = config.to_hf_config()
    hf_config["torch_dtype"] = str(dtypes.pop()).removeprefix("torch.")
    state = rename_checkpoint_tensors(state, config.architecture, saving=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    safetensors.torch.save_file(state, out / SAFETENSORS_FILE, metadata={"format": "pt"})

    if isinstance(tokenizer, tokenizers.Tokenizer):
        tokenizer.save(str(out / "tokenizer.json"))
    else:
        source = tokenizer.path if isinstance(tokenizer, Tokenizer) else pathlib.Path(tokenizer)
        source = source / "tokenizer.json" if source.is_dir() else source
        if not source.is_file():
            raise FileNotFoundError(f"expected a tokenizer.json file at {source}")
        shutil.copyfile(source, out / "tokenizer.json")
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if (source.parent / name).is_file():
                shutil.copyfile(source.parent / name, out / name)
    if not (out / "tokenizer_config.json").is_file():
        (out / "tokenizer_config.json").write_text(
            json.dumps(tokenizer_config(config, Tokenizer(out)), indent=2) + "\n"
        )

    if generation_config is None:
        generation_config = {
            "bos_token_id": config.bos_token_id,
            "eos_token_id": hf_config["eos_token_id"],
        }
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    return out


def tokenizer_config(config: ModelConfig, tokenizer: Tokenizer) -> dict:
    """A minimal tokenizer_config.json: the special tokens named by the model config."""
    result: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config.max_position_embeddings,
    }
    if config.bos_token_id is not None:
        result["bos_token"] = tokenizer.id_to_token(config.bos_token_id)
    if config.eos_token_ids:
        result["eos_token"] = tokenizer.id_to_token(config.eos_token_ids[0])
    return result
