"""kernels.grouped_linear: act(x_e @ W_eᵀ) over contiguous row groups, one weight per group (the experts of a
mixture-of-experts layer, tokens sorted by expert).

x [M, K] holds the groups' rows back to back, `counts` (E host integers, or an int tensor [E]) their sizes, weight
[E, N, K] one nn.Linear orientation weight per group (HF's fused expert layout: gate_up_proj [E, 2F, H], down_proj
[E, H, F]). Three primitives, dispatched like kernels.linear's (Triton on CUDA or under TRITON_INTERPRET=1, torch
otherwise): forward (activation fused), dgrad (dz = g·act'(z), then dx_e = dz_e · W_e), wgrad (dW_e = dz_eᵀ · x_e,
accumulated into an fp32 `weight.main_grad` [E, N, K] when it exists). The torch path uses `torch._grouped_mm` where
this torch runs it (fp32 / bf16 / fp16 on the CPU, bf16 on CUDA, 16-byte aligned row strides), else a loop over the
groups. Under backend "auto" on CUDA each primitive call runs the faster of the two for its key (kernels.choice:
measured once per primitive, dtype, activation, token bucket, weight shape and device, on evenly split groups). Under
torch.compile each primitive runs as a custom op (tp_kernels::grouped_*): a grouped GEMM whose rows and counts are
only known at run time (an expert dispatch's output) traces without a graph break. `fp8=` on the primitives
(`fp8_recipe=` on grouped_linear) runs each expert's GEMMs in float8 (kernels.grouped_fp8; docs/fp8.md).
"""
import functools

import torch

from . import choice, grouped_fp8, ops, torch_ops
from . import fp8 as fp8_ops
from .first_order import first_order
from .fp8 import Fp8Scaling
from .linear import KEPT_BY_PRODUCER
from .opaque import opaque_under_compile

Counts = list[int] | torch.Tensor


def _as_tensor(counts):
    """Rows per group as an int64 tensor: host integers become a CPU tensor (reading it back costs no sync)."""
    return counts if isinstance(counts, torch.Tensor) else torch.tensor(counts, dtype=torch.int64)


def _offsets(counts, device):
    """[E + 1] int32 group boundaries on the device (one small copy where the counts are on the host)."""
    return torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(device=device, dtype=torch.int32)


def _aligned(t):
    """Row- or column-major (per matrix), the other stride a multiple of 16 bytes: what torch._grouped_mm takes."""
    rows, cols = t.stride(-2), t.stride(-1)
    return (cols == 1 and rows * t.element_size() % 16 == 0) or (rows == 1 and cols * t.element_size() % 16 == 0)


def _ranges(counts):
    start = 0
    for e, n in enumerate(counts.tolist()):  # (a device sync where the counts live on a GPU: the loop needs them)
        yield e, start, start + n
        start += n


def _grouped_mm_runs(a, b):
    """Whether torch._grouped_mm takes a and b: fp32 / bf16 / fp16 on the CPU, bf16 on CUDA (CUTLASS kernels on
    sm90 / sm100, torch's own loop over the groups elsewhere), 16-byte aligned strides."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16) if a.device.type == "cpu" else \
        (torch.bfloat16,) if a.is_cuda else ()
    return hasattr(torch, "_grouped_mm") and a.dtype == b.dtype and a.dtype in dtypes and _aligned(a) and _aligned(b)


def _torch_gemm(a, b, counts):
    """a_e @ b_e per group, for b [E, K, N] (any strides): torch._grouped_mm where it runs, else a loop."""
    if _grouped_mm_runs(a, b):
        return torch._grouped_mm(a, b, offs=_offsets(counts, a.device)[1:])
    out = a.new_empty(a.shape[0], b.shape[2])
    for e, lo, hi in _ranges(counts):
        torch.mm(a[lo:hi], b[e], out=out[lo:hi])
    return out


def _torch_wgrad(dz, x, counts, main_grad):
    dw = dz.new_empty(len(counts), dz.shape[1], x.shape[1]) if main_grad is None else None
    for e, lo, hi in _ranges(counts):
        if main_grad is not None:
            torch_ops.accumulate_mm(main_grad[e], dz[lo:hi].t(), x[lo:hi])
        else:
            torch.mm(dz[lo:hi].t(), x[lo:hi], out=dw[e])
    return dw


class _Torch:
    """torch's grouped GEMMs: torch._grouped_mm where it runs, else a loop over the groups."""

    @staticmethod
    def forward(x, weight, counts, activation):
        z = _torch_gemm(x, weight.transpose(1, 2), counts)
        return (z, None) if activation is None else (torch_ops.activation_forward(z, activation), z)

    @staticmethod
    def dgrad(dz, weight, counts):
        return _torch_gemm(dz, weight, counts)

    wgrad = staticmethod(_torch_wgrad)  # (tests/test_host_syncs.py knows its host read by this name)


