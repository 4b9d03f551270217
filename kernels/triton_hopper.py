"""The Triton backend's entry (ops.BACKENDS["triton"]): persistent tensor-descriptor (TMA) GEMMs on Hopper (sm90),
kernels.triton_ops' kernels everywhere else. Same contract as kernels.torch_ops / kernels.triton_ops.

A call takes the kernels below when `runs_hopper` says its device is a 9.x GPU (and neither TP_KERNELS_HOPPER=0
nor use_hopper(False) has turned them off) and every operand meets TMA's rules: bf16 or fp16, a unit last stride, a
16-byte aligned base and leading stride (so feature widths a multiple of 8), no empty dimension. Anything else
(Ampere, fp32/fp64, odd strides or widths, CPU tensors under the interpreter) runs kernels.triton_ops, unchanged.

Kernels (each: min(#SMs, #tiles) programs, each looping over tiles pid, pid + #programs, ... in triton_ops'
grouped GROUP_SIZE_M order; per tile a K loop of descriptor loads (`cp.async.bulk.tensor`) into wgmma, pipelined
num_stages deep; the tile loop is flattened into the K loop (tl.range(flatten=True)) so the next tile's loads are in
flight during this tile's epilogue; out-of-bounds loads are zero-filled and stores clipped by the TMA unit, so there
are no masks; the fp32 epilogue of triton_ops, stored through descriptors):
- _fwd_kernel: y = act(x·Wᵀ + b) (activations.act_fwd), the pre-activation stored alongside, in two column halves;
- _swiglu_fwd_kernel: y = silu(gate)·up, gate and up from descriptors over the weight's two halves (so a partial
  gate tile never reads up rows), two accumulators;
- _dgrad_kernel: dx = dz·W, after triton_ops' elementwise act' pass (as there: fused into the GEMM it was 4-8x slower);
- _wgrad_kernel: dW = dzᵀ·x (dz read [tokens, N] and transposed in shared memory), or main_grad += dzᵀ·x with the
  fp32 main_grad tile loaded and stored through a descriptor (each tile owned by one program: no atomics).

Descriptors are built on the host (triton.tools.tensor_descriptor.TensorDescriptor, in Triton 3.6 and 3.9), their
block shape set by each config's pre_hook, which the autotuner calls before every launch: no device-side descriptor,
so no triton.set_allocator global scratch allocator. Warp specialisation (tl.range(warp_specialize=True)) is not
used: Triton's persistent-matmul tutorial enables it on capability >= 10 only (`supports_ws`), not on sm90.
"""
import functools
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import triton_ops
from .activations import act_fwd, swiglu_fwd
from .choice import token_bucket
from .configs import INTERPRET, persistent_configs, pruner
from .opaque import opaque_under_compile
from .torch_ops import check_activation
from .triton_ops import LAUNCHES, device_of, dot, tile_coords

__all__ = ["INTERPRET", "linear_forward", "linear_dgrad", "linear_wgrad", "hopper_device", "runs_hopper", "use_hopper"]

_TMA_DTYPES = (torch.bfloat16, torch.float16)
_INTERPRETER_PROGRAMS = 3  # under the interpreter: fewer programs than tiles, so each loops over several


@triton.jit
def _tile_origin(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    pid_m, pid_n = tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_SIZE_M)
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _mma(a_desc, b_desc, off_m, off_n, K, A_T: tl.constexpr, B_T: tl.constexpr, UPCAST: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc = A[off_m:, :K] · B[:K, off_n:] in fp32; A_T: A is stored [K, M], B_T: B is stored [N, K]."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        off_k = k * BLOCK_K
        if A_T:
            a = a_desc.load([off_k, off_m]).T
        else:
            a = a_desc.load([off_m, off_k])
        if B_T:
            b = b_desc.load([off_n, off_k]).T
        else:
            b = b_desc.load([off_k, off_n])
        acc = dot(a, b, acc, UPCAST, "tf32")
    return acc


@triton.jit
def halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] -> its left and right column halves."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def _add_bias(acc, b_ptr, off_n, N, BLOCK_N: tl.constexpr):
    cols = off_n + tl.arange(0, BLOCK_N)
    return acc + tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _store_act(acc, y_desc, z_desc, off_m, off_n, ACTIVATION: tl.constexpr, SAVE_PREACT: tl.constexpr):
    if SAVE_PREACT:
        z_desc.store([off_m, off_n], acc.to(z_desc.dtype))
    y_desc.store([off_m, off_n], act_fwd(acc, ACTIVATION).to(y_desc.dtype))


