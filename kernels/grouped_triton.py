"""Triton grouped GEMMs for mixture-of-experts layers: rows of x sorted by expert, one weight per expert.

`offsets` [E + 1] (int32, on the device) delimit the groups: rows offsets[e]..offsets[e+1] of x belong to expert e.
- _grouped_gemm_kernel: C[rows of e] = act(A[rows of e] · B_eᵀ) for B [E, N, K] (any strides: the dgrad passes the
  weight transposed), the pre-activation stored for backward; SwiGLU keeps two accumulators (rows n and n + F of B_e)
  so A is read once. Each program finds its (expert, row tile) by walking the offsets: the grid is sized without a
  host sync on the group sizes (cdiv(M, BLOCK_M) + E row tiles bound the real count; the spare programs exit).
- _grouped_wgrad_kernel: dW_e = dzᵀ_e · x_e, one program per (expert, output tile), the reduction over the expert's
  rows; optionally load-add-store into an fp32 main_grad [E, N, K] (each tile owned by one program: no atomics). An
  expert without rows gets zeros (or main_grad unchanged).
The activation's backward (dz = g·act'(z)) is torch's elementwise op (kernels.torch_ops): memory-bound, one pass.
"""
import torch
import triton
import triton.language as tl

from .activations import act_fwd, swiglu_fwd
from .configs import matmul_configs, pruner
from .triton_ops import LAUNCHES, check_operands, device_of, dot, flags

_PRUNE = {"early_config_prune": pruner()}
_PRUNE_SWIGLU = {"early_config_prune": pruner(lambda constexprs: (1, 2 if constexprs.get("SWIGLU") else 1))}


@triton.jit
def find_tile(offsets_ptr, E, pid_m, BLOCK_M: tl.constexpr):
    """(expert, first row, end row) of row tile `pid_m` in the groups' tile order; expert -1 past the last tile."""
    expert = pid_m * 0 - 1
    start = pid_m * 0
    end = pid_m * 0
    tiles = pid_m * 0
    for e in range(0, E):
        lo = tl.load(offsets_ptr + e)
        hi = tl.load(offsets_ptr + e + 1)
        n = tl.cdiv(hi - lo, BLOCK_M)
        hit = (pid_m >= tiles) & (pid_m < tiles + n)
        expert = tl.where(hit, e, expert)
        start = tl.where(hit, lo + (pid_m - tiles) * BLOCK_M, start)
        end = tl.where(hit, hi, end)
        tiles += n
    return expert, start, end


@triton.autotune(configs=matmul_configs(small_tiles=True), key=["N", "K", "ACTIVATION", "SWIGLU"],
                 prune_configs_by=_PRUNE_SWIGLU)
