"""The experts' grouped GEMMs on Hopper (sm90): persistent programs, tensor-descriptor (TMA) operand loads, wgmma.
kernels.grouped's Triton entry; anything kernels.triton_hopper would not take (not a Hopper GPU, use_hopper off,
fp32/fp64, widths or strides outside TMA's rules) runs kernels.grouped_triton's kernels, same contract.

Rows of x are sorted by expert and `offsets` [E + 1] (int32, on the device) delimit the groups; the weight is one
[E, N, K] tensor. What the groups change against the dense kernels of kernels.triton_hopper:
- _grouped_gemm_kernel: C[rows of e] = act(A[rows of e] · B_e) with B_e = W_eᵀ (forward; SwiGLU: gate rows n and
  up rows n + N of W_e, two accumulators) or W_e as stored (DGRAD: dx_e = dz_e · W_e). The weight is read through
  a 3-D descriptor [E, ., .] with a one-expert block, so a partial tile is zero-filled at its own expert's edge by
  the TMA unit, never filled with the next expert's rows. A row tile starts at its group's first row plus a
  multiple of BLOCK_M: its last rows may be the next group's, which the A load reads (rows are independent in a
  GEMM) and the epilogue does not store: the output goes out through masked pointer stores, not a TMA store
  (whose box cannot stop at a group's end). Tiles are numbered over cdiv(M, BLOCK_M) + E row tiles, an upper
  bound of the groups' real count that needs no host sync on the group sizes; the spare ones are skipped.
- _grouped_wgrad_kernel: dW_e = dz_eᵀ · x_e, the reduction over the expert's rows: whole BLOCK_K chunks straight
  from the descriptors, then the last partial chunk with the next expert's rows zeroed in dzᵀ (a product with
  them then adds nothing); dW (or fp32 main_grad, loaded, added to and stored) through a 3-D descriptor
  [E, N, K], so a tile is clipped at its expert's edge. An expert without rows gets zeros (main_grad unchanged).
Descriptors are host-side with their block shapes set by each config's pre_hook (as in kernels.triton_hopper).
"""
import torch
import triton
import triton.language as tl

from . import grouped_triton
from .activations import act_fwd, swiglu_fwd
from .choice import token_bucket
from .configs import persistent_configs, pruner
from .grouped_triton import find_tile
from .triton_hopper import block_hook, descriptor, halves, programs, takes, tma_ready, upcast
from .triton_ops import LAUNCHES, check_operands, device_of, dot, tile_coords