class _Triton:
    """kernels.grouped_hopper: the sm90 TMA kernels, or kernels.grouped_triton's wherever those do not run."""

    @staticmethod
    def forward(x, weight, counts, activation):
        return _triton().grouped_gemm(x, weight, _offsets(counts, x.device), activation)

    @staticmethod
    def dgrad(dz, weight, counts):
        return _triton().grouped_gemm(dz, weight, _offsets(counts, dz.device), transpose_b=True)[0]

    @staticmethod
    def wgrad(dz, x, counts, main_grad):
        return _triton().grouped_wgrad(dz, x, _offsets(counts, dz.device), len(counts), main_grad=main_grad)


def _triton():
    from . import grouped_hopper

    return grouped_hopper


# The two implementations, by the answer of kernels.ops.backend_for (the backend the linears would run).
_IMPLEMENTATIONS = {"torch": _Torch, "triton": _Triton}


def _implementation(op, rows, weight_shape, activation=None, main_grad=False):
    """The implementation for one call on `rows` (x, or dz) with a weight [E, N, K]: ops.backend_for's, except under
    "auto" on a measurable (CUDA) device, where it is the faster of the two for the call's key, measured at its
    first use (kernels.choice)."""
    name = ops.backend_for(rows)
    groups, N, K = weight_shape
    if name == "triton" and ops.get_backend() == "auto" and choice.measurable(rows) and rows.shape[0] \
            and groups * N * K:
        family = getattr(ops.BACKENDS["triton"](), "kernel_family", None)
        key = choice.make_key(op, rows, N, K, activation=activation, main_grad=main_grad,
                              kernels=family(rows) if family else "", groups=groups)
        name = choice.choose(key, _IMPLEMENTATIONS, rows.device, call=_measured_call)
    return _IMPLEMENTATIONS[name]


