"""Quantized inference: weights stored in 8 or 4 bits, activations in 16 or 32 bits (weight-
only) or in 8 (W8A8).

- `formats`: number formats (bfloat16, float16, FP8 E4M3/E5M2, FP4, int8, int4) and their
  range and unit roundoff, computed from the bit layouts.
- `rtn`: integer grids (symmetric per channel, asymmetric per group) and round-to-nearest.
- `gptq`: GPTQ's column-by-column error feedback on the calibration Hessian.
- `awq`: AWQ's activation-aware per-input-channel scaling and its search over alpha.
- `linear`: `Int8Linear` (W8A16), `Int4Linear` (W4A16), `Fp8Linear` (FP8 weight-only):
  packed weights in memory, the Triton kernels on CUDA, dequantize-and-matmul on a CPU;
  `W8A8Linear` (W8A8): int8 weights and per-token int8 activations, an int8 x int8 matmul
  summed in int32 (the Triton kernel on CUDA, `torch._int_mm` on a CPU).
- `smoothquant`: SmoothQuant's per-input-channel migration of activation range into the
  weights, folded into the RMSNorm or linear before, ahead of W8A8.
- `calibration`: calibration windows and the input statistics GPTQ and AWQ need.
- `quantize`: `quantize_model`, which puts it together on a Llama-family model.
- `checkpoint`: the public GPTQ and AWQ checkpoint layouts, written and read.

    loaded = load_model("minillm-stdlib-target", dtype="float32")
    calibration = default_calibration(loaded.path)
    quantize_model(loaded.model, "int4", group_size=128, method="gptq", calibration=calibration)
"""

from minillm.model.quantization.calibration import default_calibration
from minillm.model.quantization.linear import (
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    W8A8Linear,
    weight_bytes,
)
from minillm.model.quantization.quantize import (
    METHODS,
    QUANTIZATIONS,
    check_quantization_args,
    quantize_model,
)

__all__ = [
    "METHODS",
    "QUANTIZATIONS",
    "Fp8Linear",
    "Int4Linear",
    "Int8Linear",
    "QuantizedLinear",
    "W8A8Linear",
    "check_quantization_args",
    "default_calibration",
    "quantize_model",
    "weight_bytes",
]
