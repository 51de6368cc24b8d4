"""Accelerator specifications: the numbers a roofline is drawn from.

A `DeviceSpec` holds what a datasheet promises: peak dense FLOP/s per number format,
memory bandwidth, memory capacity and the count of compute units (NVIDIA SMs, AMD CUs,
TPU TensorCores). Every figure is the vendor's own, copied with the document and date it
came from, so that a reader can check it.

Vendors print two compute figures for tensor cores since Ampere: a dense one, and one
"with sparsity" that is exactly twice as large. The sparse figure assumes 2:4
structured sparsity (two of every four weights are zero and the hardware skips them),
which dense LLM weights do not have. `peak_flops` returns the dense figure; the sparse
one is kept apart, labelled, in `sparse_flops_per_s`, and no roofline in the book uses it.

Integer formats count operations rather than floating-point ones (TOPS); the book treats
one integer multiply-add as two operations, as the datasheets do, so int8 peaks sit in
the same table.

"This machine" is not a datasheet: `minillm.lab.measure.this_machine()` measures the computer
the code runs on and returns its spec with `measured=True`.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minillm.lab.units import GB, TB, GiB

if TYPE_CHECKING:
    import torch

# The compute formats a spec lists peaks for. fp8 covers both e4m3 and e5m2; tf32 is the
# tensor-core format for float32 inputs, float32 the plain (vector or matrix) float32 rate.
COMPUTE_FORMATS = ("float32", "tf32", "bfloat16", "float16", "fp8", "int8")

_FORMAT_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e4m3fnuz": "fp8",
    "float8_e5m2": "fp8",
    "float8_e5m2fnuz": "fp8",
}

THIS_MACHINE = "this machine"


def compute_format(dtype: str | torch.dtype) -> str:
    """The compute format whose peak applies to `dtype` ("bf16" -> "bfloat16", "fp8_e4m3" -> "fp8").

    >>> compute_format("bf16"), compute_format("fp8_e5m2")
    ('bfloat16', 'fp8')
    """
    name = str(dtype).removeprefix("torch.")
    name = _FORMAT_ALIASES.get(name, name)
    if name not in COMPUTE_FORMATS:
        raise ValueError(
            f"no compute format for dtype {dtype!r}; expected one of {list(COMPUTE_FORMATS)} "
            f"or an alias ({', '.join(sorted(_FORMAT_ALIASES))})"
        )
    return name


def _rates(**tflops: float) -> types.MappingProxyType[str, float]:
    """{format: FLOP/s} from TFLOP/s keyword arguments, read-only."""
    for key in tflops:
        compute_format(key)  # a typo in the table is an error at import
    return types.MappingProxyType({key: value * 1e12 for key, value in tflops.items()})


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator as its datasheet (or a measurement) describes it.

    Rates are per second: FLOP/s for compute (operations/s for int8), bytes/s for memory.

    Capacity: memory chips come in powers of two, so the "80 GB" on a datasheet is 80 GiB
    (2**30 bytes each) of memory on the board; `memory_bytes` holds that. The driver keeps a
    little of it for itself, and CUDA reports the rest as the device's total
    (`torch.cuda.get_device_properties(i).total_memory`, what vLLM's
    `gpu_memory_utilization` multiplies): `cuda_memory_bytes` holds that figure where it
    was recorded, and `runtime_memory_bytes()` gives the best figure for budgets.
    """

    name: str
    peak_flops_per_s: Mapping[str, float]  # dense peak per compute format
    sparse_flops_per_s: Mapping[str, float]  # 2:4 structured sparsity: 2x dense, not for LLMs
    memory_bandwidth_bytes_per_s: float
    memory_bytes: float  # on the board: the datasheet's "GB" label read as GiB
    memory_type: str  # "HBM3", "GDDR6", "DDR" ...
    num_compute_units: int
    compute_unit: str  # "SM" (NVIDIA), "CU" (AMD), "TensorCore" (TPU), "core" (CPU)
    source: str  # the document every figure of this row comes from
    source_date: str  # its date, YYYY-MM
    measured: bool = False  # True for "this machine": figures are achieved, not promised
    cuda_memory_bytes: float | None = None  # the total CUDA reports, where it was recorded

    def runtime_memory_bytes(self) -> float:
        """The capacity software can budget: what CUDA reports where recorded, else the
        board's capacity (the driver's reserve is about 1% of it)."""
        return self.memory_bytes if self.cuda_memory_bytes is None else self.cuda_memory_bytes

    def peak_flops(self, dtype: str | torch.dtype) -> float:
        """Dense peak FLOP/s for computing in `dtype`; never the sparse figure."""
        fmt = compute_format(dtype)
        if fmt not in self.peak_flops_per_s:
            raise ValueError(
                f"{self.name} lists no {fmt} peak; it lists {sorted(self.peak_flops_per_s)}"
            )
        return self.peak_flops_per_s[fmt]

    def sparse_peak_flops(self, dtype: str | torch.dtype) -> float:
        """The datasheet's "with sparsity" figure for `dtype` (2:4 structured sparsity)."""
        fmt = compute_format(dtype)
        if fmt not in self.sparse_flops_per_s:
            raise ValueError(
                f"{self.name} lists no sparse {fmt} figure; it lists "
                f"{sorted(self.sparse_flops_per_s) or 'none'}"
            )
        return self.sparse_flops_per_s[fmt]

    def supports(self, dtype: str | torch.dtype) -> bool:
        """True when the spec lists a dense peak for `dtype`'s compute format."""
        return compute_format(dtype) in self.peak_flops_per_s