def _measured_call(key, device):
    """implementation -> one run of the key's grouped primitive on operands of its shape, the rows split evenly."""
    dtype = getattr(torch, key.dtype)
    make = functools.partial(torch.randn, device=device, dtype=dtype)
    rows, groups = key.tokens, key.groups
    counts = torch.tensor([rows // groups + (e < rows % groups) for e in range(groups)])
    weight, x, dz = make(groups, key.N, key.K), make(rows, key.K), make(rows, key.N)
    if key.op == "grouped_forward":
        return lambda impl: impl.forward(x, weight, counts, key.activation)
    if key.op == "grouped_dgrad":
        return lambda impl: impl.dgrad(dz, weight, counts)
    grad_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    main_grad = torch.zeros(weight.shape, device=device, dtype=grad_dtype) if key.main_grad else None
    return lambda impl: impl.wgrad(dz, x, counts, main_grad)


@opaque_under_compile("grouped_forward")
def _forward(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
             activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    impl = _implementation("grouped_forward", x, weight.shape, activation)
    y, z = impl.forward(x, weight, counts, activation)
    return y, x.new_empty(0) if z is None else z  # (no pre-activation: an empty tensor)


@opaque_under_compile("grouped_dgrad")
def _dgrad(dz: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return _implementation("grouped_dgrad", dz, weight.shape).dgrad(dz, weight, counts)


@opaque_under_compile("grouped_wgrad")
def _wgrad(dz: torch.Tensor, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    weight_shape = (counts.shape[0], dz.shape[1], x.shape[1])
    return _implementation("grouped_wgrad", dz, weight_shape).wgrad(dz, x, counts, None)


@opaque_under_compile("grouped_wgrad_into", mutates_args=("main_grad",))
def _wgrad_into(dz: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, main_grad: torch.Tensor) -> None:
    _implementation("grouped_wgrad", dz, main_grad.shape, main_grad=True).wgrad(dz, x, counts, main_grad)


@_forward.register_fake
def _(x, weight, counts, activation):
    n = weight.shape[1] // 2 if activation == "swiglu" else weight.shape[1]
    return x.new_empty(x.shape[0], n), x.new_empty(0 if activation is None else (x.shape[0], weight.shape[1]))


@_dgrad.register_fake
def _(dz, weight, counts):
    return dz.new_empty(dz.shape[0], weight.shape[2])


@_wgrad.register_fake
def _(dz, x, counts):
    return dz.new_empty(counts.shape[0], dz.shape[1], x.shape[1])


@_wgrad_into.register_fake
def _(dz, x, counts, main_grad):
    return None


def grouped_forward(x: torch.Tensor, weight: torch.Tensor, counts: Counts, activation: str | None = None, *,
                    fp8: Fp8Scaling | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(act(x_e @ weight_eᵀ) [M, N], the pre-activation saved for backward or None); "swiglu": weight [E, 2F, K]
    (gate rows first) gives [M, F]. `fp8`: each group's GEMM in float8 with its own scales (kernels.grouped_fp8)."""
    ops.check_activation(activation)
    _check(x, weight, counts)
    if fp8 is not None:  # (eager: a loop of torch._scaled_mm over the groups)
        return grouped_fp8.grouped_forward(x, weight, _as_tensor(counts), activation, fp8=fp8,
                                           fused_cast=ops.fused_kernels(x.device))[:2]
    y, z = _forward(x, weight, _as_tensor(counts), activation)
    return y, None if activation is None else z


def grouped_dgrad(grad_out: torch.Tensor, weight: torch.Tensor, counts: Counts, preact: torch.Tensor | None = None,
                  activation: str | None = None, *, need_input_grad: bool = True,
                  fp8: Fp8Scaling | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(dx [M, K] = dz_e @ weight_e per group, or None; dz = grad_out · act'(preact))."""
    dz = torch_ops.activation_backward(grad_out, preact, activation)
    if not need_input_grad:
        return None, dz
    if fp8 is not None:
        return grouped_fp8.grouped_dgrad(dz, weight, _as_tensor(counts), fp8=fp8,
                                         fused_cast=ops.fused_kernels(dz.device))[0], dz
    return _dgrad(dz, weight, _as_tensor(counts)), dz


# A tensorwise fp8 grouped GEMM casts each expert's x and dz once (kernels.grouped_fp8): its Function keeps those
# casts for the wgrad, which then takes them in place of x and dz.

def forward_keeping_input(x: torch.Tensor, weight: torch.Tensor, counts: Counts, activation: str | None, *,
                          fp8: Fp8Scaling | None) -> tuple[torch.Tensor, torch.Tensor | None,
                                                           torch.Tensor | fp8_ops.Fp8Operand]:
    """grouped_forward -> (y, the pre-activation or None, the x its wgrad takes: x's kept cast under a tensorwise
    fp8 (holding x itself when x carries KEPT_BY_PRODUCER), else x)."""
    if not fp8_ops.keeps_operands(fp8):
        return *grouped_forward(x, weight, counts, activation, fp8=fp8), x
    _check(x, weight, counts)
    y, preact, x8 = grouped_fp8.grouped_forward(x, weight, _as_tensor(counts), activation, fp8=fp8, keep=True,
                                                fused_cast=ops.fused_kernels(x.device))
    if getattr(x, KEPT_BY_PRODUCER, False):  # x itself, no e4m3 copy beside it: cast again in the wgrad
        x8 = x8._replace(data=x)
    return y, preact, x8


def dgrad_keeping_grad(grad_out: torch.Tensor, weight: torch.Tensor, counts: Counts,
                       preact: torch.Tensor | None, activation: str | None, *, need_input_grad: bool,
                       fp8: Fp8Scaling | None) -> tuple[torch.Tensor | None, torch.Tensor | fp8_ops.Fp8Operand]:
    """grouped_dgrad -> (dx or None, the dz its wgrad takes: dz's kept cast under a tensorwise fp8 with dx, else
    dz)."""
    if not (need_input_grad and fp8_ops.keeps_operands(fp8)):
        return grouped_dgrad(grad_out, weight, counts, preact, activation, need_input_grad=need_input_grad, fp8=fp8)
    dz = torch_ops.activation_backward(grad_out, preact, activation)
    return grouped_fp8.grouped_dgrad(dz, weight, _as_tensor(counts), fp8=fp8, keep=True,
                                     fused_cast=ops.fused_kernels(dz.device))


def saved_operand(t: torch.Tensor | fp8_ops.Fp8Operand) -> tuple[torch.Tensor, ...]:
    """The tensors a Function saves for an operand: itself, or a kept cast's data and scales (operand() undoes)."""
    return (t.data, t.scale) if isinstance(t, fp8_ops.Fp8Operand) else (t,)


def operand(saved: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor | fp8_ops.Fp8Operand:
    """The operand saved_operand saved (`dtype`: its own, for a kept cast)."""
    return fp8_ops.Fp8Operand(*saved, dtype) if len(saved) == 2 else saved[0]


def grouped_wgrad(dz: torch.Tensor | fp8_ops.Fp8Operand, x: torch.Tensor | fp8_ops.Fp8Operand, counts: Counts, *,
                  main_grad: torch.Tensor | None = None, fp8: Fp8Scaling | None = None) -> torch.Tensor | None:
    """dW [E, N, K], dW_e = dz_eᵀ @ x_e; with a main_grad (fp32 [E, N, K]), accumulated into it and None returned.
    Under a tensorwise fp8, x (and dz) may be the casts the forward (and the dgrad) kept (forward_keeping_input)."""
    counts = _as_tensor(counts)
    if main_grad is None:
        if fp8 is None:
            return _wgrad(dz, x, counts)
        return grouped_fp8.grouped_wgrad(dz, x, counts, fp8=fp8, fused_cast=ops.fused_kernels(dz.device))
    ops.check_main_grad(main_grad, (len(counts), dz.shape[1], x.shape[1]), dz.device)
    if fp8 is None:
        _wgrad_into(dz, x, counts, main_grad)
    else:
        grouped_fp8.grouped_wgrad(dz, x, counts, fp8=fp8, main_grad=main_grad, fused_cast=ops.fused_kernels(dz.device))
    hook = getattr(main_grad, "post_accumulate_hook", None)  # (as kernels.linear_wgrad: tp.optim counts arrivals)
    if hook is not None:
        hook()
    return None


def _check(x, weight, counts):
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"grouped linear needs x [M, K] and weight [E, N, K], got x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}")
    if isinstance(counts, torch.Tensor):  # (their sum is not read: that would be a host sync)
        if counts.dim() != 1 or counts.shape[0] != weight.shape[0] or counts.is_floating_point():
            raise ValueError(f"counts must be an integer tensor [{weight.shape[0]}], got {counts.dtype} "
                             f"{tuple(counts.shape)}")
    elif len(counts) != weight.shape[0] or sum(counts) != x.shape[0] or min(counts, default=0) < 0:
        raise ValueError(f"counts {list(counts)} must give the rows of each of the {weight.shape[0]} groups, "
                         f"summing to x's {x.shape[0]} rows")


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, counts, activation, fp8):
        ctx.main_grad = getattr(weight, "main_grad", None)  # on the parameter, not on an autocast copy of it
        if torch.compiler.is_compiling() and getattr(weight, "folds_grad_into_main_grad", False):
            ctx.main_grad = None  # (.grad's hook folds it in: a compiled backward cannot run main_grad's hook)
        x, weight, _ = ops.autocast_operands(x, weight)
        y, preact, x_for_w = forward_keeping_input(x, weight, counts, activation, fp8=fp8)
        ctx.save_for_backward(weight, preact, counts, *saved_operand(x_for_w))  # (x, or its e4m3 cast)
        ctx.activation, ctx.fp8, ctx.x_dtype = activation, fp8, x.dtype
        return y

    @staticmethod
    @first_order
    def backward(ctx, grad_y):
        weight, preact, counts, *x = ctx.saved_tensors
        dx, dz = dgrad_keeping_grad(grad_y.to(weight.dtype).contiguous(), weight, counts, preact, ctx.activation,
                                    need_input_grad=ctx.needs_input_grad[0], fp8=ctx.fp8)
        dw = (grouped_wgrad(dz, operand(x, ctx.x_dtype), counts, main_grad=ctx.main_grad, fp8=ctx.fp8)
              if ctx.needs_input_grad[1] else None)
        return dx, dw, None, None, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: Counts, *, activation: str | None = None,
                   fp8_recipe: str | None = None) -> torch.Tensor:
    """act(x_e @ weight_eᵀ) for the row groups of x [M, K] (sizes `counts`: host integers, or an int tensor [E] on
    any device whose sum is not checked) and weight [E, N, K]: [M, N] (SwiGLU: weight [E, 2F, K], gate rows first,
    output [M, F]). With `weight.main_grad` (fp32 [E, N, K]) the weight gradient is accumulated there and
    weight.grad is left untouched. `fp8_recipe` (kernels.FP8_RECIPES): each expert's three GEMMs in float8 (x and
    the weight e4m3, the output gradient as the recipe says: kernels.fp8)."""
    ops.check_activation(activation)
    _check(x, weight, counts)
    fp8_ops.check_features(fp8_recipe, weight.shape[2], weight.shape[1], "the grouped weight")
    return _GroupedLinear.apply(x, weight, _as_tensor(counts), activation, fp8_recipe and Fp8Scaling(fp8_recipe))
