"""The autograd Functions under tp.layers' linear layers: the local matmul with the column layer's input collective
fused in (overlapped with the weight-gradient GEMM, deferrable, fp8 or main_grad-accumulating), and the sum of the
gradients of rows that several ranks hold whole (kv heads fewer than tp)."""
import functools

import torch
import torch.distributed as dist

import kernels
from kernels.first_order import first_order
from kernels.linear import KEPT_BY_PRODUCER, dgrad_and_wgrad_operand, keeps_operands, kept_input

from .collectives import all_reduce, gather_first, reduce_scatter_first, wait
from .grads import main_grad_of
from .pipeline.wgrad import defer_weight_grad, deferring


class _ParallelLinearFn(torch.autograd.Function):
    """act(x Wᵀ + b) on the local shard with the column layer's input collective fused in, for overlap.

    comm = "all-reduce": forward identity · backward all-reduce(dx), overlapped with the wgrad matmul.
    comm = "sequence": forward all-gather(x, dim 0) · backward reduce-scatter(dx, dim 0), overlapped with
    wgrad; the full input is re-gathered in backward rather than saved (Megatron's memory trade).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, activation, group, comm, fp8):
        ctx.main_grad = main_grad_of(weight)  # on the parameter, not on an autocast copy of it
        ctx.has_bias, ctx.weight_dtype = bias is not None, weight.dtype
        x, weight, bias = kernels.ops.autocast_operands(x, weight, bias)  # cast before gathering: half the bytes
        x_total = gather_first(x, group) if comm == "sequence" else x  # [s, b, in]
        x_2d = x_total.reshape(-1, x.shape[-1])
        ctx.kept = keeps_operands(fp8, x_2d, weight)
        if ctx.kept:  # x cast once (the wgrad's too) and saved at one byte an element: this rank's rows under SP
            y, preact, x8 = kernels.fp8.linear_forward_keeping_input(
                x_2d, weight, bias, activation, fp8=fp8, fused_cast=kernels.ops.fused_kernels(x.device))
            ctx.x_dtype, ctx.recast = x8.dtype, getattr(x, KEPT_BY_PRODUCER, False)
            x_saved = x if ctx.recast else x8.data  # (x when its producer keeps it anyway: cast again in the wgrad)
            if comm == "sequence" and not ctx.recast:  # this rank's [s/tp · b] rows of [s · b], copied
                rows = x.numel() // x.shape[-1]
                x_saved = x8.data[dist.get_rank(group) * rows:][:rows].clone()
            saved = (x_saved, weight, preact, x8.scale)
        else:
            y, preact = kernels.linear_forward(x_2d, weight, bias, activation, fp8=fp8)
            saved = (x, weight, preact)
        ctx.save_for_backward(*saved)
        ctx.activation, ctx.group, ctx.comm, ctx.fp8 = activation, group, comm, fp8
        return y.view(*x_total.shape[:-1], y.shape[-1]).detach()  # [s, b, out/tp]; not a view (see kernels.linear)

    @staticmethod
    @first_order
    def backward(ctx, grad_out):
        x, weight, preact, *x_scale = ctx.saved_tensors
        group, comm = ctx.group, ctx.comm
        e4m3 = ctx.kept and not ctx.recast
        if comm == "sequence":  # re-gather the input while dgrad runs (its e4m3 bytes when kept so: half the bytes)
            x_total, gather = gather_first(x.view(torch.uint8) if e4m3 else x, group, async_op=True)
        else:
            x_total, gather = x, None
        dy = grad_out.reshape(-1, grad_out.shape[-1]).to(weight.dtype)  # [s*b, out/tp]
        need_dx = ctx.needs_input_grad[0]
        dx, dz, dz_for_w = dgrad_and_wgrad_operand(ctx, dy, weight, preact, need_dx)
        wait(gather)
        if ctx.kept:  # [s*b, in]
            x_total = kept_input(ctx, x_total.view(x.dtype) if e4m3 else x_total.reshape(-1, x.shape[-1]),
                                 x_scale[0])
        pending = None
        if need_dx:
            dx = dx.view(*grad_out.shape[:-1], dx.shape[-1])  # [s, b, in]
            if comm == "all-reduce":
                dx, pending = all_reduce(dx, group, inplace=True, async_op=True)
            elif comm == "sequence":
                dx, pending = reduce_scatter_first(dx, group, async_op=True)  # [s/tp, b, in]
        dw = None
        x_2d = x_total if ctx.kept else x_total.reshape(-1, x_total.shape[-1])
        wgrad = functools.partial(kernels.linear_wgrad, fp8=ctx.fp8)
        if ctx.needs_input_grad[1] and not defer_weight_grad(ctx, 1, dz_for_w, x_2d, wgrad=wgrad):  # (W: later)
            dw = wgrad(dz_for_w, x_2d, main_grad=ctx.main_grad)
        db = kernels.ops.bias_grad(dz, dz.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        wait(pending)
        return dx, dw, db, None, None, None, None


def local_linear(x, weight, bias, activation, group, comm, fp8=None):
    """The layers' one entry to the local matmul: kernels.linear, or _ParallelLinearFn when a collective rides along,
    the weight accumulates into main_grad (checked against DDP), the weight gradient may be deferred or the GEMMs
    run in fp8 (their scales reduced over the group: kernels.fp8.Fp8Scaling)."""
    if fp8 is None and comm is None and not deferring() and not hasattr(weight, "main_grad"):
        return kernels.linear(x, weight, bias, activation=activation)
    return _ParallelLinearFn.apply(x, weight, bias, activation, group, comm, fp8)


class SumReplicaGrads(torch.autograd.Function):
    """forward: identity · backward: grads of replicated rows summed over the ranks holding the same chunk.

    Each rank writes its rows into its chunk's slot of a zero buffer as large as the dense parts; one all-reduce
    over the group then sums every chunk over exactly its replicas.
    """

    repeatable_backward = True  # saves no tensors: a deferred weight gradient (tp.pipeline.defer_wgrad) runs it again

    @staticmethod
    def forward(ctx, layout, group, *tensors):
        ctx.layout, ctx.group = layout, group
        ctx.set_materialize_grads(False)  # under the B/W split the weight's grad comes later, alone
        return tuple(None if t is None else t.view_as(t) for t in tensors)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        rank = dist.get_rank(ctx.group)
        grads = [None if g is None else g.clone() for g in grads]
        slots = []  # (grad, row offset, rows, chunks, my chunk)
        for g in grads:
            offset = 0
            for rows, chunks, replicated in ctx.layout:
                if g is not None and replicated:
                    slots.append((g, offset, rows, chunks, rank * chunks // dist.get_world_size(ctx.group)))
                offset += rows
        if not slots:
            return (None, None, *grads)
        buffers = [g.new_zeros(chunks, rows, *g.shape[1:]) for g, _, rows, chunks, _ in slots]
        for buf, (g, offset, rows, _, mine) in zip(buffers, slots):
            buf[mine] = g[offset:offset + rows]
        flat = torch.cat([b.reshape(-1) for b in buffers])
        dist.all_reduce(flat, group=ctx.group)
        for buf, reduced, (g, offset, rows, _, mine) in zip(buffers, flat.split([b.numel() for b in buffers]), slots):
            g[offset:offset + rows] = reduced.view_as(buf)[mine]
        return (None, None, *grads)
