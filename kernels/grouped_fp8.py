"""The grouped GEMM's three primitives (kernels.grouped) in float8: each group (expert) its own GEMM with its own
dynamic scales, the recipes of kernels.fp8 (tensorwise: one scale per expert's token rows and one per expert's
weight; rowwise: per token row and per weight row or column of each expert), one `torch._scaled_mm` per expert.

torch 2.13 has `torch._scaled_grouped_mm` but no CPU kernel for it (and on CUDA only rowwise scales on sm90+), so the
experts run in a loop of `torch._scaled_mm`, as kernels.fp8's linears. Under expert-tensor parallelism the scaling's
group is the etp group and its split the weight dim etp splits (fc1: "out", fc2: "in"): the amaxes that split
changes, every expert's, are all-reduced (MAX) in one all-reduce per GEMM, so the scales are the serial layer's.
Under torch.compile each primitive runs as a custom op (tp_kernels::grouped_fp8_*, the scaling passed by names), as
kernels.grouped's do: the loop needs the counts on the host, which a traced graph cannot read.
Each operand in the float8 kernels.fp8 gives it (x and W e4m3; dz, the dgrad's and the wgrad's left operand, in the
recipe's grad_dtype: e5m2 for tensorwise). Tensorwise experts cast x and dz once, as kernels.fp8's linears do: the
forward keeps each expert's e4m3 rows of x (one scale per expert, Fp8Operand's scale [E]) and the dgrad dz's e5m2
rows, and the wgrad multiplies those (same bits, no amax, cast or all-reduce there; x saved at one byte an element).
"""
import torch
import torch.distributed as dist

from . import fp8 as fp8_ops
from . import torch_ops
from .dtypes import FLOAT8
from .fp8 import Fp8Operand, Fp8Scaling, all_reduce_max, matmul_scaled_by, operand_amaxes, reducing_group
from .opaque import opaque_under_compile


def grouped_scaled_matmuls(pairs: list[tuple[torch.Tensor, torch.Tensor]], fp8: Fp8Scaling, *, contraction: str,
                           out_dtype: torch.dtype, fused_cast: bool = False, keep: bool = False
                           ) -> tuple[list[torch.Tensor], Fp8Operand | None]:
    """([a_e @ b_e] for each group's (a_e [M_e, K], b_e [K, N]), each with its own scales; with `keep` (tensorwise)
    the a_e's float8 casts [sum M_e, K] with their scales [E], else None). `contraction` names K among the weight's
    dims ("in", "out") or "tokens", for the amax reduction (kernels.fp8.reducing_group) and a_e's float8
    (kernels.fp8.left_dtype); `fused_cast`: kernels.fp8.quantize's."""
    fp8_ops.check_out_dtype(fp8.recipe, out_dtype)
    amaxes = [amax for a, b in pairs for amax in operand_amaxes(a, b, fp8.recipe)]
    group = reducing_group(fp8, contraction)
    if group is not None:  # every expert's amaxes in one all-reduce
        amaxes = all_reduce_max(amaxes, group)
    a_dtype = fp8_ops.left_dtype(fp8.recipe, contraction)
    if not keep:
        return [matmul_scaled_by(a, b, amaxes[2 * e], amaxes[2 * e + 1], fp8.recipe, out_dtype=out_dtype,
                                 fused_cast=fused_cast, a_dtype=a_dtype) for e, (a, b) in enumerate(pairs)], None
    rows = [a.shape[0] for a, _ in pairs]
    kept = pairs[0][0].new_empty(sum(rows), pairs[0][0].shape[1], dtype=a_dtype)  # (filled expert by expert)
    outs = []
    for (a, b), a8, e in zip(pairs, kept.split(rows), range(len(pairs))):
        if a.numel() == 0:  # (an expert without rows)
            outs.append(a.new_zeros(0, b.shape[1], dtype=out_dtype))
            continue
        q = fp8_ops.quantize(a, b, amaxes[2 * e], amaxes[2 * e + 1], fp8.recipe, fused_cast=fused_cast,
                             a_dtype=a_dtype)
        outs.append(fp8_ops.gemm(q, fp8.recipe, out_dtype))
        a8.copy_(q.a8)
    rule = fp8_ops.FP8_RECIPES[fp8.recipe]
    scales = torch.stack([fp8_ops.scale_of(amaxes[2 * e], rule, a_dtype) for e in range(len(pairs))])
    return outs, Fp8Operand(kept, scales, pairs[0][0].dtype)


def _rows(t, counts):
    return t.split(counts.tolist())  # (a device sync where the counts live on a GPU: the loop needs them)