_NVIDIA_H100_SOURCE = (
    "NVIDIA H100 Tensor Core GPU Architecture whitepaper (H100 SXM5 column) and "
    "NVIDIA H100 Tensor Core GPU datasheet, "
    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
)

# Hopper: H100 and H200 share the GH100 chip and its clocks; the H200 has more, faster HBM.
_HOPPER_DENSE = _rates(
    float32=66.9, tf32=494.7, bfloat16=989.4, float16=989.4, fp8=1978.9, int8=1978.9
)
_HOPPER_SPARSE = _rates(tf32=989.4, bfloat16=1978.9, float16=1978.9, fp8=3957.8, int8=3957.8)

DEVICES: types.MappingProxyType[str, DeviceSpec] = types.MappingProxyType(
    {
        spec.name: spec
        for spec in (
            DeviceSpec(
                name="H100 SXM",
                peak_flops_per_s=_HOPPER_DENSE,
                sparse_flops_per_s=_HOPPER_SPARSE,
                memory_bandwidth_bytes_per_s=3.35 * TB,
                memory_bytes=80 * GiB,
                # what CUDA reports for an H100 80GB HBM3 (vLLM logs it as the total that
                # gpu_memory_utilization multiplies)
                cuda_memory_bytes=79.18 * GiB,
                memory_type="HBM3",
                num_compute_units=132,
                compute_unit="SM",
                source=_NVIDIA_H100_SOURCE,
                source_date="2023-09",
            ),
            DeviceSpec(
                name="H200 SXM",
                peak_flops_per_s=_HOPPER_DENSE,
                sparse_flops_per_s=_HOPPER_SPARSE,
                memory_bandwidth_bytes_per_s=4.8 * TB,
                memory_bytes=141 * GiB,
                memory_type="HBM3e",
                num_compute_units=132,
                compute_unit="SM",
                source="NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column), "
                "https://www.nvidia.com/en-us/data-center/h200/",
                source_date="2024-11",
            ),
            DeviceSpec(
                name="A100 SXM 80GB",
                peak_flops_per_s=_rates(
                    float32=19.5, tf32=156, bfloat16=312, float16=312, int8=624
                ),
                sparse_flops_per_s=_rates(tf32=312, bfloat16=624, float16=624, int8=1248),
                memory_bandwidth_bytes_per_s=2.039 * TB,
                memory_bytes=80 * GiB,
                cuda_memory_bytes=79.15 * GiB,  # as CUDA reports an A100-SXM4-80GB
                memory_type="HBM2e",
                num_compute_units=108,
                compute_unit="SM",
                source="NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column), "
                "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
                source_date="2021-06",
            ),
            DeviceSpec(
                name="L40S",
                peak_flops_per_s=_rates(
                    float32=91.6, tf32=183, bfloat16=362.05, float16=362.05, fp8=733, int8=733
                ),
                sparse_flops_per_s=_rates(tf32=366, bfloat16=733, float16=733, fp8=1466, int8=1466),
                memory_bandwidth_bytes_per_s=864 * GB,
                memory_bytes=48 * GiB,
                memory_type="GDDR6",
                num_compute_units=142,
                compute_unit="SM",
                source="NVIDIA L40S GPU datasheet, "
                "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413",
                source_date="2023-08",
            ),
            DeviceSpec(
                # The L4 datasheet prints only the sparse tensor figures; dense is half.
                name="L4",
                peak_flops_per_s=_rates(
                    float32=30.3, tf32=60, bfloat16=121, float16=121, fp8=242.5, int8=242.5
                ),
                sparse_flops_per_s=_rates(tf32=120, bfloat16=242, float16=242, fp8=485, int8=485),
                memory_bandwidth_bytes_per_s=300 * GB,
                memory_bytes=24 * GiB,
                memory_type="GDDR6",
                num_compute_units=58,
                compute_unit="SM",
                source="NVIDIA L4 Tensor Core GPU datasheet, "
                "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet",
                source_date="2023-03",
            ),
            DeviceSpec(
                # Turing: float16 tensor cores (65 TFLOP/s mixed precision), no bfloat16, no
                # structured sparsity.
                name="T4",
                peak_flops_per_s=_rates(float32=8.1, float16=65, int8=130),
                sparse_flops_per_s=_rates(),
                memory_bandwidth_bytes_per_s=320 * GB,
                memory_bytes=16 * GiB,
                cuda_memory_bytes=14.75 * GiB,  # as CUDA reports a T4 (Colab's GPU)
                memory_type="GDDR6",
                num_compute_units=40,
                compute_unit="SM",
                source="NVIDIA T4 Tensor Core GPU datasheet, "
                "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/"
                "t4-tensor-core-datasheet-951643.pdf",
                source_date="2019-03",
            ),
            DeviceSpec(
                # GeForce (Ada): the tensor-core figures with FP32 accumulation, which the
                # kernels use; float16 with FP16 accumulation runs twice as fast.
                name="RTX 4090",
                peak_flops_per_s=_rates(
                    float32=82.6, tf32=82.6, bfloat16=165.2, float16=165.2, fp8=330.3, int8=660.6
                ),
                sparse_flops_per_s=_rates(
                    tf32=165.2, bfloat16=330.4, float16=330.4, fp8=660.6, int8=1321.2
                ),
                memory_bandwidth_bytes_per_s=1008 * GB,
                memory_bytes=24 * GiB,
                memory_type="GDDR6X",
                num_compute_units=128,
                compute_unit="SM",
                source="NVIDIA Ada GPU Architecture whitepaper (GeForce RTX 4090 column), "
                "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/"
                "nvidia-ada-gpu-architecture.pdf",
                source_date="2022-09",
            ),
            DeviceSpec(
                name="MI300X",
                peak_flops_per_s=_rates(
                    float32=163.4,
                    tf32=653.7,
                    bfloat16=1307.4,
                    float16=1307.4,
                    fp8=2614.9,
                    int8=2614.9,
                ),
                sparse_flops_per_s=_rates(
                    tf32=1307.4, bfloat16=2614.9, float16=2614.9, fp8=5229.8, int8=5229.8
                ),
                memory_bandwidth_bytes_per_s=5.3 * TB,
                memory_bytes=192 * GiB,
                memory_type="HBM3",
                num_compute_units=304,
                compute_unit="CU",
                source="AMD Instinct MI300X accelerator data sheet, "
                "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/"
                "data-sheets/amd-instinct-mi300x-data-sheet.pdf",
                source_date="2023-12",
            ),
            DeviceSpec(
                name="TPU v5e",
                peak_flops_per_s=_rates(bfloat16=197, int8=393),
                sparse_flops_per_s=_rates(),
                memory_bandwidth_bytes_per_s=819 * GB,
                memory_bytes=16 * GiB,
                memory_type="HBM2",
                num_compute_units=1,
                compute_unit="TensorCore",
                source="Google Cloud TPU v5e documentation, https://cloud.google.com/tpu/docs/v5e",
                source_date="2024-01",
            ),
        )
    }
)


def device_names() -> list[str]:
    """Names `get_device` accepts: the rows of the datasheet table."""
    return list(DEVICES)


def get_device(name: str) -> DeviceSpec:
    """The datasheet spec called `name` (case-insensitive). For this computer's own measured
    figures, see `minillm.lab.measure.this_machine`."""
    for key, spec in DEVICES.items():
        if key.lower() == name.lower():
            return spec
    raise ValueError(f"unknown device {name!r}; expected one of {device_names()}")
