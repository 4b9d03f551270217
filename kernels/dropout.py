"""Counter-based dropout: every mask bit a pure function of a 64-bit key and the element's counters, so a mask is
drawn piecewise, anywhere, in any order, and regenerated in backward instead of saved.

The bit of an element is Philox-4x32-10 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"; the
generator `tl.randint4x` / `tl.rand` run in Triton) of the counters (c0, c1, c2, c3) under `key`: the element is
kept when its output word is >= round(p·2³²), and scaled by 1/(1 − p). Counters: c0 the column (hidden index, or key
position) // 4, the word the column % 4 (one Philox call serves four neighbouring columns, as curand's dropout
does), c1 the row (token position, or query position), c2 the head (0 on the residual stream), c3 the sample's index
in the run (its low 32 bits). The Triton kernels (kernels.dropout_triton) and the torch code here
compute the same bits: Triton on CUDA (or when the backend is forced to "triton", e.g. under TRITON_INTERPRET=1),
torch otherwise (`kernels.use_backend`).

- `keep_mask(key, p, samples, rows, cols, heads=, first_head=)`: the bool mask [b, heads, m, n] of attention tiles.
- `dropout_add(x, residual, bias, p=, key=, samples=, positions=)`: residual + dropout(x + bias) on [rows, b, h],
  fused in one kernel; backward (`dropout_backward`) regenerates the mask (saved: samples and positions only), and
  with a bias sums its gradient in the same pass.
"""
import torch

from . import ops

_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57  # Philox-4x32's multipliers and Weyl key increments (Salmon et al.)
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85