def _eager_forward(x, weight, counts, activation, fp8, fused_cast, keep):
    pairs = [(x_e, w.t()) for x_e, w in zip(_rows(x, counts), weight)]
    zs, x8 = grouped_scaled_matmuls(pairs, fp8, contraction="in", out_dtype=x.dtype, fused_cast=fused_cast, keep=keep)
    z = torch.cat(zs)
    return (z, None, x8) if activation is None else (torch_ops.activation_forward(z, activation), z, x8)


def _eager_dgrad(dz, weight, counts, fp8, fused_cast, keep):
    pairs = [(dz_e, w) for dz_e, w in zip(_rows(dz, counts), weight)]
    dxs, dz8 = grouped_scaled_matmuls(pairs, fp8, contraction="out", out_dtype=dz.dtype, fused_cast=fused_cast,
                                      keep=keep)
    return torch.cat(dxs), dz8


def _eager_wgrad(dz, x, counts, fp8, main_grad, fused_cast, out_dtype):
    """dz and x tensors (each GEMM casts its operands), or x the forward's kept cast and dz the dgrad's (or a tensor,
    cast here): Fp8Operands."""
    out_dtype = out_dtype if main_grad is None else torch.float32
    if isinstance(x, Fp8Operand):
        if isinstance(dz, Fp8Operand):
            dz8 = _split(dz, counts, fused_cast)
        else:  # (the dgrad kept none: no input gradient)
            dz8 = fp8_ops.cast_tensorwise(list(_rows(dz, counts)), fp8, dtype=fp8_ops.grad_dtype(fp8.recipe),
                                          fused_cast=fused_cast)
        dw = torch.stack([fp8_ops.kept_wgrad_gemm(dz_e, x_e, fp8.recipe, out_dtype) if x_e.shape[0] else
                          x.data.new_zeros(dz_e.shape[1], x_e.shape[1], dtype=out_dtype)
                          for dz_e, x_e in zip(dz8, _split(x, counts, fused_cast))])
    else:
        pairs = [(dz_e.t(), x_e) for dz_e, x_e in zip(_rows(dz, counts), _rows(x, counts))]
        dw = torch.stack(grouped_scaled_matmuls(pairs, fp8, contraction="tokens", out_dtype=out_dtype,
                                                fused_cast=fused_cast)[0])
    if main_grad is None:
        return dw
    main_grad.add_(dw)
    return None


def _split(t8: Fp8Operand, counts, fused_cast):
    """A kept cast's groups as Fp8Operands, each with its scale; kept in its own dtype (an x its producer keeps: see
    kernels.linear.KEPT_BY_PRODUCER), each group cast again to e4m3 under its scale (the same bits)."""
    if t8.data.dtype in FLOAT8:
        return [Fp8Operand(rows, scale, t8.dtype) for rows, scale in zip(_rows(t8.data, counts), t8.scale)]
    return [fp8_ops.cast_kept(rows, scale, fused_cast=fused_cast) for rows, scale in zip(_rows(t8.data, counts),
                                                                                          t8.scale)]


# The primitives as kernels.opaque launchers (custom ops under torch.compile), the scaling passed as (recipe, the
# group's name or "", the split or "") since an op's schema takes no Fp8Scaling.

def _names(fp8):
    group = fp8.group
    return fp8.recipe, "" if group is None or dist.get_world_size(group) == 1 else group.group_name, fp8.split or ""


def _scaling(recipe, group, split):
    return Fp8Scaling(recipe, dist.distributed_c10d._resolve_process_group(group) if group else None, split or None)


# A kept cast crosses an op as two tensors, its data (float8: x's e4m3, dz's the recipe's grad_dtype; or x itself
# when its producer keeps it) and scales [E] (empty: not kept), and its dtype.

def _joined(t):
    return (t.data, t.scale) if isinstance(t, Fp8Operand) else (t, t.new_empty(0, dtype=torch.float32))


def _operand(data, scales, dtype):
    return Fp8Operand(data, scales, dtype) if scales.numel() else data


def _kept_or_empty(t8, like, dtype):
    """t8 joined, or (not kept) an empty `dtype` tensor, as _fake_kept's."""
    return _joined(t8 if t8 is not None else like.new_empty(0, dtype=dtype))


