"""Quantized inference: weights stored in 8, 4 or fewer bits, activations in 16 or 32.

- `formats`: number formats (bfloat16, float16, FP8 E4M3/E5M2, FP4, int8, int4) and their
  range and unit roundoff, computed from the bit layouts.
- `rtn`: integer grids (symmetric per channel, asymmetric per group) and round-to-nearest.
- `gptq`: GPTQ's column-by-column error feedback on the calibration Hessian.
- `awq`: AWQ's activation-aware per-input-channel scaling and its search over alpha.
- `linear`: `Int8Linear` (W8A16), `Int4Linear` (W4A16), `Fp8Linear`: packed weights in
  memory, the Triton kernels on CUDA, dequantize-and-matmul on a CPU.
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
    "check_quantization_args",
    "default_calibration",
    "quantize_model",
    "weight_bytes",
]