@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, z_ptr, offsets_ptr, E, N, K,
                         stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                         stride_zm, stride_zn,
                         ACTIVATION: tl.constexpr, SWIGLU: tl.constexpr, SAVE_PREACT: tl.constexpr,
                         ACC_DTYPE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_SIZE_M: tl.constexpr):
    # Output [rows, N] per expert; SWIGLU: B_e has 2N rows (gate [0, N), up [N, 2N)) and the output is silu·up.
    expert, start, end = find_tile(offsets_ptr, E, tl.program_id(0), BLOCK_M)
    if expert < 0:
        return
    offs_m = start + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(offs_m < end, offs_m, start).to(tl.int64)  # wrapped in bounds: unmasked row loads
    cols = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        acc = dot(a, tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0), acc, UPCAST, DOT_PRECISION)
        if SWIGLU:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=offs_k[:, None] < k_left, other=0.0)
            acc_up = dot(a, b_up, acc_up, UPCAST, DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    out_m = offs_m.to(tl.int64)[:, None]
    mask = (offs_m[:, None] < end) & (offs_n[None, :] < N)
    z_ptrs = z_ptr + out_m * stride_zm + offs_n[None, :] * stride_zn
    if SAVE_PREACT:
        tl.store(z_ptrs, acc.to(z_ptr.dtype.element_ty), mask=mask)
    if SWIGLU:
        tl.store(z_ptrs + N * stride_zn, acc_up.to(z_ptr.dtype.element_ty), mask=mask)
        y = swiglu_fwd(acc, acc_up)
    else:
        y = act_fwd(acc, ACTIVATION)
    tl.store(c_ptr + out_m * stride_cm + offs_n[None, :] * stride_cn, y.to(c_ptr.dtype.element_ty), mask=mask)


# restore_value: autotuning runs the kernel once per config; main_grad must be accumulated into once.
@triton.autotune(configs=matmul_configs(), key=["N", "K", "ACCUMULATE"], prune_configs_by=_PRUNE,
                 restore_value=["c_ptr"])
@triton.jit
def _grouped_wgrad_kernel(dz_ptr, x_ptr, c_ptr, offsets_ptr, N, K,
                          stride_dzm, stride_dzn, stride_xm, stride_xk, stride_ce, stride_cn, stride_ck,
                          ACCUMULATE: tl.constexpr, ACC_DTYPE: tl.constexpr, UPCAST: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    # GEMM dW_e[N, K] = dz_eᵀ[N, rows] · x_e[rows, K]: the output tile is BLOCK_M (of N) x BLOCK_N (of K), the
    # reduction runs over the expert's rows in BLOCK_K steps.
    expert = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_M)
    offs_n = (tl.program_id(1) % tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = (tl.program_id(1) // tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    lo = tl.load(offsets_ptr + expert)
    hi = tl.load(offsets_ptr + expert + 1)
    offs_r = lo + tl.arange(0, BLOCK_K)
    dz_ptrs = dz_ptr + offs_r.to(tl.int64)[None, :] * stride_dzm + (offs_n % N).to(tl.int64)[:, None] * stride_dzn
    x_ptrs = x_ptr + offs_r.to(tl.int64)[:, None] * stride_xm + (offs_k % K).to(tl.int64)[None, :] * stride_xk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for r in range(0, tl.cdiv(hi - lo, BLOCK_K)):
        r_left = hi - lo - r * BLOCK_K
        a = tl.load(dz_ptrs, mask=tl.arange(0, BLOCK_K)[None, :] < r_left, other=0.0)
        b = tl.load(x_ptrs, mask=tl.arange(0, BLOCK_K)[:, None] < r_left, other=0.0)
        acc = dot(a, b, acc, UPCAST, DOT_PRECISION)
        dz_ptrs += BLOCK_K * stride_dzm
        x_ptrs += BLOCK_K * stride_xm
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    c_ptrs = (c_ptr + expert.to(tl.int64) * stride_ce + offs_n.to(tl.int64)[:, None] * stride_cn
              + offs_k[None, :] * stride_ck)
    if ACCUMULATE:
        c = tl.load(c_ptrs, mask=mask, other=0.0)
        tl.store(c_ptrs, acc.to(c.dtype) + c, mask=mask)
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def _gemm_grid(M, E, N):
    return lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) + E, triton.cdiv(N, meta["BLOCK_N"]))


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, activation: str | None = None,
                 *, transpose_b: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(act(a_e · b_eᵀ) [M, N], the pre-activation or None) for b [E, N, K] (`transpose_b`: b [E, K, N], used as
    b_e itself: the dgrad); "swiglu": b [E, 2N, K], gate rows first."""
    check_operands(a, b.flatten(0, 1))
    M, K = a.shape
    E = b.shape[0]
    stride_be, stride_bn, stride_bk = (b.stride(0), b.stride(2), b.stride(1)) if transpose_b else b.stride()
    rows = b.shape[2] if transpose_b else b.shape[1]
    if (b.shape[1] if transpose_b else b.shape[2]) != K:
        raise ValueError(f"shape mismatch: a {tuple(a.shape)}, b {tuple(b.shape)} (transpose_b={transpose_b})")
    swiglu = activation == "swiglu"
    N = rows // 2 if swiglu else rows
    c = a.new_empty(M, N)
    preact = None if activation is None else a.new_empty(M, rows)
    if M == 0 or N == 0:
        return c, preact
    z = c if preact is None else preact
    acc, upcast, precision = flags(a.dtype)
    LAUNCHES["grouped_gemm"] += 1
    with device_of(a):
        _grouped_gemm_kernel[_gemm_grid(M, E, N)](
            a, b, c, z, offsets, E, N, K, a.stride(0), a.stride(1), stride_be, stride_bn, stride_bk,
            c.stride(0), c.stride(1), z.stride(0), z.stride(1),
            ACTIVATION="none" if swiglu or activation is None else activation, SWIGLU=swiglu,
            SAVE_PREACT=preact is not None, ACC_DTYPE=acc, UPCAST=upcast, DOT_PRECISION=precision)
    return c, preact


def grouped_wgrad(dz: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, num_groups: int, *,
                  main_grad: torch.Tensor | None = None) -> torch.Tensor | None:
    """dW [E, N, K] with dW_e = dz_eᵀ · x_e, or accumulated into main_grad in place (None returned)."""
    check_operands(dz, x)
    N, K = dz.shape[1], x.shape[1]
    out = main_grad if main_grad is not None else dz.new_empty(num_groups, N, K)
    if N == 0 or K == 0 or num_groups == 0:
        return None if main_grad is not None else out
    acc, upcast, precision = flags(dz.dtype)
    LAUNCHES["grouped_wgrad"] += 1
    grid = lambda meta: (num_groups, triton.cdiv(N, meta["BLOCK_M"]) * triton.cdiv(K, meta["BLOCK_N"]))
    with device_of(dz):
        _grouped_wgrad_kernel[grid](
            dz, x, out, offsets, N, K, dz.stride(0), dz.stride(1), x.stride(0), x.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            ACCUMULATE=main_grad is not None, ACC_DTYPE=acc, UPCAST=upcast, DOT_PRECISION=precision)
    return None if main_grad is not None else out