def block_hook(blocks):
    """A config pre_hook giving each descriptor argument its block shape: {name: "MK"} -> [BLOCK_M, BLOCK_K]
    ("H": BLOCK_N // 2, the forward's epilogue halves; "1": one expert of a grouped weight [E, ., .]). `blocks` may
    also be a function of the launch's arguments returning that dict."""
    def hook(nargs):
        sizes = {"M": nargs["BLOCK_M"], "N": nargs["BLOCK_N"], "K": nargs["BLOCK_K"], "H": nargs["BLOCK_N"] // 2,
                 "1": 1}
        for name, dims in (blocks(nargs) if callable(blocks) else blocks).items():
            nargs[name].block_shape = [sizes[d] for d in dims]
    return hook


# The pruners count the epilogue's staging on top of the operand stages: one output tile (the stores of y, z, ...
# take turns in one buffer: Triton waits for each TMA store before reusing it; seen in the AOT test's
# metadata.shared), two fp32 tiles for main_grad's load-add-store.
_FWD_HOOK = block_hook({"x_desc": "MK", "w_desc": "NK", "y_desc": "MH", "z_desc": "MH"})
_SWIGLU_HOOK = block_hook({"x_desc": "MK", "wg_desc": "NK", "wu_desc": "NK", "y_desc": "MN", "zg_desc": "MN",
                            "zu_desc": "MN"})
_DGRAD_HOOK = block_hook({"dz_desc": "MK", "w_desc": "KN", "dx_desc": "MN"})
_WGRAD_HOOK = block_hook({"dz_desc": "KM", "x_desc": "KN", "c_desc": "MN"})


