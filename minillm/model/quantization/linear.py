"""Quantized linear layers: the packed weights stay packed in memory.

Each layer replaces an `nn.Linear` (y = x W^T + b, W: [N, K]) and keeps only the quantized
form of W:

- `Int8Linear` (W8A16): int8 codes [N, K] and one scale per output channel, w = s_n * q.
- `Int4Linear` (W4A16): 4-bit codes packed two per byte in the layout of
  `kernels.quant_matmul.pack_int4`, one scale and one zero point per group of `group_size`
  input channels, w = s * (q - z).
- `Fp8Linear`: float8 E4M3 weights with one float32 scale per output channel, w = s_n * q.
- `W8A8Linear` (W8A8): int8 weights per output channel as in `Int8Linear`, and the
  activations quantized too, per token, on every call: an int8 x int8 matmul summed in
  int32, both scales applied afterwards (`kernels.int8_gemm`).

Forward of the weight-only layers: on CUDA, the Triton W8A16 / W4A16 kernels, which read the
packed bytes and dequantize in registers, so a decode step moves 1 or 1/2 byte per weight
instead of 2. On a CPU (or for FP8, on every device) the layer dequantizes W to the
activations' dtype and runs an ordinary matmul: the numbers are the same, the memory traffic
is not — a dequantized copy of W is made on every call, so on a CPU a quantized model is
smaller but not faster. FP8 here is weight-only and emulated: real FP8 GEMMs (Hopper and Ada
tensor cores) also quantize the activations, which this layer does not. `W8A8Linear` does,
in int8: its matmul multiplies integer codes on every device (the W8A8 Triton kernel on
CUDA, `torch._int_mm` on a CPU).

The buffers are not part of `state_dict()`: a quantized model is written and read in the
public GPTQ / AWQ layouts by `minillm.model.quantization.checkpoint`, and the float
remainder of the model (embeddings, norms, LM head) loads as before.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import int8_gemm
from kernels.int8_gemm import quantize_per_token, w8a8_matmul
from kernels.quant_matmul import pack_int4, unpack_int4, w4a16_matmul, w8a16_matmul

# group sizes the W4A16 kernel handles; others run the dequantize path on every device
KERNEL_GROUP_SIZES = (32, 64, 128, 256)
INT4_SIGNED_OFFSET = 8  # codes q go to pack_int4 as q - 8 (its nibble is q); a symmetric z
FP8_DTYPE = torch.float8_e4m3fn


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W kept quantized; subclasses say how W is stored."""

    quantization = ""  # "int8" | "int4" | "fp8" | "w8a8"

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K], input channels in their original order."""
        raise NotImplementedError

    def forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] contiguous -> x W^T [M, N] through the Triton kernel (no bias)."""
        raise NotImplementedError

    @property
    def has_kernel(self) -> bool:
        return False

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] -> x W^T [M, N]: dequantize, then an ordinary matmul (no bias)."""
        return x @ self.dequantize().to(x.dtype).T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x.is_cuda and self.has_kernel:
            y = self.forward_kernel(x2.contiguous())
        else:
            y = self.forward_torch(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def weight_bytes(self) -> int:
        """Bytes of every tensor the layer keeps: packed weights, scales, zeros (and the
        bias and input permutation where there are any)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"quantization={self.quantization}, bias={self.bias is not None}"
        )


class Int8Linear(QuantizedLinear):
    """W8A16: int8 codes q in [-127, 127], w = s_n q (symmetric, per output channel)."""

    quantization = "int8"

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        """codes: [N, K] integers in [-127, 127]; scales: [N] or [N, 1]; dtype: the
        activations' (the kernel takes scales in x's dtype)."""
        n, k = codes.shape
        super().__init__(k, n, None if bias is None else bias.to(dtype))
        if codes.numel() and (codes.min() < -127 or codes.max() > 127):
            raise ValueError("int8 codes must lie in [-127, 127]")
        self.register_buffer("qweight", codes.to(torch.int8).contiguous(), persistent=False)
        self.register_buffer("scales", scales.reshape(n).to(dtype).contiguous(), persistent=False)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    @property
    def has_kernel(self) -> bool:
        return True

    def forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        return w8a16_matmul(x, self.qweight, self.scales)