def _mulhilo(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a·x for a 32-bit constant a and int64 x in [0, 2³²), without int64 overflow:
    a is split into 16-bit halves, so every product stays below 2⁴⁹."""
    high_part, low_part = x * (a >> 16), x * (a & 0xFFFF)
    return (high_part + (low_part >> 16)) >> 16, (((high_part & 0xFFFF) << 16) + low_part) & _M32


def philox(key: int, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor,
           c3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four output words of Philox-4x32-10 (int64 in [0, 2³²)) for counters c0..c3 (int64 tensors in
    [0, 2³²), broadcast together) under the 64-bit `key`: Triton's `tl.philox(key, c0, c1, c2, c3)`."""
    k0, k1 = key & _M32, (key >> 32) & _M32
    c0, c1, c2, c3 = torch.broadcast_tensors(c0, c1, c2, c3)
    for _ in range(10):
        high_b, low_b = _mulhilo(_ROUND_B, c2)
        high_a, low_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def _word(words: tuple[torch.Tensor, ...], which: torch.Tensor) -> torch.Tensor:
    """words[which] elementwise (which in 0..3, broadcast against the words)."""
    return torch.stack(words).gather(0, which.expand(words[0].shape).unsqueeze(0))[0]


def threshold(p: float) -> int:
    """Keep an element when its 32-bit word is >= this: a keep probability of 1 − p (to 2⁻³²)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability {p} must be in [0, 1)")
    return min(round(p * 2**32), _M32)


def _triton(device: torch.device):
    """kernels.dropout_triton when the backend runs Triton on `device` (auto: CUDA only), else None."""
    backend = ops.get_backend()
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return None
    try:
        from . import dropout_triton
    except ImportError as e:
        if backend == "triton":
            raise RuntimeError(f"kernels backend 'triton' was forced but triton cannot be imported: {e!r}") from None
        return None
    return dropout_triton


def _counters(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return (t.to(torch.int64) & _M32).view(shape)


def keep_mask(key: int, p: float, samples: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, *, heads: int = 1,
              first_head: int = 0) -> torch.Tensor:
    """Bool [b, heads, m, n]: which elements dropout keeps, for the samples' indices [b], heads first_head..
    first_head + heads − 1, row counters [m] (query or token positions) and column counters [n] (key positions or
    hidden indices), on the rows' device."""
    limit, device = threshold(p), rows.device
    samples = samples.to(device)
    triton_module = _triton(device)
    if triton_module is not None:
        return triton_module.keep_mask(key=key, threshold=limit, samples=samples.to(torch.int64).contiguous(),
                                       rows=rows.to(torch.int64).contiguous(), cols=cols.to(torch.int64).contiguous(),
                                       heads=heads, first_head=first_head)
    head, cols = torch.arange(first_head, first_head + heads, device=device), _counters(cols, (1, 1, 1, -1))
    words = philox(key, cols >> 2, _counters(rows, (1, 1, -1, 1)), _counters(head, (1, -1, 1, 1)),
                   _counters(samples, (-1, 1, 1, 1)))
    return _word(words, cols & 3) >= limit


def _torch_dropout_add(x, residual, bias, key, p, samples, positions):
    groups, zero = torch.arange((x.shape[-1] + 3) // 4, device=x.device), torch.zeros((), dtype=torch.int64,
                                                                                  device=x.device)
    words = philox(key, groups.view(1, 1, -1, 1), _counters(positions, (-1, 1, 1, 1)), zero,
                   _counters(samples, (1, -1, 1, 1)))  # 4 x [rows, b, h/4, 1]: word k for column 4·group + k
    keep = torch.cat(words, -1).flatten(-2)[..., :x.shape[-1]] >= threshold(p)  # [rows, b, h], laid out like x
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    acc = torch.float64 if dtype == torch.float64 or x.dtype == torch.float64 else torch.float32
    y = x.to(acc) if bias is None else x.to(acc) + bias.to(acc)
    y = torch.where(keep, y * (1.0 / (1.0 - p)), 0.0)  # (the scale rounded to fp32 for fp32, as in the kernel)
    return (y if residual is None else y + residual.to(acc)).to(dtype)


def _dropout_add(x, residual, bias, key, p, samples, positions):
    triton_module = _triton(x.device)
    if triton_module is None or torch.float64 in (x.dtype, getattr(residual, "dtype", None)):
        return _torch_dropout_add(x, residual, bias, key, p, samples, positions)
    return triton_module.dropout_add(x.contiguous(), None if residual is None else residual.contiguous(), bias,
                                     key=key, threshold=threshold(p), scale=1.0 / (1.0 - p),
                                     samples=samples.to(torch.int64).contiguous(),
                                     positions=positions.to(torch.int64).contiguous())


def dropout_backward(grad: torch.Tensor, *, p: float, key: int, samples: torch.Tensor, positions: torch.Tensor,
                     bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dropout_add's backward for its output's gradient [rows, b, h]: (dx, and with `bias_grad` the bias's gradient,
    dx summed over its rows in fp32 (fp64 for fp64), else None). Triton does both in one pass over grad where it
    runs; torch computes dx and then its sum."""
    triton_module = _triton(grad.device)
    if bias_grad and triton_module is not None and grad.dtype != torch.float64:
        return triton_module.dropout_grad(grad.contiguous(), key=key, threshold=threshold(p), scale=1.0 / (1.0 - p),
                                          samples=samples.to(torch.int64).contiguous(),
                                          positions=positions.to(torch.int64).contiguous())
    dx = _dropout_add(grad, None, None, key, p, samples, positions)
    if not bias_grad:
        return dx, None
    return dx, dx.flatten(0, -2).sum(0, dtype=torch.float64 if dx.dtype == torch.float64 else torch.float32)


class _DropoutAdd(torch.autograd.Function):
    """forward: residual + dropout(x + bias) · backward: the mask regenerated from the counters."""

    @staticmethod
    def forward(ctx, x, residual, bias, key, p, samples, positions):
        ctx.key, ctx.p, ctx.has_bias = key, p, bias is not None
        ctx.save_for_backward(samples, positions)
        return _dropout_add(x, residual, bias, key, p, samples, positions)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        samples, positions = ctx.saved_tensors
        dx, dbias = dropout_backward(grad, p=ctx.p, key=ctx.key, samples=samples, positions=positions,
                                     bias_grad=ctx.has_bias and ctx.needs_input_grad[2])
        return dx, grad if ctx.needs_input_grad[1] else None, dbias, None, None, None, None


def dropout_add(x: torch.Tensor, residual: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                p: float, key: int, samples: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """residual + dropout(x + bias) for x [rows, b, h] (residual like x or None, bias [h] or None): the mask of
    element (row r, sample i, column j) keyed by (key, samples[i], positions[r], j), so the rows of any shard, given
    their global positions [rows], get the bits the whole sequence would. The output has x's dtype (promoted with
    the residual's); arithmetic in fp32 (fp64 for fp64)."""
    if x.dim() != 3 or samples.shape != (x.shape[1],) or positions.shape != (x.shape[0],):
        raise ValueError(f"dropout_add needs x [rows, b, h], samples [b] and positions [rows]; got x "
                         f"{tuple(x.shape)}, samples {tuple(samples.shape)}, positions {tuple(positions.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"dropout_add: residual {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    if bias is not None and bias.shape != x.shape[-1:]:
        raise ValueError(f"dropout_add: bias {tuple(bias.shape)} must be [{x.shape[-1]}]")
    threshold(p)
    return _DropoutAdd.apply(x, residual, bias, key, p, samples.to(x.device), positions.to(x.device))
