"""FP8 linears: a linear's three GEMMs (forward y = x·Wᵀ, dgrad dx = dz·W, wgrad dW = dzᵀ·x) with both operands cast
to float8 under a dynamic scale (each operand's amax, taken at every call), multiplied by `torch._scaled_mm`
(cuBLASLt on Hopper; an eager kernel on CPU) with fp32 accumulation, the result in the caller's dtype.

The recipes are torchao's float8 training recipes (torchao.float8, Float8LinearConfig.from_recipe_name), by name and
by meaning:
- "tensorwise" (torchao's plain Float8LinearConfig(); Transformer Engine's HYBRID format): x and W in e4m3, the
  output gradient dz (the dgrad's and the wgrad's left operand) in e5m2 (max 57344: range over precision, for
  gradients); one scale per operand, float8_max / amax(|t|) over the whole tensor, float8_max its dtype's.
- "rowwise": every operand in e4m3, dz too; one scale per row of the left operand and per column of the right one
  (each an amax along the contraction dim), rounded down to a power of two (exact to apply and to undo).
A GEMM never takes e5m2 on both sides (cuBLASLt has no such kernel): its right operand, W or x, is always e4m3.
The master weights, the bias, the activation epilogue, the bias gradient and main_grad's fp32 accumulation stay as
the other backends have them: only the matmuls change.

Tensor parallelism: a tensorwise amax over a tensor that tp splits is each rank's own amax, not the serial one; a
rowwise amax along a contraction dim that tp splits is a partial one. Given the group and which weight dim it splits
(Fp8Scaling), the GEMM all-reduces (MAX) exactly those amaxes over the group, one small all-reduce per GEMM, so the
scales, and the curve, are the serial run's (docs/fp8.md).
"""
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import torch_ops

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E4M3_MAX = torch.finfo(E4M3).max
AMAX_FLOOR = 1e-12  # torchao's EPS: an all-zero operand gets a finite scale
MULTIPLE = 16  # torch._scaled_mm (cuBLASLt): the contraction dim and the right operand's columns multiples of 16
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Recipe(NamedTuple):
    rowwise: bool  # scales per row of the left operand / column of the right one (else one per tensor)
    power_of_2_scales: bool
    grad_dtype: torch.dtype  # the output gradient dz's float8 (x and W: e4m3)


# name -> recipe: the fp8_recipe names every upper floor accepts; torchao's (Float8LinearConfig.from_recipe_name)
FP8_RECIPES = {
    "tensorwise": Recipe(rowwise=False, power_of_2_scales=False, grad_dtype=E5M2),  # (torchao's default config)
    "rowwise": Recipe(rowwise=True, power_of_2_scales=True, grad_dtype=E4M3),
}


class Fp8Scaling(NamedTuple):
    """How a linear runs its GEMMs in fp8: the recipe's name; the process group its weight is split over (None:
    whole) and which weight dim it splits: "out" (a column-parallel layer) or "in" (a row-parallel one)."""
    recipe: str
    group: dist.ProcessGroup | None = None
    split: str | None = None


def check_recipe(recipe: str | None) -> None:
    if recipe is not None and recipe not in FP8_RECIPES:
        raise ValueError(f"unknown fp8_recipe {recipe!r}; expected one of {tuple(FP8_RECIPES)} (or None)")


def check_features(recipe: str | None, in_features: int, out_features: int, what: str) -> None:
    """An fp8 linear's local weight [out, in] must have both dims multiples of 16 (torch._scaled_mm's rule on
    GPUs, kept on every device so that what runs here runs there); `what` names the layer in the error."""
    check_recipe(recipe)
    if recipe is not None and (in_features % MULTIPLE or out_features % MULTIPLE):
        raise ValueError(f"fp8_recipe={recipe!r}: {what} has in_features={in_features}, out_features={out_features} "
                         f"(per rank); torch._scaled_mm needs both to be multiples of {MULTIPLE}")


