"""An operand's cast to float8 (e4m3, or e5m2: tensorwise's output gradients) under its scale in one pass
(kernels.fp8's fused path): t · scale rounded to the nearest float8 (ties to even), t read once and the result written
once (torch's eager ops take two passes and an fp32 copy of t in between: 1.5 times t's bf16 bytes moved here against
5.5).

The rounding is written in integer ops on the fp32 bits (_e4m3_bits, _e5m2_bits) rather than Triton's fp32 -> fp8
conversion: the same code then runs on the GPU and under the interpreter, whose own fp8 conversion rounds wrongly
(136 -> 144 where torch and the hardware give 128), so the CPU tests prove the bits the GPU writes. The product must
lie within the format's max (±448, ±57344; a scale taken from t's own amax: kernels.fp8.scale_of), where torch's
saturating clamp has nothing to do.
"""
import torch
import triton
import triton.language as tl

from .dtypes import FLOAT8
from .opaque import opaque_under_compile
from .rms_norm import launch_device
from .triton_ops import LAUNCHES

BLOCK = 64


@triton.jit
def _e4m3_bits(v):
    """float8_e4m3fn bits of fp32 v (|v| <= 448 up to an fp32 rounding), rounded to nearest, ties to even."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal (|v| >= 2^-6): keep 3 of the 23 mantissa bits, rounding on the rest (a carry moves up the exponent),
    # and rebias the exponent from fp32's 127 to e4m3's 7
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal: |v| in units of 2^-9, rounded to an even integer by adding and removing 2^23 (0..8; 8 is 2^-6's bits)
    sub = ((tl.abs(v) * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
    return (tl.where(mag >= (121 << 23), normal, sub) | sign).to(tl.uint8)


@triton.jit
def _e5m2_bits(v):
    """float8_e5m2 bits of fp32 v (|v| <= 57344 up to an fp32 rounding), rounded to nearest, ties to even."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal (|v| >= 2^-14): keep 2 of the 23 mantissa bits, rounding on the rest (a carry moves up the exponent;
    # 57344 plus an fp32 rounding rounds down to 57344), and rebias the exponent from fp32's 127 to e5m2's 15
    normal = ((mag + 0xFFFFF + ((mag >> 21) & 1)) >> 21) - (112 << 2)
    # subnormal: |v| in units of 2^-16, rounded to an even integer by adding and removing 2^23 (0..4; 4 is 2^-14's)
    sub = ((tl.abs(v) * 65536.0 + 8388608.0) - 8388608.0).to(tl.uint32)
    return (tl.where(mag >= (113 << 23), normal, sub) | sign).to(tl.uint8)


@triton.jit
def _cast_kernel(t_ptr, scale_ptr, out_ptr, M, N, stride_tm, stride_tn, stride_sm, stride_sn, stride_om, stride_on,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, E5M2: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[None, :]
    mask = (rows < M) & (cols < N)
    t = tl.load(t_ptr + rows * stride_tm + cols * stride_tn, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + rows * stride_sm + cols * stride_sn, mask=mask, other=0.0)  # (stride 0: broadcast)
    bits = _e5m2_bits(t * scale) if E5M2 else _e4m3_bits(t * scale)
    tl.store(out_ptr + rows * stride_om + cols * stride_on, bits, mask=mask)


@opaque_under_compile("fp8_cast")
def _cast(t: torch.Tensor, scale: torch.Tensor, column_major: bool, dtype: torch.dtype) -> torch.Tensor:
    M, N = t.shape
    out = torch.empty_strided((M, N), (1, M) if column_major else (N, 1), dtype=torch.uint8, device=t.device)
    scale = scale.expand(M, N)
    if out.numel():
        LAUNCHES["fp8_cast"] += 1
        with launch_device(t):
            _cast_kernel[(triton.cdiv(M, BLOCK), triton.cdiv(N, BLOCK))](
                t, scale, out, M, N, t.stride(0), t.stride(1), scale.stride(0), scale.stride(1), out.stride(0),
                out.stride(1), BLOCK_M=BLOCK, BLOCK_N=BLOCK, E5M2=dtype == torch.float8_e5m2)
    return out.view(dtype)


@_cast.register_fake
def _(t, scale, column_major, dtype):
    M, N = t.shape
    return torch.empty_strided((M, N), (1, M) if column_major else (N, 1), dtype=dtype, device=t.device)


def cast_to_float8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *,
                   column_major: bool = False) -> torch.Tensor:
    """t [M, N] times scale (fp32: [], [M, 1] or [1, N]) as `dtype` (float8_e4m3fn or float8_e5m2) in one pass,
    row-major (or column-major: cuBLASLt's right operand); the product within dtype's max (module docstring)."""
    if t.dim() != 2 or scale.dtype != torch.float32 or scale.dim() > 2 or dtype not in FLOAT8:
        raise ValueError(f"cast_to_float8: t must be 2-D, scale fp32 of at most 2 dims and dtype one of {FLOAT8}, "
                         f"got t {tuple(t.shape)}, scale {scale.dtype} {tuple(scale.shape)}, dtype {dtype}")
    return _cast(t, scale.reshape(scale.shape if scale.dim() == 2 else (1, 1)), column_major, dtype)


def cast_to_e4m3(t: torch.Tensor, scale: torch.Tensor, *, column_major: bool = False) -> torch.Tensor:
    """cast_to_float8 to float8_e4m3fn."""
    return cast_to_float8(t, scale, torch.float8_e4m3fn, column_major=column_major)
