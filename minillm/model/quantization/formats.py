"""Number formats from their bit layouts: range, precision and unit roundoff.

A binary floating-point format spends its bits on a sign, e exponent bits and m mantissa
(fraction) bits. A normal number is (-1)^sign * 1.f * 2^(E - bias) with bias = 2^(e-1) - 1;
the smallest exponent field (E = 0) holds the subnormals 0.f * 2^(1 - bias), which fill the
gap down to zero. Everything a chapter quotes about a format follows from (e, m) and from
what the format does with its largest exponent field:

- "ieee": E = 2^e - 1 is reserved for infinities and NaNs (float32, float16, bfloat16,
  FP8 E5M2);
- "fn" (finite, NaN): E = 2^e - 1 holds ordinary numbers, only the all-ones mantissa there
  is NaN, and there is no infinity (FP8 E4M3 as in `torch.float8_e4m3fn`, OCP FP8);
- "finite": no infinity and no NaN at all (FP4 E2M1 of the OCP microscaling formats).

Rounding to nearest, a value x inside the normal range is stored with relative error at
most the unit roundoff u = 2^-(m+1): half the gap 2^-m between 1 and the next number
(that gap is machine epsilon). Integers are the other kind of format: b bits hold 2^b
equally spaced codes, so with a scale s the error is at most s / 2 everywhere in range —
an absolute, not a relative, bound. That difference is why floating formats need no scale
for a tensor's shape but a wide dynamic range, and integer formats need one per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class FloatFormat:
    """A binary floating-point format: 1 sign bit, `exponent_bits`, `mantissa_bits`."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    special: str  # "ieee" | "fn" | "finite": what the all-ones exponent field holds
    torch_dtype: torch.dtype | None = None  # the PyTorch dtype, where there is one

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def machine_epsilon(self) -> float:
        """The gap between 1 and the next larger number: 2^-m."""
        return 2.0**-self.mantissa_bits

    @property
    def unit_roundoff(self) -> float:
        """u = 2^-(m+1): the largest relative error of rounding to nearest (normal range)."""
        return 2.0 ** -(self.mantissa_bits + 1)

    @property
    def max(self) -> float:
        """The largest finite value."""
        m = self.mantissa_bits
        top = 2**self.exponent_bits - 1  # the all-ones exponent field
        if self.special == "ieee":  # the top field is inf/NaN: the largest is one below
            return (2 - 2.0**-m) * 2.0 ** (top - 1 - self.bias)
        if self.special == "fn":  # the top field is finite but its all-ones mantissa is NaN
            return (2 - 2.0 ** (1 - m)) * 2.0 ** (top - self.bias)
        return (2 - 2.0**-m) * 2.0 ** (top - self.bias)

    @property
    def min_normal(self) -> float:
        """The smallest positive normal number: 2^(1 - bias)."""
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        """The smallest positive number: 2^(1 - bias - m)."""
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    def decode(self, code: int) -> float:
        """The value of one bit pattern (sign, exponent field, mantissa field)."""
        if not 0 <= code < 2**self.bits:
            raise ValueError(f"code must be in [0, 2^{self.bits}), got {code}")
        m = self.mantissa_bits
        sign = -1.0 if code >> (self.bits - 1) else 1.0
        exponent = (code >> m) & (2**self.exponent_bits - 1)
        fraction = code & (2**m - 1)
        top = 2**self.exponent_bits - 1
        if exponent == top and self.special == "ieee":
            return sign * float("inf") if fraction == 0 else float("nan")
        if exponent == top and self.special == "fn" and fraction == 2**m - 1:
            return float("nan")
        if exponent == 0:  # subnormal: no implicit leading 1
            return sign * fraction * 2.0 ** (1 - self.bias - m)
        return sign * (1 + fraction / 2**m) * 2.0 ** (exponent - self.bias)

    def values(self) -> list[float]:
        """Every finite value the format holds, ascending, each once (small formats only)."""
        if self.bits > 16:
            raise ValueError(f"{self.name} has 2^{self.bits} codes; enumerate 16 bits or fewer")
        finite = {self.decode(c) for c in range(2**self.bits)}
        return sorted(v for v in finite if v == v and abs(v) != float("inf"))


@dataclass(frozen=True, slots=True)
class IntFormat:
    """A b-bit integer code. Symmetric quantization uses the signed range without its most
    negative code (-127..127 for int8), so that the grid is symmetric about zero; asymmetric
    quantization uses the unsigned codes 0..2^b - 1 and a zero point."""

    name: str
    bits: int

    @property
    def signed_range(self) -> tuple[int, int]:
        return -(2 ** (self.bits - 1) - 1), 2 ** (self.bits - 1) - 1

    @property
    def unsigned_range(self) -> tuple[int, int]:
        return 0, 2**self.bits - 1

    @property
    def levels(self) -> int:
        return 2**self.bits


FLOAT32 = FloatFormat("float32", 8, 23, "ieee", torch.float32)
BFLOAT16 = FloatFormat("bfloat16", 8, 7, "ieee", torch.bfloat16)
FLOAT16 = FloatFormat("float16", 5, 10, "ieee", torch.float16)
FP8_E4M3 = FloatFormat("fp8_e4m3", 4, 3, "fn", torch.float8_e4m3fn)
FP8_E5M2 = FloatFormat("fp8_e5m2", 5, 2, "ieee", torch.float8_e5m2)
FP4_E2M1 = FloatFormat("fp4_e2m1", 2, 1, "finite")
INT8 = IntFormat("int8", 8)
INT4 = IntFormat("int4", 4)

FORMATS: dict[str, FloatFormat | IntFormat] = {
    f.name: f for f in (FLOAT32, BFLOAT16, FLOAT16, FP8_E4M3, FP8_E5M2, FP4_E2M1, INT8, INT4)
}


def format_table() -> list[dict]:
    """One row per format: bits, range and precision, computed from the bit layouts."""
    rows = []
    for f in FORMATS.values():
        if isinstance(f, FloatFormat):
            rows.append(
                {
                    "format": f.name,
                    "bits": f.bits,
                    "exponent_bits": f.exponent_bits,
                    "mantissa_bits": f.mantissa_bits,
                    "max": f.max,
                    "min_normal": f.min_normal,
                    "min_subnormal": f.min_subnormal,
                    "unit_roundoff": f.unit_roundoff,
                }
            )
        else:
            low, high = f.signed_range
            rows.append({"format": f.name, "bits": f.bits, "max": high, "min": low})
    return rows
