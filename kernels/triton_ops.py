"""Triton implementation of the four local-matmul primitives (same contract as torch_ops).

Kernels, in the order the autograd Function uses them:
- _linear_fwd_kernel / _swiglu_fwd_kernel: y = act(x·Wᵀ + b), bias and activation in the fp32 epilogue, the
  pre-activation stored alongside (the backward needs act'(z); recomputing z would cost a whole extra GEMM, storing
  it costs one [M, N] write). SwiGLU keeps two accumulators per tile (weight rows n and n+F) so x is read once.
- _act_bwd_kernel: dz = g·act'(z), one elementwise pass; wgrad, dbias and dgrad all read this dz.
- _linear_dgrad_kernel: dx = dz·W, a plain GEMM. (Computing act' while loading the GEMM's A operand, as this file
  once did, redoes it for every output-column tile and keeps fp32 elementwise work inside the main loop: on an H200
  that dgrad ran at 0.13x torch's speed for GELU and 0.23x for SwiGLU; the separate pass costs one read and one write
  of [M, N].)
- _linear_wgrad_kernel: dW = dzᵀ·x, optionally load-add-store into an fp32 main_grad (α = β = 1).

Every GEMM kernel: grouped tile order, fp32 accumulator (fp64 for fp64 inputs), K-masks only (rows and columns are
wrapped with % so loads stay in bounds and unmasked; the stores are masked), one cast at the store.
Shapes follow each GEMM's own M×N output and K reduction; the launchers say how they map onto the linear's dims.
"""
import collections
import contextlib

import torch
import triton
import triton.language as tl

from .activations import act_bwd, act_fwd, swiglu_bwd, swiglu_fwd
from .choice import token_bucket  # the autotune key's token bucket, shared with auto's measured choice
from .configs import INTERPRET, check_interpreter, matmul_configs, pruner
from .dtypes import TRITON_DTYPES
from .torch_ops import check_activation

# Launches per kernel name; the tests assert it grows to prove the Triton path ran.
LAUNCHES = collections.Counter()

_PRUNE = {"early_config_prune": pruner()}
_PRUNE_SWIGLU = {"early_config_prune": pruner(lambda constexprs: (1, 2))}  # gate and up weight tiles


@triton.jit
def _tile_coords(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    # Programs sweep GROUP_SIZE_M row tiles per column tile: the group shares its B tiles in L2.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    """This program's output rows/columns, and the same wrapped into bounds (int64) for unmasked operand loads."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_SIZE_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid_n, offs_m, offs_n, (offs_m % M).to(tl.int64), (offs_n % N).to(tl.int64)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # The interpreter's bf16 dot is garbage (bf16 is held as uint16): UPCAST is set only when interpreting bf16,
    # never on GPU, where it would push the dot off the tensor-core bf16 path.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    # out_dtype spelled out: Triton 3.6 defaults it to fp32 and rejects an fp64 accumulator (3.9 infers it).
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION, out_dtype=acc.dtype)


@triton.jit
def _gemm_tile(a_ptr, b_ptr, rows, cols, K, stride_am, stride_ak, stride_bk, stride_bn,
               ACC_DTYPE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc[BLOCK_M, BLOCK_N] = A[rows, :K] · B[:K, cols], K-masked (rows and cols are already wrapped in bounds)."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = _dot(a, b, acc, UPCAST, DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.autotune(
    configs=matmul_configs(), key=["M_BUCKET", "N", "K", "ACTIVATION", "HAS_BIAS"],
    prune_configs_by=_PRUNE)