@triton.autotune(configs=persistent_configs(_FWD_HOOK), key=["M_BUCKET", "N", "K", "ACTIVATION", "HAS_BIAS"],
                 prune_configs_by={"early_config_prune": pruner(epilogue_bytes=lambda c, elem: elem // 2)})
@triton.jit
def _fwd_kernel(x_desc, w_desc, b_ptr, y_desc, z_desc, M, N, K, M_BUCKET,
                ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE_PREACT: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        off_m, off_n = _tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_SIZE_M)
        acc = _mma(x_desc, w_desc, off_m, off_n, K, False, True, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
        if HAS_BIAS:
            acc = _add_bias(acc, b_ptr, off_n, N, BLOCK_N)
        # The epilogue in two column halves: half the registers for the activation's temporaries (128x256 tiles
        # spilled with GELU in one piece, tests/test_kernels_compile.py) and half the staging buffer.
        left, right = halves(acc, BLOCK_M, BLOCK_N)
        _store_act(left, y_desc, z_desc, off_m, off_n, ACTIVATION, SAVE_PREACT)
        _store_act(right, y_desc, z_desc, off_m, off_n + BLOCK_N // 2, ACTIVATION, SAVE_PREACT)


@triton.autotune(configs=persistent_configs(_SWIGLU_HOOK, small_tiles=True), key=["M_BUCKET", "F", "K", "HAS_BIAS"],
                 prune_configs_by={"early_config_prune": pruner(lambda c: (1, 2), epilogue_bytes=lambda c, e: e)})
@triton.jit
def _swiglu_fwd_kernel(x_desc, wg_desc, wu_desc, b_ptr, y_desc, zg_desc, zu_desc, M, F, K, M_BUCKET,
                       HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    # Output [M, F]; wg / wu: the weight's gate rows [0, F) and up rows [F, 2F); zg / zu: the pre-activation's halves.
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(F, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        off_m, off_n = _tile_origin(tile, M, F, BLOCK_M, BLOCK_N, GROUP_SIZE_M)
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = x_desc.load([off_m, k * BLOCK_K])
            acc_gate = dot(a, wg_desc.load([off_n, k * BLOCK_K]).T, acc_gate, UPCAST, "tf32")
            acc_up = dot(a, wu_desc.load([off_n, k * BLOCK_K]).T, acc_up, UPCAST, "tf32")
        if HAS_BIAS:
            acc_gate = _add_bias(acc_gate, b_ptr, off_n, F, BLOCK_N)
            acc_up = _add_bias(acc_up, b_ptr + F, off_n, F, BLOCK_N)
        zg_desc.store([off_m, off_n], acc_gate.to(zg_desc.dtype))
        zu_desc.store([off_m, off_n], acc_up.to(zu_desc.dtype))
        y_desc.store([off_m, off_n], swiglu_fwd(acc_gate, acc_up).to(y_desc.dtype))


@triton.autotune(configs=persistent_configs(_DGRAD_HOOK), key=["M_BUCKET", "N", "K"],
                 prune_configs_by={"early_config_prune": pruner(epilogue_bytes=lambda c, elem: elem)})
@triton.jit
def _dgrad_kernel(dz_desc, w_desc, dx_desc, M, N, K, M_BUCKET, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    # dx[M, N] = dz[M, K] · W[K, N]: N = the linear's in-features, K = its out-features (2F for swiglu).
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        off_m, off_n = _tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_SIZE_M)
        acc = _mma(dz_desc, w_desc, off_m, off_n, K, False, False, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
        dx_desc.store([off_m, off_n], acc.to(dx_desc.dtype))


# restore_value: autotuning runs the kernel once per config; main_grad (c, the tensor c_desc describes; the kernel
# only reads it through c_desc) is restored after each trial, or it would be accumulated into once per trial.
@triton.autotune(configs=persistent_configs(_WGRAD_HOOK), key=["M", "N", "K_BUCKET", "ACCUMULATE"],
                 prune_configs_by={"early_config_prune": pruner(
                     epilogue_bytes=lambda c, elem: 8 if c.get("ACCUMULATE") else elem)},
                 restore_value=["c"])
@triton.jit
def _wgrad_kernel(dz_desc, x_desc, c_desc, c, M, N, K, K_BUCKET, ACCUMULATE: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    # dW[M, N] = dzᵀ[M, K] · x[K, N]: M = out-features, N = in-features, K = tokens.
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        off_m, off_n = _tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_SIZE_M)
        acc = _mma(dz_desc, x_desc, off_m, off_n, K, True, False, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
        if ACCUMULATE:  # fp32 main_grad (checked on the host)
            acc += c_desc.load([off_m, off_n])
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


# ---------------------------------------------------------------------------------------------------------------
# Host launchers
# ---------------------------------------------------------------------------------------------------------------

_enabled = os.environ.get("TP_KERNELS_HOPPER", "1") != "0"


class use_hopper:
    """Whether Hopper GPUs run the persistent TMA kernels (the default; TP_KERNELS_HOPPER=0 starts with them off)
    or triton_ops' kernels, e.g. to compare the two: `use_hopper(False)` from now on, or `with use_hopper(False):`."""

    def __init__(self, enabled: bool) -> None:
        global _enabled
        self.previous, _enabled = _enabled, bool(enabled)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        global _enabled
        _enabled = self.previous


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def hopper_device(t: torch.Tensor) -> bool:
    """Whether t is on a CUDA device of capability 9.x (the tests swap this predicate to run the kernels under the
    interpreter)."""
    return t.is_cuda and _capability_major(t.device.index if t.device.index is not None else 0) == 9


def runs_hopper(t: torch.Tensor) -> bool:
    """Whether tensors like t take the persistent TMA kernels: on a Hopper GPU, with use_hopper on."""
    return _enabled and hopper_device(t)


def kernel_family(t: torch.Tensor) -> str:
    """Which kernels the Triton backend runs for tensors like t ("sm90-tma" or "sm80"): part of auto's measured key."""
    return "sm90-tma" if runs_hopper(t) else "sm80"


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def programs(t, tiles):
    """The persistent grid: one program per SM (never more than there are tiles)."""
    sms = _sm_count(t.device.index if t.device.index is not None else 0) if t.is_cuda else _INTERPRETER_PROGRAMS
    return lambda meta: (max(1, min(sms, tiles(meta["BLOCK_M"], meta["BLOCK_N"]))),)


def _grid(t, M, N):
    return programs(t, lambda bm, bn: triton.cdiv(M, bm) * triton.cdiv(N, bn))


def tma_ready(t):
    """TMA's rules for a global tensor (2-D to 5-D): unit last stride, 16-byte aligned base and other strides."""
    return 2 <= t.dim() <= 5 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and min(t.shape) > 0 \
        and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1])


def takes(operands, widths):
    """Whether a call on these operands (same device and 16-bit dtype, TMA-ready) with outputs of these row widths
    (elements; fresh contiguous allocations) runs the Hopper kernels."""
    first = operands[0]
    return runs_hopper(first) and first.dtype in _TMA_DTYPES and all(w > 0 and (w * first.element_size()) % 16 == 0
                                                                      for w in widths) \
        and all(t.dtype == first.dtype and t.device == first.device and tma_ready(t) for t in operands)


def descriptor(t):
    # The block shape is a placeholder: the chosen config's pre_hook sets it before the launch.
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1] * (t.dim() - 2) + [16, 16])


def upcast(dtype):
    return INTERPRET and dtype == torch.bfloat16  # triton_ops.flags' reason: the interpreter's bf16 dot


def _forward_shapes_ok(x, weight, bias, activation):
    M, K = x.shape if x.dim() == 2 else (0, 0)
    n_rows = weight.shape[0] if weight.dim() == 2 else 0
    if weight.dim() != 2 or weight.shape[1] != K or M == 0 or (activation == "swiglu" and n_rows % 2):
        return False
    return bias is None or (bias.shape == (n_rows,) and bias.dtype == x.dtype and bias.device == x.device)


def _linear_forward(x, weight, bias=None, activation=None):
    check_activation(activation)
    if not _forward_shapes_ok(x, weight, bias, activation):
        return triton_ops.linear_forward(x, weight, bias, activation)
    n_rows = weight.shape[0]
    N = n_rows // 2 if activation == "swiglu" else n_rows
    if not takes((x, weight), (N, n_rows)):
        return triton_ops.linear_forward(x, weight, bias, activation)
    M, K = x.shape
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    preact = None if activation is None else torch.empty(M, n_rows, dtype=x.dtype, device=x.device)
    b = x if bias is None else bias.contiguous()  # x: a dummy pointer when HAS_BIAS is off
    common = dict(M_BUCKET=token_bucket(M), HAS_BIAS=bias is not None, UPCAST=upcast(x.dtype))
    with device_of(x):
        if activation == "swiglu":
            LAUNCHES["hopper_swiglu_fwd"] += 1
            _swiglu_fwd_kernel[_grid(x, M, N)](
                descriptor(x), descriptor(weight[:N]), descriptor(weight[N:]), b, descriptor(y),
                descriptor(preact[:, :N]), descriptor(preact[:, N:]), M, N, K, **common)
        else:
            LAUNCHES["hopper_fwd"] += 1
            y_desc = descriptor(y)
            _fwd_kernel[_grid(x, M, N)](
                descriptor(x), descriptor(weight), b, y_desc, y_desc if preact is None else descriptor(preact), M, N, K,
                ACTIVATION=activation or "none", SAVE_PREACT=preact is not None, **common)
    return y, preact


def _linear_dgrad(grad_out, weight, preact=None, activation=None, *, need_input_grad=True):
    if not (need_input_grad and takes((grad_out, weight), (weight.shape[-1],))):
        return triton_ops.linear_dgrad(grad_out, weight, preact, activation, need_input_grad=need_input_grad)
    # triton_ops validates and runs the elementwise act' pass (dz is grad_out itself without an activation)
    _, dz = triton_ops.linear_dgrad(grad_out, weight, preact, activation, need_input_grad=False)
    if not takes((dz, weight), (weight.shape[1],)):  # an activation's dz [M, rows]: rows may break TMA's rules
        return triton_ops.linear_dgrad(dz, weight)[0], dz
    M, (n_rows, K) = dz.shape[0], weight.shape
    dx = torch.empty(M, K, dtype=dz.dtype, device=dz.device)
    LAUNCHES["hopper_dgrad"] += 1
    with device_of(dz):
        _dgrad_kernel[_grid(dz, M, K)](descriptor(dz), descriptor(weight), descriptor(dx), M, K, n_rows,
                                       token_bucket(M), UPCAST=upcast(dz.dtype))
    return dx, dz


def _linear_wgrad(dz, x, *, main_grad=None):
    N, K = (dz.shape[-1], x.shape[-1])
    fp32_grad = main_grad is None or (main_grad.dtype == torch.float32 and tma_ready(main_grad))
    if not (fp32_grad and dz.dim() == 2 and x.dim() == 2 and dz.shape[0] == x.shape[0]
            and takes((dz, x), (K,))):
        return triton_ops.linear_wgrad(dz, x, main_grad=main_grad)
    out = torch.empty(N, K, dtype=dz.dtype, device=dz.device) if main_grad is None else main_grad
    tokens = dz.shape[0]
    LAUNCHES["hopper_wgrad"] += 1
    with device_of(dz):
        _wgrad_kernel[_grid(dz, N, K)](descriptor(dz), descriptor(x), descriptor(out), out, N, K, tokens,
                                       token_bucket(tokens), ACCUMULATE=main_grad is not None,
                                       UPCAST=upcast(dz.dtype))
    return None if main_grad is not None else out


# ---------------------------------------------------------------- under torch.compile: one opaque op per primitive
# Dynamo cannot trace the host side above (TMA's alignment check reads a data pointer; descriptors, the autotuner's
# pre_hook), so a compiled graph calls each primitive as a custom op (kernels.opaque), as it would a cuBLAS GEMM.
# Outputs that may be None travel as a list of the present ones; an output that is an input (dz without an
# activation) stays outside.

@opaque_under_compile("hopper_forward")
def _forward_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                activation: str | None) -> list[torch.Tensor]:
    return [t for t in _linear_forward(x, weight, bias, activation) if t is not None]


@_forward_op.register_fake
def _(x, weight, bias, activation):
    n_rows = weight.shape[0]
    y = x.new_empty(x.shape[0], n_rows // 2 if activation == "swiglu" else n_rows)
    return [y] if activation is None else [y, x.new_empty(x.shape[0], n_rows)]


@opaque_under_compile("hopper_dgrad")
def _dgrad_op(grad_out: torch.Tensor, weight: torch.Tensor, preact: torch.Tensor | None,
              activation: str | None, need_input_grad: bool) -> list[torch.Tensor]:
    dx, dz = _linear_dgrad(grad_out, weight, preact, activation, need_input_grad=need_input_grad)
    return [t for t in (dx, None if activation is None else dz) if t is not None]


@_dgrad_op.register_fake
def _(grad_out, weight, preact, activation, need_input_grad):
    dx = [grad_out.new_empty(grad_out.shape[0], weight.shape[1])] if need_input_grad else []
    return dx + ([] if activation is None else [grad_out.new_empty(preact.shape)])


@opaque_under_compile("hopper_wgrad")
def _wgrad_op(dz: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return _linear_wgrad(dz, x)


@_wgrad_op.register_fake
def _(dz, x):
    return dz.new_empty(dz.shape[-1], x.shape[-1])


@opaque_under_compile("hopper_wgrad_into", mutates_args=("main_grad",))
def _wgrad_into_op(dz: torch.Tensor, x: torch.Tensor, main_grad: torch.Tensor) -> None:
    _linear_wgrad(dz, x, main_grad=main_grad)


@_wgrad_into_op.register_fake
def _(dz, x, main_grad):
    return None


def linear_forward(x, weight, bias=None, activation=None):
    """y = act(x @ weight.T + bias) -> (y, pre-activation or None); see torch_ops.linear_forward."""
    y, *preact = _forward_op(x, weight, bias, activation)
    return y, (preact[0] if preact else None)


def linear_dgrad(grad_out, weight, preact=None, activation=None, *, need_input_grad=True):
    """-> (grad_input = dz @ weight or None, dz = grad_out · act'(preact)); see torch_ops.linear_dgrad."""
    outs = _dgrad_op(grad_out, weight, preact, activation, need_input_grad)
    return (outs[0] if need_input_grad else None), (grad_out if activation is None else outs[-1])


def linear_wgrad(dz, x, *, main_grad=None):
    """dW = dzᵀ @ x, or accumulate it into main_grad in place and return None; see torch_ops.linear_wgrad."""
    if main_grad is None:
        return _wgrad_op(dz, x)
    _wgrad_into_op(dz, x, main_grad)
    return None