@opaque_under_compile("grouped_fp8_forward")
def _forward(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, activation: str | None, recipe: str,
             group: str, split: str, fused_cast: bool, keep: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    y, z, x8 = _eager_forward(x, weight, counts, activation, _scaling(recipe, group, split), fused_cast, keep)
    return y, x.new_empty(0) if z is None else z, *_kept_or_empty(x8, x, fp8_ops.E4M3)  # (none: empty tensors)


@_forward.register_fake
def _(x, weight, counts, activation, recipe, group, split, fused_cast, keep):
    n = weight.shape[1] // 2 if activation == "swiglu" else weight.shape[1]
    return (x.new_empty(x.shape[0], n), x.new_empty(0 if activation is None else (x.shape[0], weight.shape[1])),
            *_fake_kept(x, counts, keep, fp8_ops.E4M3))


def _fake_kept(t, counts, keep, dtype):
    """A kept cast's data (`dtype`: e4m3 for x, the recipe's grad_dtype for dz) and scales, or empty ones."""
    return (t.new_empty(t.shape if keep else 0, dtype=dtype),
            t.new_empty(counts.shape[0] if keep else 0, dtype=torch.float32))


@opaque_under_compile("grouped_fp8_dgrad")
def _dgrad(dz: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, recipe: str, group: str, split: str,
           fused_cast: bool, keep: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dz8 = _eager_dgrad(dz, weight, counts, _scaling(recipe, group, split), fused_cast, keep)
    return dx, *_kept_or_empty(dz8, dz, fp8_ops.grad_dtype(recipe))


@_dgrad.register_fake
def _(dz, weight, counts, recipe, group, split, fused_cast, keep):
    return dz.new_empty(dz.shape[0], weight.shape[2]), *_fake_kept(dz, counts, keep, fp8_ops.grad_dtype(recipe))


@opaque_under_compile("grouped_fp8_wgrad")
def _wgrad(dz: torch.Tensor, dz_scales: torch.Tensor, x: torch.Tensor, x_scales: torch.Tensor, counts: torch.Tensor,
           out_dtype: torch.dtype, recipe: str, group: str, split: str, fused_cast: bool) -> torch.Tensor:
    return _eager_wgrad(_operand(dz, dz_scales, out_dtype), _operand(x, x_scales, out_dtype), counts,
                        _scaling(recipe, group, split), None, fused_cast, out_dtype)


@_wgrad.register_fake
def _(dz, dz_scales, x, x_scales, counts, out_dtype, recipe, group, split, fused_cast):
    return dz.new_empty(counts.shape[0], dz.shape[1], x.shape[1], dtype=out_dtype)


@opaque_under_compile("grouped_fp8_wgrad_into", mutates_args=("main_grad",))
def _wgrad_into(dz: torch.Tensor, dz_scales: torch.Tensor, x: torch.Tensor, x_scales: torch.Tensor,
                counts: torch.Tensor, main_grad: torch.Tensor, out_dtype: torch.dtype, recipe: str, group: str,
                split: str, fused_cast: bool) -> None:
    _eager_wgrad(_operand(dz, dz_scales, out_dtype), _operand(x, x_scales, out_dtype), counts,
                 _scaling(recipe, group, split), main_grad, fused_cast, out_dtype)


@_wgrad_into.register_fake
def _(dz, dz_scales, x, x_scales, counts, main_grad, out_dtype, recipe, group, split, fused_cast):
    return None


def grouped_forward(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, activation: str | None, *,
                    fp8: Fp8Scaling, fused_cast: bool = False, keep: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None, Fp8Operand | None]:
    """(act(x_e @ weight_eᵀ) per group, x_e's rows counts[e]; the pre-activation or None; with `keep` (a
    tensorwise fp8: kernels.fp8.keeps_operands) x's per-expert e4m3 casts for the wgrad, else None); `fused_cast`:
    kernels.fp8.quantize's."""
    y, z, x8, scales = _forward(x, weight, counts, activation, *_names(fp8), fused_cast, keep)
    return y, None if activation is None else z, Fp8Operand(x8, scales, x.dtype) if keep else None


def grouped_dgrad(dz: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, *, fp8: Fp8Scaling,
                  fused_cast: bool = False, keep: bool = False) -> tuple[torch.Tensor, Fp8Operand | None]:
    """(dx_e = dz_e @ weight_e per group; with `keep`, dz's per-expert float8 casts (e5m2: tensorwise's grad_dtype)
    for the wgrad, else None)."""
    dx, dz8, scales = _dgrad(dz, weight, counts, *_names(fp8), fused_cast, keep)
    return dx, Fp8Operand(dz8, scales, dz.dtype) if keep else None


def grouped_wgrad(dz: torch.Tensor | Fp8Operand, x: torch.Tensor | Fp8Operand, counts: torch.Tensor, *,
                  fp8: Fp8Scaling, main_grad: torch.Tensor | None = None, fused_cast: bool = False
                  ) -> torch.Tensor | None:
    """dW_e = dz_eᵀ @ x_e [E, N, K]; with a main_grad, computed in fp32 and accumulated into it (None returned).
    x (and dz) may be the casts the forward (and the dgrad) kept."""
    out_dtype = dz.dtype
    if main_grad is None:
        return _wgrad(*_joined(dz), *_joined(x), counts, out_dtype, *_names(fp8), fused_cast)
    _wgrad_into(*_joined(dz), *_joined(x), counts, main_grad, out_dtype, *_names(fp8), fused_cast)
    return None
