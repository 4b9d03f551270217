"""The grouped GEMM's three primitives (kernels.grouped) in float8: each group (expert) its own GEMM with its own
dynamic scales, the recipes of kernels.fp8 (tensorwise: one scale per expert's token rows and one per expert's
weight; rowwise: per token row and per weight row or column of each expert), one `torch._scaled_mm` per expert.

torch 2.13 has `torch._scaled_grouped_mm` but no CPU kernel for it (and on CUDA only rowwise scales on sm90+), so the
experts run in a loop of `torch._scaled_mm`, as kernels.fp8's linears. Under expert-tensor parallelism the scaling's
group is the etp group and its split the weight dim etp splits (fc1: "out", fc2: "in"): the amaxes that split
changes, every expert's, are all-reduced (MAX) in one all-reduce per GEMM, so the scales are the serial layer's.
Under torch.compile each primitive runs as a custom op (tp_kernels::grouped_fp8_*, the scaling passed by names), as
kernels.grouped's do: the loop needs the counts on the host, which a traced graph cannot read.
"""
import torch
import torch.distributed as dist

from . import torch_ops
from .fp8 import Fp8Scaling, all_reduce_max, matmul_scaled_by, operand_amaxes, reducing_group
from .opaque import opaque_under_compile


def grouped_scaled_matmuls(pairs: list[tuple[torch.Tensor, torch.Tensor]], fp8: Fp8Scaling, *, contraction: str,
                           out_dtype: torch.dtype, fused_cast: bool = False) -> list[torch.Tensor]:
    """[a_e @ b_e] for each group's (a_e [M_e, K], b_e [K, N]), each with its own scales; `contraction` names K
    among the weight's dims ("in", "out") or "tokens", for the amax reduction (kernels.fp8.reducing_group);
    `fused_cast`: kernels.fp8.quantize's."""
    amaxes = [amax for a, b in pairs for amax in operand_amaxes(a, b, fp8.recipe)]
    group = reducing_group(fp8, contraction)
    if group is not None:  # every expert's amaxes in one all-reduce
        amaxes = all_reduce_max(amaxes, group)
    return [matmul_scaled_by(a, b, amaxes[2 * e], amaxes[2 * e + 1], fp8.recipe, out_dtype=out_dtype,
                             fused_cast=fused_cast) for e, (a, b) in enumerate(pairs)]


def _rows(t, counts):
    return t.split(counts.tolist())  # (a device sync where the counts live on a GPU: the loop needs them)


def _eager_forward(x, weight, counts, activation, fp8, fused_cast):
    pairs = [(x_e, w.t()) for x_e, w in zip(_rows(x, counts), weight)]
    z = torch.cat(grouped_scaled_matmuls(pairs, fp8, contraction="in", out_dtype=x.dtype, fused_cast=fused_cast))
    return (z, None) if activation is None else (torch_ops.activation_forward(z, activation), z)


def _eager_dgrad(dz, weight, counts, fp8, fused_cast):
    pairs = [(dz_e, w) for dz_e, w in zip(_rows(dz, counts), weight)]
    return torch.cat(grouped_scaled_matmuls(pairs, fp8, contraction="out", out_dtype=dz.dtype, fused_cast=fused_cast))


def _eager_wgrad(dz, x, counts, fp8, main_grad, fused_cast):
    pairs = [(dz_e.t(), x_e) for dz_e, x_e in zip(_rows(dz, counts), _rows(x, counts))]
    out_dtype = dz.dtype if main_grad is None else torch.float32
    dw = torch.stack(grouped_scaled_matmuls(pairs, fp8, contraction="tokens", out_dtype=out_dtype,
                                            fused_cast=fused_cast))
    if main_grad is None:
        return dw
    main_grad.add_(dw)
    return None


# The primitives as kernels.opaque launchers (custom ops under torch.compile), the scaling passed as (recipe, the
# group's name or "", the split or "") since an op's schema takes no Fp8Scaling.

def _names(fp8):
    group = fp8.group
    return fp8.recipe, "" if group is None or dist.get_world_size(group) == 1 else group.group_name, fp8.split or ""


def _scaling(recipe, group, split):
    return Fp8Scaling(recipe, dist.distributed_c10d._resolve_process_group(group) if group else None, split or None)


@opaque_under_compile("grouped_fp8_forward")
def _forward(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, activation: str | None, recipe: str,
             group: str, split: str, fused_cast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    y, z = _eager_forward(x, weight, counts, activation, _scaling(recipe, group, split), fused_cast)
    return y, x.new_empty(0) if z is None else z  # (no pre-activation: an empty tensor)


@_forward.register_fake
def _(x, weight, counts, activation, recipe, group, split, fused_cast):
    n = weight.shape[1] // 2 if activation == "swiglu" else weight.shape[1]
    return x.new_empty(x.shape[0], n), x.new_empty(0 if activation is None else (x.shape[0], weight.shape[1]))


@opaque_under_compile("grouped_fp8_dgrad")
def _dgrad(dz: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, recipe: str, group: str, split: str,
           fused_cast: bool) -> torch.Tensor:
    return _eager_dgrad(dz, weight, counts, _scaling(recipe, group, split), fused_cast)


@_dgrad.register_fake
def _(dz, weight, counts, recipe, group, split, fused_cast):
    return dz.new_empty(dz.shape[0], weight.shape[2])


@opaque_under_compile("grouped_fp8_wgrad")
def _wgrad(dz: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, recipe: str, group: str, split: str,
           fused_cast: bool) -> torch.Tensor:
    return _eager_wgrad(dz, x, counts, _scaling(recipe, group, split), None, fused_cast)


@_wgrad.register_fake
def _(dz, x, counts, recipe, group, split, fused_cast):
    return dz.new_empty(counts.shape[0], dz.shape[1], x.shape[1])


@opaque_under_compile("grouped_fp8_wgrad_into", mutates_args=("main_grad",))
def _wgrad_into(dz: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, main_grad: torch.Tensor, recipe: str,
                group: str, split: str, fused_cast: bool) -> None:
    _eager_wgrad(dz, x, counts, _scaling(recipe, group, split), main_grad, fused_cast)


@_wgrad_into.register_fake
def _(dz, x, counts, main_grad, recipe, group, split, fused_cast):
    return None


def grouped_forward(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, activation: str | None, *,
                    fp8: Fp8Scaling, fused_cast: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(act(x_e @ weight_eᵀ), the pre-activation or None) per group, x_e's rows counts[e]; `fused_cast`:
    kernels.fp8.quantize's."""
    y, z = _forward(x, weight, counts, activation, *_names(fp8), fused_cast)
    return y, None if activation is None else z


def grouped_dgrad(dz: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, *, fp8: Fp8Scaling,
                  fused_cast: bool = False) -> torch.Tensor:
    """dx_e = dz_e @ weight_e per group."""
    return _dgrad(dz, weight, counts, *_names(fp8), fused_cast)


def grouped_wgrad(dz: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, *, fp8: Fp8Scaling,
                  main_grad: torch.Tensor | None = None, fused_cast: bool = False) -> torch.Tensor | None:
    """dW_e = dz_eᵀ @ x_e [E, N, K]; with a main_grad, computed in fp32 and accumulated into it (None returned)."""
    if main_grad is None:
        return _wgrad(dz, x, counts, *_names(fp8), fused_cast)
    _wgrad_into(dz, x, counts, main_grad, *_names(fp8), fused_cast)
    return None