@triton.jit
def _linear_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, z_ptr, M, N, K, M_BUCKET,
                       stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn, stride_zm, stride_zn,
                       ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE_PREACT: tl.constexpr,
                       ACC_DTYPE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_SIZE_M: tl.constexpr):
    _, offs_m, offs_n, rows, cols = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_SIZE_M)
    acc = _gemm_tile(x_ptr, w_ptr, rows, cols, K, stride_xm, stride_xk, stride_wk, stride_wn,
                     ACC_DTYPE, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols).to(ACC_DTYPE)[None, :]
    out_m = offs_m.to(tl.int64)[:, None]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SAVE_PREACT:
        tl.store(z_ptr + out_m * stride_zm + offs_n[None, :] * stride_zn, acc.to(z_ptr.dtype.element_ty), mask=mask)
    y = act_fwd(acc, ACTIVATION)
    tl.store(y_ptr + out_m * stride_ym + offs_n[None, :] * stride_yn, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.autotune(
    configs=matmul_configs(small_tiles=True), key=["M_BUCKET", "F", "K", "HAS_BIAS"],
    prune_configs_by=_PRUNE_SWIGLU)
@triton.jit
def _swiglu_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, z_ptr, M, F, K, M_BUCKET,
                       stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn, stride_zm, stride_zn,
                       HAS_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr, UPCAST: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    # Output [M, F]; weight [2F, K] with gate rows [0, F) and up rows [F, 2F).
    _, offs_m, offs_n, rows, cols = _tile_offsets(M, F, BLOCK_M, BLOCK_N, GROUP_SIZE_M)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    wg_ptrs = w_ptr + offs_k[:, None] * stride_wk + cols[None, :] * stride_wn
    wu_ptrs = wg_ptrs + F * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        bg = tl.load(wg_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        bu = tl.load(wu_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc_gate = _dot(a, bg, acc_gate, UPCAST, DOT_PRECISION)
        acc_up = _dot(a, bu, acc_up, UPCAST, DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        wg_ptrs += BLOCK_K * stride_wk
        wu_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        acc_gate += tl.load(b_ptr + cols).to(ACC_DTYPE)[None, :]
        acc_up += tl.load(b_ptr + F + cols).to(ACC_DTYPE)[None, :]
    out_m = offs_m.to(tl.int64)[:, None]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < F)
    z_ptrs = z_ptr + out_m * stride_zm + offs_n[None, :] * stride_zn
    tl.store(z_ptrs, acc_gate.to(z_ptr.dtype.element_ty), mask=mask)
    tl.store(z_ptrs + F * stride_zn, acc_up.to(z_ptr.dtype.element_ty), mask=mask)
    y = swiglu_fwd(acc_gate, acc_up)
    tl.store(y_ptr + out_m * stride_ym + offs_n[None, :] * stride_yn, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=matmul_configs(), key=["M_BUCKET", "N", "K"], prune_configs_by=_PRUNE)
@triton.jit
def _linear_dgrad_kernel(dz_ptr, w_ptr, dx_ptr, M, N, K, M_BUCKET, stride_dzm, stride_dzk, stride_wk, stride_wn,
                         stride_dxm, stride_dxn, ACC_DTYPE: tl.constexpr, UPCAST: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    # GEMM dx[M, N] = dz[M, K] · W[K, N] where N = the linear's in-features and K = its out-features (2F for swiglu:
    # dz is [d_gate | d_up] and W's rows [gate | up], so one reduction over both halves).
    _, offs_m, offs_n, rows, cols = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_SIZE_M)
    acc = _gemm_tile(dz_ptr, w_ptr, rows, cols, K, stride_dzm, stride_dzk, stride_wk, stride_wn,
                     ACC_DTYPE, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    dx_ptrs = dx_ptr + offs_m.to(tl.int64)[:, None] * stride_dxm + offs_n[None, :] * stride_dxn
    tl.store(dx_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=mask)


# restore_value: autotuning runs the kernel once per config; without restoring, main_grad would be accumulated into
# once per trial. (Only the tuning runs pay for the copy.)
@triton.autotune(
    configs=matmul_configs(), key=["M", "N", "K_BUCKET", "ACCUMULATE"],
    prune_configs_by=_PRUNE, restore_value=["c_ptr"])
@triton.jit
def _linear_wgrad_kernel(dz_ptr, x_ptr, c_ptr, M, N, K, K_BUCKET,
                         stride_dzk, stride_dzm, stride_xk, stride_xn, stride_cm, stride_cn,
                         ACCUMULATE: tl.constexpr, ACC_DTYPE: tl.constexpr, UPCAST: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    # GEMM dW[M, N] = dzᵀ[M, K] · x[K, N] where M = out-features, N = in-features, K = tokens.
    _, offs_m, offs_n, rows, cols = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_SIZE_M)
    acc = _gemm_tile(dz_ptr, x_ptr, rows, cols, K, stride_dzm, stride_dzk, stride_xk, stride_xn,
                     ACC_DTYPE, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    if ACCUMULATE:
        # Each output tile is owned by exactly one program, so a plain load-add-store is race free (no atomics).
        # main_grad is fp32 or fp64 (checked on the host), so the add runs at its precision.
        c = tl.load(c_ptrs, mask=mask, other=0.0)
        tl.store(c_ptrs, acc.to(c.dtype) + c, mask=mask)
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_bwd_kernel(g_ptr, z_ptr, dz_ptr, M, N, F,
                    stride_gm, stride_gn, stride_zm, stride_zn, stride_dzm, stride_dzn,
                    ACTIVATION: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    # dz = g · act'(z) alone; N = grad_out columns (F for swiglu, whose dz has 2F columns).
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    g = tl.load(g_ptr + offs_m[:, None] * stride_gm + offs_n[None, :] * stride_gn, mask=mask, other=0.0)
    z_ptrs = z_ptr + offs_m[:, None] * stride_zm + offs_n[None, :] * stride_zn
    dz_ptrs = dz_ptr + offs_m[:, None] * stride_dzm + offs_n[None, :] * stride_dzn
    out_dtype = dz_ptr.dtype.element_ty
    if ACTIVATION == "swiglu":
        gate = tl.load(z_ptrs, mask=mask, other=0.0).to(ACC_DTYPE)
        up = tl.load(z_ptrs + F * stride_zn, mask=mask, other=0.0).to(ACC_DTYPE)
        d_gate, d_up = swiglu_bwd(g.to(ACC_DTYPE), gate, up)
        tl.store(dz_ptrs, d_gate.to(out_dtype), mask=mask)
        tl.store(dz_ptrs + F * stride_dzn, d_up.to(out_dtype), mask=mask)
    else:
        z = tl.load(z_ptrs, mask=mask, other=0.0).to(ACC_DTYPE)
        tl.store(dz_ptrs, act_bwd(g.to(ACC_DTYPE), z, ACTIVATION).to(out_dtype), mask=mask)


def _flags(dtype):
    """(ACC_DTYPE, UPCAST, DOT_PRECISION) for operands of this dtype."""
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    upcast = INTERPRET and dtype == torch.bfloat16
    # fp32 follows torch's own switch: TF32 only where torch would use it for F.linear too. Other dtypes keep
    # Triton's default ("tf32", which only affects fp32 operands): the path every Triton GEMM takes for fp16/bf16.
    if dtype == torch.float32:
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    else:
        precision = "tf32"
    return acc, upcast, precision


def _check_operands(*tensors):
    dtype = tensors[0].dtype
    if dtype not in TRITON_DTYPES:
        raise TypeError(f"Triton linear kernels support {TRITON_DTYPES}, got {dtype}")
    for t in tensors:
        if t.dim() != 2:
            raise ValueError(f"expected 2-D operands, got shape {tuple(t.shape)}")
        if t.dtype != dtype:
            raise TypeError(f"operand dtypes differ: {dtype} vs {t.dtype}")
        if t.device != tensors[0].device:
            raise ValueError(f"operands on different devices: {tensors[0].device} vs {t.device}")
    if not tensors[0].is_cuda and not INTERPRET:
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before kernels.triton_ops is "
                           "imported; use the torch backend instead")
    if not tensors[0].is_cuda:
        check_interpreter()


def _device_of(t):
    # Triton launches on the current CUDA device; make it the operands' device (a no-op on CPU / interpreter).
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _gemm_grid(M, N):
    return lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)


def _gated_width(weight_rows):
    if weight_rows % 2:
        raise ValueError(f"swiglu needs a fused [2F, K] weight, got {weight_rows} rows")
    return weight_rows // 2


def linear_forward(x, weight, bias=None, activation=None):
    """y = act(x @ weight.T + bias) -> (y, pre-activation or None); see torch_ops.linear_forward."""
    check_activation(activation)
    _check_operands(x, weight, *([] if bias is None else [bias.unsqueeze(0)]))
    M, K = x.shape
    n_rows = weight.shape[0]
    if weight.shape[1] != K or (bias is not None and bias.shape != (n_rows,)):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)}")
    N = _gated_width(n_rows) if activation == "swiglu" else n_rows
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    preact = None if activation is None else torch.empty(M, n_rows, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y, preact
    acc, upcast, precision = _flags(x.dtype)
    b = x if bias is None else bias.contiguous()  # x: a dummy pointer when HAS_BIAS is off
    z = y if preact is None else preact
    common = dict(ACC_DTYPE=acc, UPCAST=upcast, DOT_PRECISION=precision, HAS_BIAS=bias is not None)
    with _device_of(x):
        _launch_forward(x, weight, b, y, z, M, N, K, activation, preact is not None, common)
    return y, preact


def _launch_forward(x, weight, b, y, z, M, N, K, activation, save_preact, common):
    if activation == "swiglu":
        LAUNCHES["swiglu_fwd"] += 1
        _swiglu_fwd_kernel[_gemm_grid(M, N)](
            x, weight, b, y, z, M, N, K, token_bucket(M), x.stride(0), x.stride(1), weight.stride(0),
            weight.stride(1), y.stride(0), y.stride(1), z.stride(0), z.stride(1), **common)
    else:
        LAUNCHES["linear_fwd"] += 1
        _linear_fwd_kernel[_gemm_grid(M, N)](
            x, weight, b, y, z, M, N, K, token_bucket(M), x.stride(0), x.stride(1), weight.stride(0),
            weight.stride(1), y.stride(0), y.stride(1), z.stride(0), z.stride(1),
            ACTIVATION=activation or "none", SAVE_PREACT=save_preact, **common)


def _act_bwd(grad_out, preact, activation, dz, F):
    M, N = grad_out.shape
    LAUNCHES["act_bwd"] += 1
    block = 32 if INTERPRET else 64
    grid = (triton.cdiv(M, block), triton.cdiv(N, block))
    with _device_of(grad_out):
        _act_bwd_kernel[grid](grad_out, preact, dz, M, N, F, grad_out.stride(0), grad_out.stride(1),
                              preact.stride(0), preact.stride(1), dz.stride(0), dz.stride(1),
                              ACTIVATION=activation, ACC_DTYPE=_flags(grad_out.dtype)[0], BLOCK_M=block, BLOCK_N=block)


def linear_dgrad(grad_out, weight, preact=None, activation=None, *, need_input_grad=True):
    """-> (grad_input = dz @ weight or None, dz = grad_out · act'(preact)); see torch_ops.linear_dgrad."""
    check_activation(activation)
    _check_operands(grad_out, weight, *([] if preact is None else [preact]))
    M, n_out = grad_out.shape
    n_rows, K = weight.shape
    F = _gated_width(n_rows) if activation == "swiglu" else n_rows
    if n_out != F or (activation is not None and (preact is None or preact.shape != (M, n_rows))):
        raise ValueError(f"shape mismatch: grad_out {tuple(grad_out.shape)}, weight {tuple(weight.shape)}, "
                         f"preact {None if preact is None else tuple(preact.shape)}, activation {activation!r}")
    dz = grad_out if activation is None else torch.empty(M, n_rows, dtype=grad_out.dtype, device=grad_out.device)
    if activation is not None and M and F:
        _act_bwd(grad_out, preact, activation, dz, F)
    if not need_input_grad:
        return None, dz
    dx = torch.empty(M, K, dtype=grad_out.dtype, device=grad_out.device)
    if M == 0 or K == 0:
        return dx, dz
    acc, upcast, precision = _flags(grad_out.dtype)
    LAUNCHES["linear_dgrad"] += 1
    with _device_of(grad_out):
        _linear_dgrad_kernel[_gemm_grid(M, K)](
            dz, weight, dx, M, K, n_rows, token_bucket(M), dz.stride(0), dz.stride(1), weight.stride(0),
            weight.stride(1), dx.stride(0), dx.stride(1), ACC_DTYPE=acc, UPCAST=upcast, DOT_PRECISION=precision)
    return dx, dz


def linear_wgrad(dz, x, *, main_grad=None):
    """dW = dzᵀ @ x, or accumulate it into main_grad in place and return None; see torch_ops.linear_wgrad."""
    _check_operands(dz, x)
    M, N = dz.shape[1], x.shape[1]
    if x.shape[0] != dz.shape[0]:
        raise ValueError(f"token counts differ: dz {tuple(dz.shape)}, x {tuple(x.shape)}")
    if main_grad is not None:  # validated by ops.linear_wgrad
        out = main_grad
    else:
        out = torch.empty(M, N, dtype=dz.dtype, device=dz.device)
    tokens = dz.shape[0]
    if M == 0 or N == 0 or tokens == 0:
        return None if main_grad is not None else out.zero_()
    acc, upcast, precision = _flags(dz.dtype)
    LAUNCHES["linear_wgrad"] += 1
    with _device_of(dz):
        _linear_wgrad_kernel[_gemm_grid(M, N)](
            dz, x, out, M, N, tokens, token_bucket(tokens),
            dz.stride(0), dz.stride(1), x.stride(0), x.stride(1), out.stride(0), out.stride(1),
            ACCUMULATE=main_grad is not None, ACC_DTYPE=acc, UPCAST=upcast, DOT_PRECISION=precision)
    return None if main_grad is not None else out


# Shared with kernels.grouped_triton (the experts' grouped GEMMs) and kernels.triton_hopper (the persistent sm90
# GEMMs): the dot with its interpreter upcast, the grouped tile order, the per-dtype flags, the operand checks and
# the launch device.
dot = _dot
tile_coords = _tile_coords
flags = _flags
check_operands = _check_operands
device_of = _device_of
