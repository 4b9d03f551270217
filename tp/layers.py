"""Column- and row-parallel linear layers (Megatron's), drop-in for nn.Linear.

Shapes use Megatron's [s, b, h] activations; any [..., h] works without sequence parallelism. `fp8_recipe=` (one
of kernels.FP8_RECIPES) runs the local GEMMs in float8 with scales equal at every tp split (docs/fp8.md).
"""
import math
from collections.abc import Callable, Sequence
from typing import Any, Self

import torch
import torch.distributed as dist
from torch import nn

import kernels

from . import debug
from .fused_parts import check_parts, rank_major_order, shard_parts
from .grads import sync_grads_over_tp
from .linear_functions import SumReplicaGrads, local_linear
from .mappings import gather_from_tp_region, reduce_from_tp_region, reduce_scatter_to_sp_region, scatter_to_tp_region
from .mesh import SharedGroup, resolve_group

InitMethod = Callable[[torch.Tensor], object]  # fills a dense (master) weight in place, as torch.nn.init's functions


def _default_weight_init(weight):
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # nn.Linear's


def _on(index, device):
    return index if index.device == device else index.to(device, non_blocking=True)


class _ParallelLinear(nn.Module):
    """Shared construction: master-weight init (TP-invariant), sharding of fused parts, and repr."""

    shard_dim = None  # 0: rows of the dense weight (column-parallel), 1: columns (row-parallel)
    group = SharedGroup()

    def __init__(self, in_features, out_features, bias, *, group, init_method, dtype, device, stride, parts,
                 part_replicas=None, fp8_recipe=None, _init=True):
        super().__init__()
        self.group = resolve_group(group)
        self.tp_size, self.tp_rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.in_features, self.out_features = in_features, out_features
        what = ("out_features", "in_features")[self.shard_dim]
        sharded = (out_features, in_features)[self.shard_dim]
        if parts is not None and stride not in (None, 1, len(parts)):
            raise ValueError(f"stride={stride} contradicts parts={tuple(parts)}; give one of them")
        stride = stride or 1
        if parts is None:
            if sharded % stride:
                raise ValueError(f"{what} = {sharded} is not divisible into stride={stride} equal parts")
            parts = (sharded // stride,) * stride
        self.parts, self.part_replicas = check_parts(sharded, self.tp_size, what, parts,
                                                      part_replicas or (1,) * len(parts))
        self.stride = len(self.parts)
        local_parts = [p * r // self.tp_size for p, r in zip(self.parts, self.part_replicas)]
        # Rows of this rank's weight per part: (rows, chunks of the part, replicated?), for the replica grad sum.
        self._replica_layout = tuple((rows, self.tp_size // r, r > 1)
                                     for rows, r in zip(local_parts, self.part_replicas))
        self.replicated = any(r > 1 for r in self.part_replicas)
        # Collectives inside the layer (gather_output, a full input) move shards in rank-major order; with fused
        # parts that order differs from the dense one. rank_major[i] = the dense index at rank-major position i.
        ordered = self.stride > 1 and self.tp_size > 1 and not self.replicated
        # (Plain attributes, not buffers: nothing for DDP to broadcast or a state dict to carry; moved on use.)
        self._rank_major = rank_major_order(self.parts, self.tp_size) if ordered else None
        self._dense_from_rank_major = None if self._rank_major is None else self._rank_major.argsort()
        self.init_method = init_method
        factory = {"dtype": dtype, "device": device}
        local = [out_features, in_features]
        local[self.shard_dim] = sum(local_parts)
        self.weight = nn.Parameter(torch.empty(local, **factory))
        kernels.fp8.check_features(fp8_recipe, local[1], local[0], f"{type(self).__name__}({in_features}, "
                                   f"{out_features}) at tp={self.tp_size}")
        self.fp8_recipe = fp8_recipe
        bias_size = sum(local_parts) if self.shard_dim == 0 else out_features
        self.bias = nn.Parameter(torch.empty(bias_size, **factory)) if bias else None
        for p in (self.weight, self.bias if self.shard_dim == 0 else None):
            if p is not None:  # Megatron's tags: sharded over tp (grad norms count every rank's slice)
                p.tensor_parallel, p.partition_dim = True, self.shard_dim if p.dim() == 2 else 0
                if self.replicated:  # (local rows, ranks holding them) per part: tp.clip_grad_norm_ counts them once
                    p.replica_rows = tuple((rows, self.tp_size // chunks) for rows, chunks, _ in self._replica_layout)
        if _init and self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the full master weight (and bias) with the serial init on CPU in the layer's dtype, then keep this
        rank's slice.

        With the same seed on every rank the shards at TP=N are exact slices of the TP=1 weight; with the default
        init that is also `nn.Linear(in, out, dtype=...)`'s weight and bias.
        """
        master = torch.empty(self.out_features, self.in_features, dtype=self.weight.dtype, device="cpu")
        (self.init_method or _default_weight_init)(master)
        master_bias = None
        if self.bias is not None:
            master_bias = torch.zeros(self.out_features, dtype=self.bias.dtype, device="cpu")
            if self.init_method is None:
                bound = 1 / math.sqrt(self.in_features)
                nn.init.uniform_(master_bias, -bound, bound)
        self.load_master(master, master_bias)

    def shard_indices(self) -> torch.Tensor:
        """The dense indices, along the sharded dim (rows: column layer; columns: row layer), this rank holds."""
        n = (self.out_features, self.in_features)[self.shard_dim]
        return shard_parts(torch.arange(n, device="cpu"), 0, self.tp_rank, self.tp_size, self.parts, self.part_replicas)

    def shard_dense(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a dense weight-shaped tensor (or, for the column layer, a bias-shaped one)."""
        dim = self.shard_dim if tensor.dim() == 2 else 0
        return tensor.index_select(dim, self.shard_indices().to(tensor.device))

    @torch.no_grad()
    def gather_dense(self, tensor: torch.Tensor) -> torch.Tensor:
        """The dense tensor from every rank's slice of it (a collective over the group): shard_dense's inverse.
        A row layer's bias is whole on every rank and comes back as it is."""
        dim = self.shard_dim if tensor.dim() == 2 else 0
        if self.tp_size == 1 or (self.shard_dim == 1 and tensor.dim() == 1):
            return tensor
        pieces = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        dist.all_gather(pieces, tensor.contiguous(), group=self.group)
        n = (self.out_features, self.in_features)[self.shard_dim]
        dense = torch.arange(n, device="cpu")
        index = torch.cat([shard_parts(dense, 0, r, self.tp_size, self.parts, self.part_replicas)
                           for r in range(self.tp_size)])
        order = index.argsort(stable=True)  # replicated chunks: each dense row taken from its first holder
        ordered = index[order]
        first = torch.empty_like(index, dtype=torch.bool)
        first[order] = torch.cat([torch.tensor([True], device="cpu"), ordered[1:] != ordered[:-1]])
        shape = list(tensor.shape)
        shape[dim] = n
        kept = first.nonzero().squeeze(1).to(tensor.device)
        source = torch.cat(pieces, dim).index_select(dim, kept)
        return tensor.new_empty(shape).index_copy_(dim, index[first].to(tensor.device), source)

    @torch.no_grad()
    def load_master(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's slice of the dense [out, in] weight (and bias) into the local parameters."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"master weight shape {tuple(weight.shape)} != {(self.out_features, self.in_features)}")
        if (self.bias is None) != (bias is None):
            raise ValueError("the layer has a bias: give load_master(weight, bias)" if bias is None else
                             "the layer has no bias (bias=False), but load_master was given one")
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"master bias shape {tuple(bias.shape)} != {(self.out_features,)}")
        self.weight.copy_(self.shard_dense(weight))
        if bias is not None:
            self.bias.copy_(self.shard_dense(bias) if self.shard_dim == 0 else bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options: Any) -> Self:
        """Shard a dense nn.Linear onto this rank (dtype and device follow the linear unless given in options)."""
        weight = getattr(linear, "weight", None)
        if not (hasattr(linear, "in_features") and hasattr(linear, "out_features") and weight is not None
                and weight.dim() == 2):
            raise TypeError(f"from_linear needs an nn.Linear (in_features, out_features, a 2-D weight), got "
                            f"{type(linear).__name__}")
        options = {"dtype": weight.dtype, "device": weight.device} | options
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, _init=False, **options)
        layer.load_master(weight.detach(), None if linear.bias is None else linear.bias.detach())
        return layer

    def _fp8(self):
        """The layer's fp8 GEMMs (None: none), their scales reduced over the group that splits the weight."""
        if self.fp8_recipe is None:
            return None
        return kernels.fp8.Fp8Scaling(self.fp8_recipe, self.group, ("out", "in")[self.shard_dim])

    def _check_input(self, x, features, what, *, replicated=False):
        name = type(self).__name__
        if debug.is_debug():  # before the local checks: a rank whose shape alone is wrong must not leave the others
            debug.check(x, self.group, f"the input of {name}", replicated=replicated)
        if x.shape[-1] != features:
            raise ValueError(f"input's last dim is {x.shape[-1]}; {name} expects {features} ({what})")
        if x.dtype != self.weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise ValueError(f"input dtype {x.dtype} != weight dtype {self.weight.dtype}")
        if self.sequence_parallel and x.dim() < 2:
            raise ValueError(f"sequence_parallel {name} needs [s, b, h] (or [s, h]) input, got shape {tuple(x.shape)}")

    def extra_repr(self) -> str:
        local = "x".join(map(str, self.weight.shape))
        equal = len(set(self.parts)) == 1
        fused = "" if self.stride == 1 else f", stride={self.stride}" if equal else f", parts={self.parts}"
        fused += f", part_replicas={self.part_replicas}" if self.replicated else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"tp={self.tp_size}, shard=dim{self.shard_dim}{fused} (local weight {local})"
            + (f", fp8_recipe={self.fp8_recipe}" if self.fp8_recipe else "")
        )

    def tune_kernels(self, tokens: int, seen: set | None = None) -> bool:
        """Tune this layer's Triton kernels for `tokens` rows per local matmul (kernels.tune_linear), unless `seen`
        (a set shared over a model's layers) already holds a layer of the same shapes and flags; whether it launched.
        """
        act, main_grad = getattr(self, "activation", None), hasattr(self.weight, "main_grad")
        if self.fp8_recipe is not None:  # torch._scaled_mm: no Triton kernel to tune
            return False
        # the bias joins the matmul unless the caller adds it (skip_bias_add) or a row layer's reduction comes first
        fused_bias = None if self.skip_bias_add or (self.shard_dim == 1 and self.tp_size > 1) else self.bias
        key = (tuple(self.weight.shape), self.weight.dtype, self.weight.device, fused_bias is None, act, main_grad)
        if seen is not None:
            if key in seen:
                return False
            seen.add(key)
        return kernels.tune_linear(self.weight, fused_bias, act, tokens=tokens, main_grad=main_grad)


class ColumnParallelLinear(_ParallelLinear):
    """Y = act(X Aᵀ + b) with A split by rows (output features): weight [out/tp, in], bias [out/tp].

    forward: identity (SP: all-gather the sequence) · backward: all-reduce (SP: reduce-scatter) of the input grad.
    `gather_output` all-gathers Y's last dim; otherwise Y stays [.., out/tp] for a following RowParallelLinear.
    `activation` fuses bias + activation into the matmul epilogue; "swiglu" reads a fused [gate; up] weight
    (stride 2) and returns out_features/2 columns.

    Fused weights: `stride=k` (k equal parts, e.g. 3 for QKV without GQA) or `parts=(q, k, v)` (unequal sizes, e.g.
    GQA) shard every part separately, so each rank holds its slice of each. `part_replicas=(1, r, r)` lets a part
    with fewer heads than ranks be held whole-chunk by r ranks each (kv heads < tp): ranks 0..r-1 hold its first
    chunk, and so on; those rows' grads are summed over their replicas inside backward.

    `disable_grad_reduce=True` (Megatron's option) leaves the input gradient partial: the caller feeds several
    column layers that read one tensor through a single `copy_to_tp_region` of it, so their summed input gradient
    is all-reduced once (q, k and v; gate and up) instead of once per layer.

    `skip_bias_add=True` (Megatron's) returns (Y without the bias, bias [out/tp]) for the caller to add.
    """

    shard_dim = 0

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, gather_output: bool = False,
        sequence_parallel: bool = False, group: dist.ProcessGroup | None = None, init_method: InitMethod | None = None,
        dtype: torch.dtype | None = None, device: torch.device | str | None = None, stride: int | None = None,
        parts: Sequence[int] | None = None, part_replicas: Sequence[int] | None = None, activation: str | None = None,
        disable_grad_reduce: bool = False, fp8_recipe: str | None = None, skip_bias_add: bool = False,
        _init: bool = True,
    ) -> None:
        if skip_bias_add and (activation or gather_output):
            raise ValueError(f"skip_bias_add=True with activation={activation!r}: the bias is added before the "
                             "activation" if activation else "skip_bias_add=True with gather_output=True: the "
                             "returned bias would be this rank's shard of the gathered output's")
        self.skip_bias_add = skip_bias_add
        if disable_grad_reduce and sequence_parallel:
            raise ValueError("disable_grad_reduce=True with sequence_parallel=True: the sequence-parallel input "
                             "needs the layer's own all-gather and reduce-scatter")
        self.disable_grad_reduce = disable_grad_reduce
        kernels.ops.check_activation(activation)
        if activation == "swiglu":
            stride = stride or 2
            if stride != 2 or (parts is not None and (len(parts) != 2 or parts[0] != parts[1])):
                raise ValueError(f"activation='swiglu' needs two equal fused parts (gate, up): stride=2, got "
                                 f"stride={stride}" + (f", parts={tuple(parts)}" if parts is not None else ""))
        self.gather_output, self.sequence_parallel, self.activation = gather_output, sequence_parallel, activation
        super().__init__(
            in_features, out_features, bias, group=group, init_method=init_method, dtype=dtype, device=device,
            stride=stride, parts=parts, part_replicas=part_replicas, fp8_recipe=fp8_recipe, _init=_init,
        )
        if self.replicated and gather_output:
            raise ValueError(f"gather_output=True with part_replicas={self.part_replicas}: the gathered output would "
                             "repeat the replicated parts")
        if activation == "swiglu":  # the output is F wide, each rank's slice its chunk of F: already dense-ordered
            self._dense_from_rank_major = None

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:  # [s(/tp), b, in]
        self._check_input(x, self.in_features, "in_features", replicated=not self.sequence_parallel)
        comm = None if self.tp_size == 1 or self.disable_grad_reduce else \
            "sequence" if self.sequence_parallel else "all-reduce"
        weight, bias = self.weight, self.bias
        if self.replicated and torch.is_grad_enabled():
            # wgrad would land in main_grad before the replicas are summed, unless a hook folds .grad into main_grad
            # (tp.optim.DataParallel's): the summed grads then reach main_grad through .grad
            if hasattr(weight, "main_grad") and not getattr(weight, "folds_grad_into_main_grad", False):
                raise ValueError(f"weight.main_grad with part_replicas={self.part_replicas} is not supported: the "
                                 "replicated rows' grads are summed in backward, which main_grad accumulation skips")
            weight, bias = SumReplicaGrads.apply(self._replica_layout, self.group, weight, bias)
        if self.skip_bias_add:  # [s, b, out/tp] and bias [out/tp] for the caller's fused bias(-dropout)-add
            return local_linear(x, weight, None, None, self.group, comm, self._fp8()), bias
        y = local_linear(x, weight, bias, self.activation, self.group, comm, self._fp8())  # [s, b, out/tp]
        if not self.gather_output or self.tp_size == 1:
            return y
        y = gather_from_tp_region(y, self.group)  # [s, b, out], rank-major
        if self._dense_from_rank_major is None:
            return y
        return y.index_select(-1, _on(self._dense_from_rank_major, y.device))

    def extra_repr(self) -> str:
        act = f", activation={self.activation}" if self.activation else ""
        act += ", disable_grad_reduce=True" if self.disable_grad_reduce else ""
        act += ", skip_bias_add=True" if self.skip_bias_add else ""
        return f"{super().extra_repr()}, gather_output={self.gather_output}, " \
               f"sequence_parallel={self.sequence_parallel}{act}"


class RowParallelLinear(_ParallelLinear):
    """Y = X Aᵀ + b with A split by columns (input features): weight [out, in/tp], bias [out] added once.

    forward: all-reduce (SP: reduce-scatter along the sequence) · backward: identity (SP: all-gather).
    With sequence parallelism each rank's bias gradient covers its sequence shard only: backward sums it over the
    group (one small all-reduce), unless `sequence_parallel_grad_sync=False`, which tags the bias
    `sequence_parallel = True` for `tp.allreduce_sequence_parallel_grads` to sum after backward instead.
    `skip_bias_add=True` (Megatron's) returns (Y without the bias, bias [out]) for the caller to add.
    """

    shard_dim = 1

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, input_is_parallel: bool = True,
        sequence_parallel: bool = False, group: dist.ProcessGroup | None = None, init_method: InitMethod | None = None,
        dtype: torch.dtype | None = None, device: torch.device | str | None = None, stride: int | None = None,
        parts: Sequence[int] | None = None, sequence_parallel_grad_sync: bool = True, fp8_recipe: str | None = None,
        skip_bias_add: bool = False, _init: bool = True,
    ) -> None:
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.skip_bias_add = skip_bias_add
        super().__init__(
            in_features, out_features, bias, group=group, init_method=init_method, dtype=dtype, device=device,
            stride=stride, parts=parts, fp8_recipe=fp8_recipe, _init=_init,
        )
        # Under SP the bias meets a sequence shard, so its gradient is partial per rank: summed over tp inside
        # backward, or (sync off) tagged for tp.allreduce_sequence_parallel_grads.
        self.sync_bias_grad = sequence_parallel and sequence_parallel_grad_sync
        if self.bias is not None:
            self.bias.sequence_parallel = sequence_parallel and not sequence_parallel_grad_sync

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        # x: [s, b, in/tp] (or [s, b, in] when not input_is_parallel)
        if not self.input_is_parallel and self.tp_size > 1:
            self._check_input(x, self.in_features, "in_features", replicated=True)
            if self._rank_major is not None:  # rank-major, so the split hands out the fused parts
                x = x.index_select(-1, _on(self._rank_major, x.device))
            x = scatter_to_tp_region(x, self.group)
        else:
            self._check_input(x, self.weight.shape[1], "in_features/tp")
        if self.tp_size == 1 and not self.skip_bias_add:  # nothing to reduce: the bias joins the matmul
            return local_linear(x, self.weight, self.bias, None, self.group, None, self._fp8())
        y = local_linear(x, self.weight, None, None, self.group, None, self._fp8())  # [s, b, out] partial sums
        if self.tp_size == 1:
            pass
        elif self.sequence_parallel:
            y = reduce_scatter_to_sp_region(y, self.group, check=False)  # [s/tp, b, out] (its input was checked)
        else:
            y = reduce_from_tp_region(y, self.group, in_place=True, check=False)  # a fresh tensor: its own storage
        if self.bias is None:
            return (y, None) if self.skip_bias_add else y
        bias, = sync_grads_over_tp(self.bias, group=self.group) if self.sync_bias_grad else (self.bias,)
        if self.skip_bias_add:  # [s(/tp), b, out] and bias [out] for the caller's fused bias(-dropout)-add
            return y, bias
        return y + bias.to(y.dtype)  # (autocast: y may be bf16)

    def extra_repr(self) -> str:
        skip = ", skip_bias_add=True" if self.skip_bias_add else ""
        return f"{super().extra_repr()}, input_is_parallel={self.input_is_parallel}, " \
               f"sequence_parallel={self.sequence_parallel}{skip}"
