"""The experts: E/ep per rank, each a SwiGLU (or GELU) FFN whose hidden dim F is split over etp, computed with one
grouped GEMM per projection over the rows sorted by expert (kernels.grouped_linear).

Weights in Hugging Face's fused expert layout, this rank's experts and etp slice: fc1 [E/ep, 2F/etp, h] (gate rows,
then up rows; GELU: [E/ep, F/etp, h]) and fc2 [E/ep, h, F/etp]. Initialisation is split-invariant: every rank draws
all E experts' full weights from the serial init in the same order and keeps its slices. The parameters are tagged
`expert_parallel = True`: their gradients are reduced over the expert-data-parallel group (the edp ranks hold the same
experts), not over dp like the dense ones (see docs/moe.md); `tensor_parallel`/`partition_dim` tag the etp split.
The GEMMs' backward splits like the parallel linears': under `tp.pipeline.defer_wgrad()` (zero-bubble schedules'
B) the weight gradients are queued with their counts, computed by the W pass into the same fp32 main_grad.
`fp8_recipe=` runs each expert's GEMMs in float8 with per-expert scales, the amaxes etp splits all-reduced over etp
(kernels.grouped_fp8; docs/fp8.md).
"""
import functools

import torch
import torch.distributed as dist
from torch import nn

import kernels
from kernels import grouped
from kernels.first_order import first_order

from ..mesh import SharedGroup
from ..pipeline.wgrad import defer_weight_grad, deferring


class _GroupedLinearFn(torch.autograd.Function):
    """kernels.grouped_linear whose weight gradient a zero-bubble schedule's B may defer to its W."""

    @staticmethod
    def forward(ctx, x, weight, counts, activation, fp8):
        ctx.main_grad = getattr(weight, "main_grad", None)  # on the parameter, not on an autocast copy of it
        ctx.weight_dtype = weight.dtype
        x, weight, _ = kernels.ops.autocast_operands(x, weight)
        y, preact, x_for_w = grouped.forward_keeping_input(x, weight, counts, activation, fp8=fp8)
        ctx.save_for_backward(weight, preact, *grouped.saved_operand(x_for_w))  # (x, or its e4m3 cast)
        ctx.counts, ctx.activation, ctx.fp8, ctx.x_dtype = counts, activation, fp8, x.dtype
        return y

    @staticmethod
    @first_order
    def backward(ctx, grad_y):
        weight, preact, *x = ctx.saved_tensors
        x = grouped.operand(x, ctx.x_dtype)
        dx, dz = grouped.dgrad_keeping_grad(grad_y.to(weight.dtype).contiguous(), weight, ctx.counts, preact,
                                            ctx.activation, need_input_grad=ctx.needs_input_grad[0], fp8=ctx.fp8)
        dw = None
        wgrad = functools.partial(_grouped_wgrad, ctx.counts, ctx.fp8)
        if ctx.needs_input_grad[1] and not defer_weight_grad(ctx, 1, dz, x, wgrad=wgrad):  # (W later, deferred)
            dw = wgrad(dz, x, main_grad=ctx.main_grad)
        return dx, dw, None, None, None


def _grouped_wgrad(counts, fp8, dz, x, *, main_grad=None):
    return kernels.grouped_wgrad(dz, x, counts, main_grad=main_grad, fp8=fp8)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int] | torch.Tensor, *,
                   activation: str | None = None, fp8: kernels.fp8.Fp8Scaling | None = None) -> torch.Tensor:
    """kernels.grouped_linear (act(x_e @ weight_eᵀ) per row group), its weight gradient deferrable by
    tp.pipeline.defer_wgrad; `fp8`: the GEMMs in float8, scales reduced over its group (kernels.grouped_fp8)."""
    if not deferring() and fp8 is None:
        return kernels.grouped_linear(x, weight, counts, activation=activation)
    kernels.ops.check_activation(activation)
    return _GroupedLinearFn.apply(x, weight, counts, activation, fp8)