def scale_of(amax: torch.Tensor, recipe: Recipe, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """float8_max / amax in fp32 (amax floored at 1e-12; float8_max `dtype`'s: 448 for e4m3, 57344 for e5m2),
    rounded down to a power of two when the recipe says."""
    scale = torch.finfo(dtype).max / amax.float().clamp(min=AMAX_FLOOR)
    return torch.exp2(torch.floor(torch.log2(scale))) if recipe.power_of_2_scales else scale


def grad_dtype(recipe: str) -> torch.dtype:
    """The float8 the recipe casts the output gradient dz to (e5m2 for tensorwise, e4m3 for rowwise)."""
    return FP8_RECIPES[recipe].grad_dtype


def left_dtype(recipe: str, contraction: str) -> torch.dtype:
    """The float8 of a GEMM's left operand, named by its contraction dim: x in the forward ("in") is e4m3, dz in the
    dgrad ("out") and dzᵀ in the wgrad ("tokens") are the recipe's gradient float8. (The right operand, W or x, is
    always e4m3.)"""
    return E4M3 if contraction == "in" else grad_dtype(recipe)


def to_float8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t · scale rounded to `dtype`, for a scale of t's own amax (scale_of, the same dtype): the product is in fp32
    (t upcast exactly) and within ±float8_max (|t| <= amax, scale <= float8_max / amax, at most an fp32 rounding
    above float8_max, which rounds to it), so torchao's saturating clamp (to_fp8_saturated) would change nothing and
    is left out: one pass fewer."""
    return (t * (scale if scale.dim() else scale.reshape(1))).to(dtype)  # ([1]: a 0-dim scale would not promote t)


def reducing_group(fp8: Fp8Scaling, contraction: str) -> dist.ProcessGroup | None:
    """The group to all-reduce a GEMM's amaxes over, or None when every rank's are already the serial ones."""
    if fp8.group is None or fp8.split is None or dist.get_world_size(fp8.group) == 1:
        return None
    # tensorwise: the weight (and one activation operand) is split; rowwise: only a split contraction dim matters
    return fp8.group if not FP8_RECIPES[fp8.recipe].rowwise or contraction == fp8.split else None


def _amax(t, dim, rowwise):
    """amax(|t|) along `dim` (kept) or over all of t, in one pass (the inf-norm); zeros where t is empty (an expert
    without rows)."""
    if not rowwise:
        return torch.linalg.vector_norm(t, float("inf")) if t.numel() else t.new_zeros(())
    shape = list(t.shape)
    shape[dim] = 1
    return torch.linalg.vector_norm(t, float("inf"), dim=dim, keepdim=True) if t.numel() else t.new_zeros(shape)


def operand_amaxes(a: torch.Tensor, b: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The amaxes a GEMM a [M, K] @ b [K, N] scales by: per row of a and column of b (rowwise) or two scalars."""
    rowwise = FP8_RECIPES[recipe].rowwise
    return _amax(a, 1, rowwise), _amax(b, 0, rowwise)  # [M, 1] and [1, N], or [] and []


def all_reduce_max(amaxes: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every tensor's elementwise MAX over the group (fp32), in one all-reduce."""
    both = torch.cat([t.reshape(-1).float() for t in amaxes])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return [piece.view(t.shape) for piece, t in zip(both.split([t.numel() for t in amaxes]), amaxes)]


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, fp8: Fp8Scaling, *, contraction: str,
                  out_dtype: torch.dtype, fused_cast: bool = False) -> torch.Tensor:
    """a [M, K] @ b [K, N] with both operands in float8 under the recipe's dynamic scales, in `out_dtype`.
    `contraction` names K among the linear's dims ("in", "out" or "tokens"), for the amax reduction and a's float8
    (left_dtype); `fused_cast`: quantize's."""
    amax_a, amax_b = _reduced_amaxes(a, b, fp8, contraction)
    return matmul_scaled_by(a, b, amax_a, amax_b, fp8.recipe, out_dtype=out_dtype, fused_cast=fused_cast,
                            a_dtype=left_dtype(fp8.recipe, contraction))


def _reduced_amaxes(a, b, fp8, contraction):
    """operand_amaxes, reduced over the group where the split needs it (one all-reduce for both)."""
    amax_a, amax_b = operand_amaxes(a, b, fp8.recipe)
    group = reducing_group(fp8, contraction)
    if group is not None:
        amax_a, amax_b = all_reduce_max([amax_a, amax_b], group)
    return amax_a, amax_b


class Quantized(NamedTuple):
    """A GEMM's operands in float8 (a: e4m3 or e5m2, b: e4m3), laid out as cuBLASLt takes them, and the scales that
    undo theirs."""
    a8: torch.Tensor        # [M, K'] row-major (K' = K padded to a multiple of 16)
    b8: torch.Tensor        # [K', N] column-major
    unscale_a: torch.Tensor  # [] or [M, 1], fp32
    unscale_b: torch.Tensor  # [] or [1, N], fp32


def quantize(a: torch.Tensor, b: torch.Tensor, amax_a: torch.Tensor, amax_b: torch.Tensor, recipe: str, *,
             fused_cast: bool = False, a_dtype: torch.dtype = E4M3) -> Quantized:
    """a [M, K] cast to `a_dtype` (left_dtype: e5m2 for a tensorwise dz) and b [K, N] to e4m3 under the recipe's
    scales of the given amaxes (operand_amaxes', reduced where a split needs it); `fused_cast`: each cast one Triton
    pass (kernels.fp8_cast, the same bits)."""
    rule = FP8_RECIPES[recipe]
    scale_a, scale_b = scale_of(amax_a, rule, a_dtype), scale_of(amax_b, rule)
    a8 = _cast(a, scale_a, a_dtype, column_major=False, fused_cast=fused_cast)  # (the wgrad's left operand is dzᵀ)
    b8 = _cast(b, scale_b, E4M3, column_major=True, fused_cast=fused_cast)
    return Quantized(*_padded(a8, b8), scale_a.reciprocal(), scale_b.reciprocal())


def _cast(t, scale, dtype, *, column_major, fused_cast):
    """t cast to `dtype` under `scale`, row-major (as cuBLASLt wants the left operand) or column-major (the right
    one); `fused_cast`: one Triton pass (kernels.fp8_cast, the same bits)."""
    if fused_cast:
        from . import fp8_cast  # (Triton, imported on first use)

        return fp8_cast.cast_to_float8(t, scale, dtype, column_major=column_major)
    t8 = to_float8(t, scale, dtype)
    return t8.t().contiguous().t() if column_major else t8.contiguous()


def _padded(a8, b8):
    """a8 [M, K] and b8 [K, N] with K zero-padded to a multiple of 16: only the wgrad's token dim can be ragged (zero
    rows change neither the sum nor an amax)."""
    if a8.shape[1] % MULTIPLE:
        pad = MULTIPLE - a8.shape[1] % MULTIPLE
        a8 = torch.cat([a8, a8.new_zeros(a8.shape[0], pad)], 1)
        b8 = torch.cat([b8, b8.new_zeros(pad, b8.shape[1])], 0).t().contiguous().t()
    return a8, b8


def check_out_dtype(recipe: str, out_dtype: torch.dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"fp8_recipe={recipe!r} computes in fp32, bf16 or fp16, not {out_dtype}")


def gemm(q: Quantized, recipe: str, out_dtype: torch.dtype) -> torch.Tensor:
    """The float8 GEMM of quantized operands through torch._scaled_mm, unscaled, in `out_dtype`."""
    check_out_dtype(recipe, out_dtype)
    if FP8_RECIPES[recipe].rowwise and out_dtype != torch.bfloat16:
        # cuBLASLt's rowwise kernel writes bf16 only: fp32 out through unit scales and the outer product of the
        # per-row and per-column unscales after (torchao's own fallback; exact with power-of-two scales)
        one = q.unscale_a.new_ones(())
        out = torch._scaled_mm(q.a8, q.b8, scale_a=one, scale_b=one, out_dtype=torch.float32)
        return out.mul_(q.unscale_a * q.unscale_b).to(out_dtype)
    return torch._scaled_mm(q.a8, q.b8, scale_a=q.unscale_a.contiguous(), scale_b=q.unscale_b.contiguous(),
                            out_dtype=out_dtype)


def matmul_scaled_by(a: torch.Tensor, b: torch.Tensor, amax_a: torch.Tensor, amax_b: torch.Tensor, recipe: str, *,
                     out_dtype: torch.dtype, fused_cast: bool = False, a_dtype: torch.dtype = E4M3) -> torch.Tensor:
    """a [M, K] @ b [K, N] in float8 (a in `a_dtype`, b in e4m3), each operand scaled by the recipe's scale of the
    given amaxes (operand_amaxes', reduced where a split needs it); `fused_cast`: quantize's."""
    check_out_dtype(recipe, out_dtype)
    if a.numel() == 0 or b.numel() == 0:  # no amax to take (an empty micro-batch, a zero-width shard)
        return (a.float() @ b.float()).to(out_dtype)
    return gemm(quantize(a, b, amax_a, amax_b, recipe, fused_cast=fused_cast, a_dtype=a_dtype), recipe, out_dtype)


# The primitives of kernels.ops (torch_ops' signatures) with their GEMMs in fp8.

# `fused_cast`: the operands' casts as one Triton pass each (kernels.ops passes kernels.ops.fused_kernels' answer).

def linear_forward(x, weight, bias=None, activation=None, *, fp8, fused_cast=False):
    """y = act(x @ weight.T + bias) -> (y, the pre-activation saved for backward, or None)."""
    z = scaled_matmul(x, weight.t(), fp8, contraction="in", out_dtype=x.dtype, fused_cast=fused_cast)
    return _epilogue(z, bias, activation)


def _epilogue(z, bias, activation):
    if bias is not None:
        z = z + bias.to(z.dtype)
    if activation is None:
        return z, None
    return torch_ops.activation_forward(z, activation), z


def linear_dgrad(grad_out, weight, preact=None, activation=None, *, fp8, need_input_grad=True, fused_cast=False):
    """-> (grad_input = dz @ weight, or None; dz = grad_out · act'(preact))."""
    dz = torch_ops.activation_backward(grad_out, preact, activation)
    if not need_input_grad:
        return None, dz
    return scaled_matmul(dz, weight, fp8, contraction="out", out_dtype=dz.dtype, fused_cast=fused_cast), dz


def linear_wgrad(dz, x, *, fp8, main_grad=None, fused_cast=False):
    """dW = dzᵀ @ x; with a main_grad, computed in fp32 and accumulated into it in place (None returned)."""
    if main_grad is None:
        return scaled_matmul(dz.t(), x, fp8, contraction="tokens", out_dtype=dz.dtype, fused_cast=fused_cast)
    main_grad.add_(scaled_matmul(dz.t(), x, fp8, contraction="tokens", out_dtype=torch.float32,
                                 fused_cast=fused_cast))
    return None


# A tensorwise linear casts its input x (to e4m3) and its output's gradient dz (to e5m2) once each: one scale per
# tensor, whichever GEMM reads it (the same amax, reduced over the same group), and one float8 (x is e4m3 in the
# forward and the wgrad, dz the left operand, e5m2, of both backward GEMMs). It keeps the casts for the wgrad: no
# second amax, cast or all-reduce there, and x is saved for backward at one byte an element. Rowwise scales along
# each GEMM's contraction dim, so each of its GEMMs casts its own operands.

class Fp8Operand(NamedTuple):
    """A linear's x or dz cast once to float8 (x: e4m3; dz: the recipe's gradient float8, e5m2) under its tensorwise
    scale, for each GEMM that reads it."""
    data: torch.Tensor      # float8 [rows, cols], row-major
    scale: torch.Tensor     # [] fp32: scale_of its amax, for data's dtype
    dtype: torch.dtype      # the operand's own (the GEMMs' output dtype)

    @property
    def unscale(self) -> torch.Tensor:
        return self.scale.reciprocal()  # (as quantize's)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device


def keeps_operands(fp8: Fp8Scaling | None) -> bool:
    """Whether a linear with this fp8 casts x and dz once for all its GEMMs (the tensorwise recipe)."""
    return fp8 is not None and not FP8_RECIPES[fp8.recipe].rowwise


def linear_forward_keeping_input(x, weight, bias=None, activation=None, *, fp8, fused_cast=False):
    """linear_forward for a tensorwise fp8 and non-empty operands -> (y, the pre-activation or None, x as an
    Fp8Operand for the wgrad)."""
    amax_x, amax_w = _reduced_amaxes(x, weight.t(), fp8, "in")
    q = quantize(x, weight.t(), amax_x, amax_w, fp8.recipe, fused_cast=fused_cast)
    x8 = Fp8Operand(q.a8, scale_of(amax_x, FP8_RECIPES[fp8.recipe]), x.dtype)
    return *_epilogue(gemm(q, fp8.recipe, x.dtype), bias, activation), x8


def linear_dgrad_keeping_grad(grad_out, weight, preact=None, activation=None, *, fp8, need_input_grad=True,
                              fused_cast=False):
    """linear_dgrad for a tensorwise fp8 and non-empty operands -> (grad_input or None, dz, dz as an Fp8Operand for
    the wgrad, or None without grad_input: the wgrad then casts dz itself)."""
    dz = torch_ops.activation_backward(grad_out, preact, activation)
    if not need_input_grad:
        return None, dz, None
    amax_dz, amax_w = _reduced_amaxes(dz, weight, fp8, "out")
    dtype = grad_dtype(fp8.recipe)
    q = quantize(dz, weight, amax_dz, amax_w, fp8.recipe, fused_cast=fused_cast, a_dtype=dtype)
    dz8 = Fp8Operand(q.a8, scale_of(amax_dz, FP8_RECIPES[fp8.recipe], dtype), dz.dtype)
    return gemm(q, fp8.recipe, dz.dtype), dz, dz8


def linear_wgrad_kept(dz, x: Fp8Operand, *, fp8, main_grad=None, fused_cast=False):
    """linear_wgrad on the input the forward kept and dz (an Fp8Operand the dgrad kept, else cast here): dzᵀ·x."""
    if not isinstance(dz, Fp8Operand):
        (dz,) = cast_tensorwise([dz], fp8, dtype=grad_dtype(fp8.recipe), fused_cast=fused_cast)
    out = kept_wgrad_gemm(dz, x, fp8.recipe, dz.dtype if main_grad is None else torch.float32)
    if main_grad is None:
        return out
    main_grad.add_(out)
    return None


def kept_wgrad_gemm(dz: Fp8Operand, x: Fp8Operand, recipe: str, out_dtype: torch.dtype) -> torch.Tensor:
    """dzᵀ·x [N, K] of kept casts dz [tokens, N] and x [tokens, K] (tokens zero-padded to a multiple of 16)."""
    a8, b8 = _padded(dz.data.t().contiguous(), x.data.t().contiguous().t())  # [N, tokens] row-, [tokens, K] col-major
    return gemm(Quantized(a8, b8, dz.unscale, x.unscale), recipe, out_dtype)


def cast_tensorwise(ts: list[torch.Tensor], fp8: Fp8Scaling, *, dtype: torch.dtype,
                    fused_cast: bool = False) -> list[Fp8Operand]:
    """Each t (a wgrad's dz, a group's rows of it: `dtype` the recipe's grad_dtype) cast to `dtype` under its own
    tensorwise scale, the amaxes all-reduced (one call) where the wgrad's split needs it."""
    amaxes = [_amax(t, None, False) for t in ts]
    group = reducing_group(fp8, "tokens")
    if group is not None:
        amaxes = all_reduce_max(amaxes, group)
    rule = FP8_RECIPES[fp8.recipe]
    return [cast_kept(t, scale_of(amax, rule, dtype), fused_cast=fused_cast, dtype=dtype)
            for t, amax in zip(ts, amaxes)]


def cast_kept(t: torch.Tensor, scale: torch.Tensor, *, fused_cast: bool = False,
              dtype: torch.dtype = E4M3) -> Fp8Operand:
    """t [rows, cols] cast to `dtype` under a tensorwise scale already taken for it (the forward's, for an x kept in
    its own dtype), as quantize casts a left operand: the same bits."""
    return Fp8Operand(_cast(t, scale, dtype, column_major=False, fused_cast=fused_cast), scale, t.dtype)
