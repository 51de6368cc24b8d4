"""Units the book uses everywhere: bytes, GB vs GiB, bytes per element, tokens per second.

Sizes are in bytes. A GB is 10**9 bytes and a GiB is 2**30 bytes, 7.4% more; vendors
quote bandwidth in decimal GB/s, while memory is built in binary sizes, so every size
names its unit. A model's weights take `num_params * bytes_per_element` bytes; formats
below one byte per element (int4, fp4) are packed two to a byte, so an odd count needs
one more byte.
"""

from __future__ import annotations

import math
import numbers
import types
from fractions import Fraction
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KB = 10**3
MB = 10**6
GB = 10**9
TB = 10**12
KiB = 2**10
MiB = 2**20
GiB = 2**30
TiB = 2**40

# Bytes per element of each storage format, by canonical name.
DTYPE_BYTES: types.MappingProxyType[str, float] = types.MappingProxyType(
    {
        "float32": 4,
        "bfloat16": 2,
        "float16": 2,
        "fp8_e4m3": 1,
        "fp8_e5m2": 1,
        "int8": 1,
        "int4": 0.5,
        "fp4": 0.5,
    }
)

# Other spellings in common use (short names, torch's names) -> canonical name.
_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e4m3fnuz": "fp8_e4m3",
    "float8_e5m2fnuz": "fp8_e5m2",
    "float8_e5m2": "fp8_e5m2",
    "fp4_e2m1": "fp4",
}


def dtype_bytes(dtype: str | torch.dtype) -> float:
    """Bytes per element of `dtype`: a name from `DTYPE_BYTES`, an alias, or a torch.dtype.

    >>> dtype_bytes("bfloat16"), dtype_bytes("int4")
    (2, 0.5)
    """
    if isinstance(dtype, str):
        name = dtype
    else:
        import torch  # only reached when the caller already holds a torch.dtype

        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"expected a dtype name or a torch.dtype, got {dtype!r}")
        name = str(dtype).removeprefix("torch.")
    canonical = _ALIASES.get(name, name)
    if canonical not in DTYPE_BYTES:
        known = ", ".join(sorted([*DTYPE_BYTES, *_ALIASES]))
        raise ValueError(f"unknown dtype {dtype!r}; expected one of: {known}")
    return DTYPE_BYTES[canonical]


def weight_bytes(num_params: int | float, dtype: str | torch.dtype) -> int:
    """Bytes to store `num_params` weights in `dtype`: params x bytes per element, rounded up.

    `num_params` may be a float such as 8.03e9 as long as it is a whole number.

    >>> weight_bytes(8.03e9, "bfloat16")
    16060000000
    """
    if isinstance(num_params, bool) or not isinstance(num_params, numbers.Real):
        raise TypeError(f"num_params must be a number, got {num_params!r}")
    if num_params < 0 or not math.isfinite(num_params) or num_params != int(num_params):
        raise ValueError(f"num_params must be a whole number >= 0, got {num_params!r}")
    # Exact rational arithmetic: 0.5 bytes per element must round up, never down.
    return math.ceil(int(num_params) * Fraction(dtype_bytes(dtype)))


def to_gb(num_bytes: float) -> float:
    """`num_bytes` in decimal gigabytes (10**9 bytes)."""
    return num_bytes / GB


def to_gib(num_bytes: float) -> float:
    """`num_bytes` in binary gibibytes (2**30 bytes)."""
    return num_bytes / GiB


_BINARY_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))
_DECIMAL_UNITS = (("TB", TB), ("GB", GB), ("MB", MB), ("KB", KB))


def format_bytes(num_bytes: float, binary: bool = True) -> str:
    """`num_bytes` in the largest unit that keeps the value >= 1, with two decimals.

    >>> format_bytes(16.06e9), format_bytes(16.06e9, binary=False), format_bytes(512)
    ('14.96 GiB', '16.06 GB', '512 B')
    """
    if not math.isfinite(num_bytes) or num_bytes < 0:
        raise ValueError(f"num_bytes must be a finite number >= 0, got {num_bytes!r}")
    for unit, size in _BINARY_UNITS if binary else _DECIMAL_UNITS:
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes:g} B"


def tokens_per_s(num_tokens: int, duration_s: float) -> float:
    """Throughput: tokens produced per second of wall-clock time."""
    if num_tokens < 0 or not duration_s > 0:
        raise ValueError(
            f"expected num_tokens >= 0 and duration_s > 0, got {num_tokens}, {duration_s}"
        )
    return num_tokens / duration_s


def ms_per_token(num_tokens: int, duration_s: float) -> float:
    """Mean milliseconds per token over `duration_s`.

    This is the plain average; TPOT (chapter 9) leaves out the first token.
    """
    if num_tokens <= 0 or not duration_s >= 0:
        raise ValueError(
            f"expected num_tokens > 0 and duration_s >= 0, got {num_tokens}, {duration_s}"
        )
    return 1000 * duration_s / num_tokens