class GroupedExperts(nn.Module):
    """`num_experts` FFNs of hidden size `ffn_hidden_size`; this rank holds experts [ep_rank·E/ep, ...) and slice
    `etp_rank` of their F. forward(x [N, h] sorted by local expert, rows per local expert (host integers or an int
    tensor [E/ep])) -> [N, h], a partial sum over the etp group when etp > 1. `ep_group` / `etp_group` (set by the
    MoE layer) are what gather_dense gathers over."""

    ep_group, etp_group = SharedGroup(), SharedGroup()
    names = ("fc1", "fc2")  # the two weights' attribute names (tp.moe.ParallelExperts: Hugging Face's)

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, *, activation: str = "swiglu",
                 ep_size: int = 1, ep_rank: int = 0, etp_size: int = 1, etp_rank: int = 0, init_std: float = 0.02,
                 output_std: float | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, fp8_recipe: str | None = None, _init: bool = True) -> None:
        super().__init__()
        if activation not in ("swiglu", "gelu", "gelu_tanh"):
            raise ValueError(f"expert activation={activation!r} must be 'swiglu', 'gelu' or 'gelu_tanh'")
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep_size}")
        if ffn_hidden_size % etp_size:
            raise ValueError(f"moe_ffn_hidden_size={ffn_hidden_size} is not divisible by etp={etp_size}")
        self.num_experts, self.hidden_size, self.ffn_hidden_size = num_experts, hidden_size, ffn_hidden_size
        self.activation, self.ep_size, self.ep_rank = activation, ep_size, ep_rank
        self.etp_size, self.etp_rank = etp_size, etp_rank
        self.ep_group = self.etp_group = None
        self.local_experts, self.local_ffn = num_experts // ep_size, ffn_hidden_size // etp_size
        rows = 2 * self.local_ffn if activation == "swiglu" else self.local_ffn
        kernels.fp8.check_features(fp8_recipe, hidden_size, rows, f"the experts' fc1 at etp={etp_size}")
        kernels.fp8.check_features(fp8_recipe, self.local_ffn, hidden_size, f"the experts' fc2 at etp={etp_size}")
        self.fp8_recipe = fp8_recipe
        factory = {"dtype": dtype, "device": device}
        self.register_parameter(self.names[0], nn.Parameter(torch.empty(self.local_experts, rows, hidden_size,
                                                                        **factory)))
        self.register_parameter(self.names[1], nn.Parameter(torch.empty(self.local_experts, hidden_size,
                                                                        self.local_ffn, **factory)))
        for p, dim in zip(self.weights, (1, 2)):
            p.expert_parallel = True
            p.tensor_parallel, p.partition_dim = etp_size > 1, dim
        self.init_std, self.output_std = init_std, init_std if output_std is None else output_std
        if _init and self.weights[0].device.type != "meta":
            self.reset_parameters()

    @property
    def weights(self) -> tuple[nn.Parameter, nn.Parameter]:
        """(fc1 [E/ep, 2F/etp (GELU: F/etp), h], fc2 [E/ep, h, F/etp]), under their attribute names."""
        return getattr(self, self.names[0]), getattr(self, self.names[1])

    @property
    def expert_range(self) -> range:
        """The global indices of this rank's experts."""
        return range(self.ep_rank * self.local_experts, (self.ep_rank + 1) * self.local_experts)

    def shard_fc1(self, dense: torch.Tensor) -> torch.Tensor:
        """This rank's slice [.., 2F/etp, h] of dense fc1 weights [.., 2F, h] (each of gate and up split)."""
        parts = dense.chunk(2, dim=-2) if self.activation == "swiglu" else (dense,)
        return torch.cat([p.chunk(self.etp_size, dim=-2)[self.etp_rank] for p in parts], dim=-2)

    def shard_fc2(self, dense: torch.Tensor) -> torch.Tensor:
        """This rank's slice [.., h, F/etp] of dense fc2 weights [.., h, F]."""
        return dense.chunk(self.etp_size, dim=-1)[self.etp_rank]

    @torch.no_grad()
    def gather_dense(self, tensor: torch.Tensor, which: str) -> torch.Tensor:
        """Every expert's dense fc1 [E, 2F, h] or fc2 [E, h, F] (`which`: their name in `names`) from this rank's
        slice of it (a collective over etp, then ep): shard_fc1 / shard_fc2's inverse, over all experts."""
        pieces = _all_gather(tensor, self.etp_group)
        if which == self.names[0]:
            parts = [p.chunk(2, dim=1) for p in pieces] if self.activation == "swiglu" else [(p,) for p in pieces]
            dense = torch.cat([torch.cat([p[i] for p in parts], dim=1) for i in range(len(parts[0]))], dim=1)
        else:
            dense = torch.cat(pieces, dim=2)
        return torch.cat(_all_gather(dense, self.ep_group), dim=0)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Each expert's full weights drawn in turn (fc1 then fc2, normal with init_std / output_std) on the CPU in
        the parameters' dtype, this rank's slices kept: at any ep / etp the slices of the serial model's experts."""
        rows = 2 * self.ffn_hidden_size if self.activation == "swiglu" else self.ffn_hidden_size
        w1, w2 = self.weights
        for e in range(self.num_experts):
            fc1 = torch.empty(rows, self.hidden_size, dtype=w1.dtype).normal_(0.0, self.init_std)
            fc2 = torch.empty(self.hidden_size, self.ffn_hidden_size, dtype=w2.dtype).normal_(0.0, self.output_std)
            if e in self.expert_range:
                w1[e - self.expert_range.start].copy_(self.shard_fc1(fc1))
                w2[e - self.expert_range.start].copy_(self.shard_fc2(fc2))

    def fp8_scaling(self, which: int) -> kernels.fp8.Fp8Scaling | None:
        """How weight `which` (0: fc1, 1: fc2) runs its GEMMs in float8, None: not at all. etp splits fc1's output
        dim and fc2's input dim: their amaxes are reduced over the etp group."""
        if self.fp8_recipe is None:
            return None
        return kernels.fp8.Fp8Scaling(self.fp8_recipe, self.etp_group, ("out", "in")[which])

    def forward(self, x: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:  # [N, h]
        w1, w2 = self.weights
        hidden = grouped_linear(x, w1, counts, activation=self.activation, fp8=self.fp8_scaling(0))  # [N, F/etp]
        return grouped_linear(hidden, w2, counts, fp8=self.fp8_scaling(1))  # [N, h]

    def extra_repr(self) -> str:
        fp8 = f", fp8_recipe={self.fp8_recipe}" if self.fp8_recipe else ""
        return (f"{self.num_experts} experts ({self.local_experts} here: {self.expert_range.start}.."
                f"{self.expert_range.stop - 1}), {self.hidden_size} -> {self.ffn_hidden_size} ({self.local_ffn} here, "
                f"etp={self.etp_size}), {self.activation}{fp8}")


def _all_gather(t, group):
    if group is None or dist.get_world_size(group) == 1:
        return [t]
    pieces = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, t.contiguous(), group=group)
    return pieces
