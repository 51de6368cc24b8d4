"""Calibration: the token windows GPTQ and AWQ learn from, and what they record of them.

GPTQ needs each linear layer's input Hessian H = 2 X^T X / T, AWQ the mean |x| of each
input channel and SmoothQuant its max |x|, over calibration inputs X: [T, K] that look like
what the model will see.
Calibration text must be kept apart from the text perplexity is measured on, or the
measurement flatters the method. `default_calibration` therefore reads the bundled models'
training corpus, the Python standard library of the running interpreter, minus the files
whose tokens make the held-out windows (listed in `heldout_tokens.json` beside the model).

`LinearInputStats` accumulates both statistics from forward pre-hooks, so that no
activation is stored: a layer of K inputs costs a [K, K] float32 matrix whatever T is.
"""

from __future__ import annotations

import json
import pathlib
import sysconfig

import torch
from torch import nn

from minillm.model.tokenizer import Tokenizer

HELDOUT_FILE = "heldout_tokens.json"
DEFAULT_NUM_TOKENS = 8192
DEFAULT_SEQ_LEN = 256


def calibration_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    """The standard library's .py files (sorted, no site-packages), minus the held-out ones."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    heldout_path = model_dir / HELDOUT_FILE
    heldout = set()
    if heldout_path.is_file():
        heldout = set(json.loads(heldout_path.read_text())["validation_files"])
    files = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        relative = path.relative_to(root)
        if "site-packages" not in relative.parts and relative.as_posix() not in heldout:
            files.append(path)
    if not files:
        raise FileNotFoundError(f"no standard library .py files found under {root}")
    return files


def default_calibration(
    model_dir: str | pathlib.Path,
    num_tokens: int = DEFAULT_NUM_TOKENS,
    seq_len: int = DEFAULT_SEQ_LEN,
) -> torch.Tensor:
    """Calibration windows for the model in `model_dir`: [ceil(num_tokens / seq_len),
    seq_len] int64 token ids, made with the model's tokenizer from standard library files
    spread evenly over the sorted list (at most 2 windows' worth from each)."""
    if num_tokens < 1 or seq_len < 2:
        raise ValueError(f"need num_tokens >= 1 and seq_len >= 2, got {num_tokens}, {seq_len}")
    model_dir = pathlib.Path(model_dir)
    tokenizer = Tokenizer(model_dir)
    num_windows = -(-num_tokens // seq_len)
    files = calibration_files(model_dir)
    step = max(1, len(files) // num_windows)
    stream: list[int] = []
    for path in files[::step]:
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:  # a few tests carry deliberately broken encodings
            continue
        ids = tokenizer.encode(text)
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        stream.extend(ids[: 2 * seq_len])
        if len(stream) >= num_windows * seq_len:
            break
    if len(stream) < num_windows * seq_len:
        raise ValueError(
            f"the standard library gave {len(stream)} calibration tokens, "
            f"fewer than {num_windows * seq_len}"
        )
    return torch.tensor(stream[: num_windows * seq_len]).view(num_windows, seq_len)


class LinearInputStats:
    """Records H = 2 X^T X / T, mean |x| and max |x| per input channel of some linear
    layers."""

    def __init__(self, linears: dict[str, nn.Linear]) -> None:
        self.hessian: dict[str, torch.Tensor] = {}
        self.abs_sum: dict[str, torch.Tensor] = {}
        self.abs_max: dict[str, torch.Tensor] = {}
        self.count: dict[str, int] = {}
        self.handles = [
            linear.register_forward_pre_hook(self._hook(name)) for name, linear in linears.items()
        ]

    def _hook(self, name: str):
        def record(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            if name not in self.hessian:
                k = x.shape[1]
                self.hessian[name] = torch.zeros(k, k, device=x.device)
                self.abs_sum[name] = torch.zeros(k, device=x.device)
                self.abs_max[name] = torch.zeros(k, device=x.device)
                self.count[name] = 0
            self.hessian[name] += 2 * x.T @ x
            self.abs_sum[name] += x.abs().sum(dim=0)
            torch.maximum(self.abs_max[name], x.abs().amax(dim=0), out=self.abs_max[name])
            self.count[name] += x.shape[0]

        return record

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def result(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(H [K, K], mean |x| [K]) of one layer."""
        if name not in self.hessian:
            raise ValueError(f"no calibration input reached {name}")
        return self.hessian[name] / self.count[name], self.abs_sum[name] / self.count[name]

    def amax(self, name: str) -> torch.Tensor:
        """max |x| per input channel of one layer, [K] (SmoothQuant's statistic)."""
        if name not in self.abs_max:
            raise ValueError(f"no calibration input reached {name}")
        return self.abs_max[name]