class Int4Linear(QuantizedLinear):
    """W4A16: 4-bit codes q in [0, 15], w = s * (q - z) per group of input channels.

    In memory, in the W4A16 kernel's layout (`kernels.quant_matmul`), built once at load:
    `packed` [N, K / 2] uint8 holds the codes q in the nibbles of `pack_int4`; `scales`
    [G, N] (G = K / group_size, group-major like GPTQ and AWQ checkpoints) in the
    activations' dtype; `zero_points` [G, N] uint8 = z, or None for a symmetric grid (z = 8
    everywhere, the kernel's default). The kernel subtracts z as it dequantizes, so an
    asymmetric layer is one launch, like a symmetric one.

    `input_perm` (act-order checkpoints): stored column j holds input channel input_perm[j],
    so that each group is contiguous in memory; x's columns are permuted to match.
    """

    quantization = "int4"

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        group_size: int,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        input_perm: torch.Tensor | None = None,
    ) -> None:
        """codes: [N, K] integers in [0, 15], columns in `input_perm` order when given;
        scales, zeros: [N, K / group_size] (zeros None: symmetric, z = 8)."""
        n, k = codes.shape
        super().__init__(k, n, None if bias is None else bias.to(dtype))
        if k % group_size or k % 2:
            raise ValueError(f"group_size {group_size} must divide the input dim {k} (even)")
        if tuple(scales.shape) != (n, k // group_size):  # the quantizers' [N, G]
            raise ValueError(f"scales must be [{n}, {k // group_size}], got {list(scales.shape)}")
        if codes.numel() and (codes.min() < 0 or codes.max() > 15):
            raise ValueError("int4 codes must lie in [0, 15]")
        self.group_size = group_size
        signed = (codes.to(torch.int16) - INT4_SIGNED_OFFSET).to(torch.int8)
        self.register_buffer("packed", pack_int4(signed.contiguous()), persistent=False)
        self.register_buffer("scales", scales.T.to(dtype).contiguous(), persistent=False)
        zero_points = None
        if zeros is not None:
            if zeros.numel() and (zeros.min() < 0 or zeros.max() > 15):
                raise ValueError("int4 zero points must lie in [0, 15]")
            zero_points = zeros.T.to(torch.uint8).contiguous()
        self.register_buffer("zero_points", zero_points, persistent=False)
        if input_perm is not None:
            input_perm = input_perm.to(torch.int64)
            if sorted(input_perm.tolist()) != list(range(k)):
                raise ValueError("input_perm must be a permutation of the input channels")
        self.register_buffer("input_perm", input_perm, persistent=False)

    def codes(self) -> torch.Tensor:
        """The codes q in [0, 15], [N, K] int32, in stored (input_perm) order."""
        return unpack_int4(self.packed).to(torch.int32) + INT4_SIGNED_OFFSET

    def zeros(self) -> torch.Tensor:
        """The zero points z in [0, 15], [N, G] int32."""
        if self.zero_points is None:
            return torch.full(self.scales.T.shape, INT4_SIGNED_OFFSET, dtype=torch.int32)
        return self.zero_points.T.to(torch.int32)

    def dequantize(self) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        q = unpack_int4(self.packed).float().view(n, k // self.group_size, self.group_size)
        if self.zero_points is not None:  # (q - 8) - (z - 8) = q - z
            q = q - (self.zero_points.T.float()[:, :, None] - INT4_SIGNED_OFFSET)
        w = (q * self.scales.T.float()[:, :, None]).view(n, k)
        if self.input_perm is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.input_perm, w)

    @property
    def has_kernel(self) -> bool:
        return self.group_size in KERNEL_GROUP_SIZES

    def forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_perm is not None:
            x = x[:, self.input_perm].contiguous()
        return w4a16_matmul(x, self.packed, self.scales, self.group_size, self.zero_points)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


class Fp8Linear(QuantizedLinear):
    """FP8 E4M3 weights, w = s_n * q with s_n = max_k |W[n, k]| / 448 (per output channel).

    The codes are kept as their raw bytes (uint8), so that `model.to(dtype)` cannot turn them
    into wider floats; every forward decodes them (emulated FP8, see the module docstring).
    """

    quantization = "fp8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """weight: [N, K] float -> quantized here (per-channel scales, saturating at 448)."""
        n, k = weight.shape
        super().__init__(k, n, bias)
        fp8_max = torch.finfo(FP8_DTYPE).max
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / fp8_max).clamp(min=torch.finfo(torch.float32).tiny)
        codes = (w / scales[:, None]).clamp(-fp8_max, fp8_max).to(FP8_DTYPE)
        self.register_buffer("weight_bits", codes.view(torch.uint8), persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    def dequantize(self) -> torch.Tensor:
        return self.weight_bits.view(FP8_DTYPE).float() * self.scales.float()[:, None]


class W8A8Linear(QuantizedLinear):
    """W8A8: int8 weights q_w in [-127, 127] with one float32 scale per output channel, and
    int8 activations with one scale per token, computed from each call's x (dynamic):

        y[m, n] = sx_m sw_n sum_k qx[m, k] qw[n, k],   sx_m = max_k |x[m, k]| / 127.

    The sum is over integers, exact in int32; the scales are applied once per output.
    `input_smooth` (SmoothQuant, where the division could not be folded into the layer
    before): x is divided by it, per input channel, before it is quantized.
    """

    quantization = "w8a8"

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        input_smooth: torch.Tensor | None = None,
    ) -> None:
        """codes: [N, K] integers in [-127, 127]; scales: [N] or [N, 1]; dtype: the
        activations' (the output's and the bias's); input_smooth: [K] positive or None."""
        n, k = codes.shape
        super().__init__(k, n, None if bias is None else bias.to(dtype))
        if codes.numel() and (codes.min() < -127 or codes.max() > 127):
            raise ValueError("int8 codes must lie in [-127, 127]")
        self.register_buffer("qweight", codes.to(torch.int8).contiguous(), persistent=False)
        self.register_buffer(
            "scales", scales.reshape(n).to(torch.float32).contiguous(), persistent=False
        )
        if input_smooth is not None:
            input_smooth = input_smooth.to(torch.float32).reshape(k)
            if not bool((input_smooth > 0).all()):
                raise ValueError("input_smooth must be positive")
        self.register_buffer("input_smooth", input_smooth, persistent=False)

    def dequantize(self) -> torch.Tensor:
        """The weights W' = W diag(s) actually multiplied, float32 [N, K] (the input's
        smoothing divisor is not in them)."""
        return self.qweight.float() * self.scales[:, None]

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (codes [M, K] int8, scales [M] float32), after the smoothing divisor."""
        if self.input_smooth is not None:
            x = x.float() / self.input_smooth
        return quantize_per_token(x)

    @property
    def has_kernel(self) -> bool:
        return True

    def forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        qx, x_scales = self.quantize_input(x)
        if int8_gemm.supported(x.device):
            return w8a8_matmul(qx, x_scales, self.qweight, self.scales, out_dtype=x.dtype)
        # before Ampere: the same integer sums, exact in float64 (|sum| < 2^53)
        dots = qx.double() @ self.qweight.double().T
        return (dots.float() * x_scales[:, None] * self.scales[None, :]).to(x.dtype)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The same arithmetic in PyTorch: the int8 x int8 products summed in int32
        (`torch._int_mm`), then both scales in float32."""
        qx, x_scales = self.quantize_input(x)
        if self.in_features > 1:
            dots = torch._int_mm(qx, self.qweight.T)  # [M, N] int32
        else:  # torch._int_mm returns garbage for K = 1 on a CPU: one product per output
            dots = qx.to(torch.int32) * self.qweight.to(torch.int32).T
        return (dots.float() * x_scales[:, None] * self.scales[None, :]).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, smoothed_input={self.input_smooth is not None}"


def linear_layers(model: nn.Module) -> dict[str, QuantizedLinear]:
    """The quantized layers of a model by qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights: its parameters, each counted once (a tied embedding and
    LM head are one tensor), plus every quantized layer's packed weights, scales and zeros."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # shared: once
    return total + sum(m.weight_bytes() for m in linear_layers(model).values())