@triton.jit
def _weight_tile(w_desc, expert, off_n, off_k, DGRAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """B's [BLOCK_K, BLOCK_N] tile for one expert: W_e read [N, K] and transposed, or (DGRAD) W_e as stored."""
    if DGRAD:
        return w_desc.load([expert, off_k, off_n]).reshape(BLOCK_K, BLOCK_N)
    return w_desc.load([expert, off_n, off_k]).reshape(BLOCK_N, BLOCK_K).T


@triton.jit
def _store_rows(ptr, stride, values, rows, cols, mask):
    tl.store(ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :], values.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _epilogue(c_ptr, z_ptr, stride_cm, stride_zm, acc, acc_up, start, end, off_n, N, ACTIVATION: tl.constexpr,
              SWIGLU: tl.constexpr, SAVE_PREACT: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """Masked stores of one [BLOCK_M, WIDTH] piece at column off_n: the rows from `end` on are the next group's."""
    rows = start + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, WIDTH)
    mask = (rows < end)[:, None] & (cols < N)[None, :]
    if SAVE_PREACT:
        _store_rows(z_ptr, stride_zm, acc, rows, cols, mask)
    if SWIGLU:
        _store_rows(z_ptr, stride_zm, acc_up, rows, cols + N, mask)
        y = swiglu_fwd(acc, acc_up)
    else:
        y = act_fwd(acc, ACTIVATION)
    _store_rows(c_ptr, stride_cm, y, rows, cols, mask)


_GEMM_HOOK = block_hook(lambda nargs: {"a_desc": "MK", "w_desc": "1KN" if nargs["DGRAD"] else "1NK"})
_WGRAD_HOOK = block_hook({"dz_desc": "KM", "x_desc": "KN", "c_desc": "1MN"})


@triton.autotune(configs=persistent_configs(_GEMM_HOOK, small_tiles=True),
                 key=["M_BUCKET", "N", "K", "ACTIVATION", "SWIGLU", "DGRAD"],
                 prune_configs_by={"early_config_prune": pruner(lambda c: (1, 2 if c.get("SWIGLU") else 1))})
@triton.jit
def _grouped_gemm_kernel(a_desc, w_desc, c_ptr, z_ptr, offsets_ptr, E, M, N, K, M_BUCKET, stride_cm, stride_zm,
                         ACTIVATION: tl.constexpr, SWIGLU: tl.constexpr, SAVE_PREACT: tl.constexpr,
                         DGRAD: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    # Output [M, N]; SWIGLU: W_e has 2N rows (gate [0, N), up [N, 2N)), the pre-activation [M, 2N].
    m_tiles = tl.cdiv(M, BLOCK_M) + E
    for tile in tl.range(tl.program_id(0), m_tiles * tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, m_tiles * BLOCK_M, N, BLOCK_M, BLOCK_N, GROUP_SIZE_M)
        expert, start, end = find_tile(offsets_ptr, E, pid_m, BLOCK_M)
        if expert >= 0:
            off_n = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, tl.cdiv(K, BLOCK_K)):
                a = a_desc.load([start, k * BLOCK_K])
                acc = dot(a, _weight_tile(w_desc, expert, off_n, k * BLOCK_K, DGRAD, BLOCK_N, BLOCK_K), acc,
                          UPCAST, "tf32")
                if SWIGLU:
                    acc_up = dot(a, _weight_tile(w_desc, expert, off_n + N, k * BLOCK_K, DGRAD, BLOCK_N, BLOCK_K),
                                 acc_up, UPCAST, "tf32")
            # The epilogue in two column halves: half the registers for the pointers and the activation's
            # temporaries (the SwiGLU form spilled at 128x128 in one piece, tests/test_kernels_compile.py).
            acc_l, acc_r = halves(acc, BLOCK_M, BLOCK_N)
            up_l, up_r = halves(acc_up, BLOCK_M, BLOCK_N)
            _epilogue(c_ptr, z_ptr, stride_cm, stride_zm, acc_l, up_l, start, end, off_n, N, ACTIVATION, SWIGLU,
                      SAVE_PREACT, BLOCK_M, BLOCK_N // 2)
            _epilogue(c_ptr, z_ptr, stride_cm, stride_zm, acc_r, up_r, start, end, off_n + BLOCK_N // 2, N,
                      ACTIVATION, SWIGLU, SAVE_PREACT, BLOCK_M, BLOCK_N // 2)


@triton.jit
def _rows_chunk(dz_desc, x_desc, row, end, acc, off_m, off_n, MASKED: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """acc += dzᵀ[off_m:, row:row + BLOCK_K] · x[row:row + BLOCK_K, off_n:]; MASKED: rows from `end` on count 0."""
    a = dz_desc.load([row, off_m]).T
    if MASKED:
        a = tl.where((row + tl.arange(0, BLOCK_K))[None, :] < end, a, tl.zeros_like(a))
    return dot(a, x_desc.load([row, off_n]), acc, UPCAST, "tf32")


# restore_value: autotuning runs the kernel once per config; main_grad (c, which c_desc describes) is restored after
# each trial, or it would be accumulated into once per trial.
@triton.autotune(configs=persistent_configs(_WGRAD_HOOK), key=["N", "K", "M_BUCKET", "ACCUMULATE"],
                 prune_configs_by={"early_config_prune": pruner(
                     epilogue_bytes=lambda c, elem: 8 if c.get("ACCUMULATE") else elem)},
                 restore_value=["c"])
@triton.jit
def _grouped_wgrad_kernel(dz_desc, x_desc, c_desc, c, offsets_ptr, E, N, K, M_BUCKET, ACCUMULATE: tl.constexpr,
                          UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_SIZE_M: tl.constexpr):
    # dW_e[N, K] = dz_eᵀ[N, rows] · x_e[rows, K]: the output tile is BLOCK_M (of N) x BLOCK_N (of K), the reduction
    # runs over the expert's rows in BLOCK_K steps.
    per_expert = tl.cdiv(N, BLOCK_M) * tl.cdiv(K, BLOCK_N)
    for tile in tl.range(tl.program_id(0), E * per_expert, tl.num_programs(0)):
        expert = tile // per_expert
        pid_m, pid_n = tile_coords(tile % per_expert, N, K, BLOCK_M, BLOCK_N, GROUP_SIZE_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        lo = tl.load(offsets_ptr + expert)
        hi = tl.load(offsets_ptr + expert + 1)
        whole = (hi - lo) // BLOCK_K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r in range(0, whole):
            acc = _rows_chunk(dz_desc, x_desc, lo + r * BLOCK_K, hi, acc, off_m, off_n, False, UPCAST, BLOCK_K)
        if lo + whole * BLOCK_K < hi:
            acc = _rows_chunk(dz_desc, x_desc, lo + whole * BLOCK_K, hi, acc, off_m, off_n, True, UPCAST, BLOCK_K)
        if ACCUMULATE:  # fp32 main_grad (checked on the host)
            acc += c_desc.load([expert, off_m, off_n]).reshape(BLOCK_M, BLOCK_N)
        c_desc.store([expert, off_m, off_n], acc.to(c_desc.dtype).reshape(1, BLOCK_M, BLOCK_N))


# ---------------------------------------------------------------------------------------------------------------
# Host launchers (kernels.grouped_triton's signatures)
# ---------------------------------------------------------------------------------------------------------------

def grouped_gemm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, activation: str | None = None,
                 *, transpose_b: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(act(a_e · b_eᵀ) [M, N], the pre-activation or None) for b [E, N, K] (`transpose_b`: b_e itself, the
    dgrad); "swiglu": b [E, 2N, K], gate rows first. See kernels.grouped_triton.grouped_gemm."""
    if not (a.dim() == 2 and b.dim() == 3 and b.shape[1 if transpose_b else 2] == a.shape[1] and takes((a, b), ())):
        return grouped_triton.grouped_gemm(a, b, offsets, activation, transpose_b=transpose_b)
    check_operands(a, b.flatten(0, 1))
    swiglu = activation == "swiglu"
    rows = b.shape[2] if transpose_b else b.shape[1]
    (M, K), E, N = a.shape, b.shape[0], rows // 2 if swiglu else rows
    c = a.new_empty(M, N)
    preact = None if activation is None else a.new_empty(M, rows)
    z = c if preact is None else preact
    LAUNCHES["hopper_grouped_gemm"] += 1
    tiles = lambda bm, bn: (triton.cdiv(M, bm) + E) * triton.cdiv(N, bn)  # noqa: E731
    with device_of(a):
        _grouped_gemm_kernel[programs(a, tiles)](
            descriptor(a), descriptor(b), c, z, offsets, E, M, N, K, token_bucket(M), c.stride(0), z.stride(0),
            ACTIVATION="none" if swiglu or activation is None else activation, SWIGLU=swiglu,
            SAVE_PREACT=preact is not None, DGRAD=transpose_b, UPCAST=upcast(a.dtype))
    return c, preact


def grouped_wgrad(dz: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, num_groups: int, *,
                  main_grad: torch.Tensor | None = None) -> torch.Tensor | None:
    """dW [E, N, K] with dW_e = dz_eᵀ · x_e, or accumulated into main_grad in place (None returned)."""
    fp32_grad = main_grad is None or (main_grad.dtype == torch.float32 and main_grad.device == dz.device
                                      and tma_ready(main_grad))
    if not (fp32_grad and num_groups > 0 and dz.dim() == 2 and x.dim() == 2 and dz.shape[0] == x.shape[0]
            and takes((dz, x), (x.shape[1],))):
        return grouped_triton.grouped_wgrad(dz, x, offsets, num_groups, main_grad=main_grad)
    (M, N), K = dz.shape, x.shape[1]
    out = dz.new_empty(num_groups, N, K) if main_grad is None else main_grad
    LAUNCHES["hopper_grouped_wgrad"] += 1
    tiles = lambda bm, bn: num_groups * triton.cdiv(N, bm) * triton.cdiv(K, bn)  # noqa: E731
    with device_of(dz):
        _grouped_wgrad_kernel[programs(dz, tiles)](
            descriptor(dz), descriptor(x), descriptor(out), out, offsets, num_groups, N, K, token_bucket(M),
            ACCUMULATE=main_grad is not None, UPCAST=upcast(dz.dtype))
    return None if main_grad is not None else out
