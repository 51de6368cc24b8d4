"""Input checks shared by the kernel launchers.

A launcher validates everything a kernel would silently misread (a wrong dtype, device,
shape or stride) and raises ValueError naming the argument and what was expected, before
any launch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import kernels
from kernels import INTERPRETED


def check_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        expected = " or ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name} must be {expected}, got {str(t.dtype).removeprefix('torch.')}")


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int | None]) -> None:
    """`shape` lists the expected sizes, None where any size is fine."""
    ok = t.dim() == len(shape) and all(
        e is None or e == s for e, s in zip(shape, t.shape, strict=True)
    )
    if not ok:
        expected = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
        raise ValueError(f"{name} must have shape {expected}, got {list(t.shape)}")


def check_same_device(name: str, t: torch.Tensor, reference: torch.Tensor) -> None:
    if t.device != reference.device:
        raise ValueError(
            f"{name} must be on {reference.device} like the other inputs, got {t.device}"
        )


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous, got strides {tuple(t.stride())} for shape {list(t.shape)}"
        )


def check_device(name: str, t: torch.Tensor) -> None:
    """Compiled kernels run on CUDA tensors; the interpreter also takes CPU ones, provided
    it was switched on before triton was imported."""
    if kernels.LATE_INTERPRETER:
        raise RuntimeError(
            "the kernels need Triton's interpreter here (no CUDA device), but triton was "
            "imported before the kernels package could set TRITON_INTERPRET=1, so Triton's "
            "library functions are not interpretable. Set TRITON_INTERPRET=1 in the "
            "environment before starting Python, or import kernels (or minillm.model.llama) before "
            "anything that imports triton, such as torch.compile."
        )
    if not INTERPRETED and t.device.type != "cuda":
        raise ValueError(
            f"{name} must be a cuda tensor (the kernels are compiled for the GPU), got {t.device}"
        )
