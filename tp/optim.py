"""Mixed precision, the distributed optimizer (Megatron's, ZeRO-1) and global gradient clipping, for any module on any
data-parallel group.

- `DataParallel(module, group=, shard=True, param_dtype=None)` (tp/data_parallel.py): parameters in `param_dtype`,
  fp32 gradient buckets reduced over dp as soon as each is complete (reduce-scatter, or all-reduce with
  `shard=False`).
- `DistributedOptimizer(dp_module, param_groups, optimizer=torch.optim.AdamW, **hyperparameters)`: a torch optimizer
  (one, also over a list of DataParallel modules: a pipeline rank's model chunks) over this rank's 1/dp shard of
  every bucket: the fp32 masters (the parameters' own storage when they are fp32, a copy made before the cast when
  they are bf16) with the reduced fp32 gradient shard. `step()` updates them, copies them into the bf16 parameters
  and starts the buckets' all-gathers, which the next forward waits for bucket by bucket (forward pre-hooks), so
  they overlap with it where the order allows.
- `clip_grad_norm_(params, max_norm, *, mesh=None)` (tp/clip.py): the global L2 norm of the gradients, each parameter
  counted once across tp, pp and dp (x cp), clipped in place; `memory_bytes(model, optimizer)`: what a rank holds
  per category.
"""
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from .clip import CLIP_TAGS, clip_grad_norm_, keep_param_tags, reduced_grad
from .collectives import all_gather_into_tensor
from .data_parallel import DataParallel, default_bucket_numel
from .pipeline import model_chunks

__all__ = ["DataParallel", "DistributedOptimizer", "memory_bytes", "fast_adam", "step_if_finite", "clip_grad_norm_",
           "keep_param_tags", "reduced_grad", "CLIP_TAGS", "default_bucket_numel"]


def fast_adam(params: Iterable[Any]) -> dict[str, bool]:
    """torch Adam/AdamW's fastest implementation for these parameters (tensors or param groups): {"fused": True} (one
    kernel over every tensor, its step count on the device: no host sync) where torch has the fused kernel (fp32,
    bf16, fp16 plain tensors on CUDA or the CPU); {"foreach": True} for FSDP2's DTensor shards; {} (torch's own
    choice, as before) for fp64, the tests' exact precision."""
    params = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    if any(p.dtype == torch.float64 for p in params):
        return {}
    devices = _get_fused_kernels_supported_devices()
    fused = all(type(p) in (torch.Tensor, nn.Parameter) and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and p.device.type in devices for p in params)
    return {"fused": True} if fused else {"foreach": True}


def step_if_finite(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> None:
    """optimizer.step() unless `grad_norm` (the global gradient norm, a 0-d tensor) is not finite: no update, the
    model and the optimizer state as they were (Megatron's skipped step). A fused Adam/AdamW (fast_adam) decides on
    the device (torch's `found_inf` flag, as its GradScaler passes it: no host sync); any other optimizer reads the
    norm on the host (one sync)."""
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    fused = getattr(inner, "_step_supports_amp_scaling", False) and all(g.get("fused") for g in inner.param_groups)
    if not fused:  # (also a fused one whose groups a checkpoint's load_state_dict set to another implementation)
        if grad_norm.isfinite():
            optimizer.step()
        return
    inner.found_inf = (~grad_norm.isfinite()).float()
    try:
        optimizer.step()
    finally:
        del inner.found_inf


MASTER_SHARDS = "master_shards"  # the state dict's key of the fp32 masters kept apart from bf16 parameters


class DistributedOptimizer(torch.optim.Optimizer):
    """`optimizer` (a torch optimizer class, AdamW by default) over this rank's shard of the fp32 masters of one
    `DataParallel` module, or of several (a list: a pipeline rank's model chunks, each wrapped on its own), with
    their reduced fp32 gradients; `params` as torch optimizers take them (groups of the modules' parameters, each
    once). `param_groups` are the inner optimizer's: set lr / weight_decay there, or drive them with a torch LR
    scheduler. `state_dict()` / `load_state_dict()` are this rank's shard (resume at the same layout);
    `full_state()` / `load_full_state()` give whole tensors (checkpoints that reshard). Adam and AdamW run fused (one
    kernel, no host sync: fast_adam) unless `fused` or `foreach` is given."""

    def __init__(self, module: DataParallel | Sequence[DataParallel], params: Iterable[Any] | None = None, *,
                 optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW, **hyperparameters: Any) -> None:
        modules = model_chunks(module)
        for m in modules or [module]:
            if not isinstance(m, DataParallel):
                raise TypeError(f"DistributedOptimizer needs a tp.optim.DataParallel module, got {type(m).__name__} "
                                "(or a list of them)")
        masters_dtypes = sorted({str(b.master_shard.dtype) for m in modules for b in m.buckets})
        if len(masters_dtypes) > 1:
            raise ValueError(f"DistributedOptimizer: the modules' masters have several dtypes {masters_dtypes}")
        bucket_of = {p: b for m in modules for b in m.buckets for p in b.params}
        groups = list((p for m in modules for p in m.parameters() if p.requires_grad) if params is None else params)
        groups = [{"params": groups}] if groups and isinstance(groups[0], torch.Tensor) else \
            [dict(g, params=list(g["params"])) for g in groups]
        given = [p for g in groups for p in g["params"]]
        if len(given) != len(set(given)) or set(given) != set(bucket_of):
            raise ValueError("DistributedOptimizer params must hold each of the module's trainable parameters once")
        self.module, self.modules, self.masters, self.group_of = module, modules, {}, {}
        self._bucket_of = bucket_of
        self.masters_dtype = modules[0].buckets[0].master_shard.dtype
        inner = []
        for g in groups:
            pieces = []
            for p in g["params"]:
                b = bucket_of[p]
                if (piece := b.piece(p)) is not None:
                    master = b.master_shard[piece[1]]
                    master.grad = b.grad_shard[piece[1]]  # a view: the reduced gradient, every step
                    self.masters[p] = master
                    pieces.append(master)
            inner.append(dict(g, params=pieces))
        if optimizer in (torch.optim.Adam, torch.optim.AdamW) and not {"fused", "foreach"} & set(hyperparameters):
            hyperparameters |= fast_adam(self.masters.values())
        self.optimizer = optimizer(inner, **hyperparameters)
        # A torch.optim.Optimizer to LR schedulers and hooks, its groups and state the inner optimizer's (whose
        # parameters are the master shards, not the model's): so Optimizer.__init__ is not called.
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = {}, {}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}
        for g, group in zip(groups, self.optimizer.param_groups):  # (a model parameter's group: its hyperparameters)
            for p in g["params"]:
                self.group_of[p] = group

    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict: this rank's master shards' state (reload at the same layout), and under
        param_dtype=bf16 the fp32 master shards themselves (`master_shards`, per bucket kept apart from its bf16
        parameters: the parameters are only their rounding)."""
        return self.optimizer.state_dict() | {MASTER_SHARDS: [b.master_shard for b in self._separate_masters()]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what state_dict returned (at the same layout), the module's state dict before or after it."""
        state_dict = dict(state_dict)
        shards, mine = state_dict.pop(MASTER_SHARDS, None), self._separate_masters()
        if shards is None:  # (a state dict without them: the masters stay what the module's weights gave)
            shards, mine = [], []
        if [tuple(t.shape) for t in shards] != [tuple(b.master_shard.shape) for b in mine]:
            raise ValueError(f"DistributedOptimizer.load_state_dict: {MASTER_SHARDS} of shapes "
                             f"{[tuple(t.shape) for t in shards]}, this rank's buckets' are "
                             f"{[tuple(b.master_shard.shape) for b in mine]} (another layout or param_dtype)")
        self.optimizer.load_state_dict(state_dict)
        for m in self.modules:
            m.finish_param_sync()
        with torch.no_grad():
            for b, shard in zip(mine, shards):
                b.master_shard.copy_(shard)
                b.param_shard.copy_(b.master_shard)

    def _separate_masters(self):
        """The buckets whose masters are kept apart from their (bf16) parameters, in the modules' order."""
        return [b for m in self.modules for b in m.buckets if b.master_shard is not b.param_shard]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: the parameters are fixed by the DataParallel buckets."""
        raise NotImplementedError("DistributedOptimizer's parameters are fixed by its DataParallel buckets: build a "
                                  "new one over the module")

    def __repr__(self):
        return f"DistributedOptimizer({type(self.optimizer).__name__}, " + \
            "; ".join(m.extra_repr() for m in self.modules) + ")"

    @torch.no_grad()
    def step(self) -> None:
        """Reduce (what is left of) the gradients, step the masters, copy them into the parameters, all-gather."""
        for m in self.modules:
            m.finish_grad_sync()
            m.finish_param_sync()  # (fp32: the masters are the shards the last gather wrote)
        self.optimizer.step()
        for m in self.modules:
            for b in m.buckets:
                if b.master_shard is not b.param_shard:
                    b.param_shard.copy_(b.master_shard)
            m.start_param_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the modules' gradient buffers (set_to_none: torch's signature; the buffers stay)."""
        for m in self.modules:
            m.zero_grad_buffer()

    @torch.no_grad()
    def full_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """{param: {"param": fp32 master, <state>: ...}} for every parameter, whole (its tp-local shape): the dp shards
        all-gathered (collectives over each bucket's group: dp, or edp for experts, module by module). What
        checkpoints store."""
        kinds = {k: v.dim() > 0 for s in self.state.values() for k, v in s.items()}  # name: shaped like the piece?
        groups = {id(b.group): b for m in self.modules if m.shard for b in m.buckets if b.size > 1}
        for b in groups.values():  # a rank may hold no piece at all: every rank learns every entry
            every = [None] * b.size
            dist.all_gather_object(every, kinds, group=b.group)
            kinds = {k: v for d in every for k, v in d.items()}
        out = {}
        for m, b in ((module, b) for module in self.modules for b in module.buckets):
            flats = {"param": b.master_shard}
            for name in (k for k, flat in kinds.items() if flat):
                flats[name] = torch.zeros_like(b.master_shard)
                for p in b.params:
                    if p in self.masters and name in self.state[self.masters[p]]:
                        flats[name][b.piece(p)[1]] = self.state[self.masters[p]][name]
            scalars = {name: torch.full((len(b.params),), -math.inf, dtype=torch.float64)
                       for name, flat in kinds.items() if not flat}
            for name, t in scalars.items():
                for i, p in enumerate(b.params):
                    if p in self.masters and name in self.state[self.masters[p]]:
                        t[i] = float(self.state[self.masters[p]][name])
                if m.shard and b.size > 1:
                    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=b.group)
            for name, flat in flats.items():
                full = flat
                if m.shard and b.size > 1:
                    full = flat.new_empty(b.grad_data.numel())
                    all_gather_into_tensor(full, flat.contiguous(), group=b.group)
                for p, offset in zip(b.params, b.offsets):
                    out.setdefault(p, {})[name] = full[offset:offset + p.numel()].view(p.shape).clone()
            for name, t in scalars.items():
                for i, p in enumerate(b.params):
                    out[p][name] = torch.tensor(t[i].item(), dtype=torch.float32)
        return out

    @torch.no_grad()
    def load_full_state(self, param: nn.Parameter, values: dict[str, torch.Tensor]) -> None:
        """Set one parameter from whole (tp-local) tensors: "param" the fp32 master (also copied into the parameter),
        the others optimizer state (shaped like the parameter: this rank's shard kept; else whole). No collective."""
        b = self._bucket_of[param]
        if "param" in values:
            param.copy_(values["param"])
        master = self.masters.get(param)
        if master is None:
            return
        start = b.piece(param)[0]
        flat = lambda t: t.reshape(-1)[start:start + master.numel()]  # noqa: E731
        if "param" in values:
            master.copy_(flat(values["param"]))
        scalars_to = master.device if self.optimizer.defaults.get("fused") else None  # (fused: its step there)
        self.state[master] = {k: flat(v).to(master.dtype).clone() if v.shape == param.shape
                              else v.to(scalars_to, copy=True) for k, v in values.items() if k != "param"}


# ---- memory --------------------------------------------------------------------------------------------------------

def _bytes(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def memory_bytes(model: nn.Module | Sequence[nn.Module],
                 optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """{param_bytes, grad_bytes, optimizer_bytes} this rank holds: parameters (buckets incl. padding, or the local
    shards), gradients (main_grad buffers, or the .grad backward allocates in the parameters' dtype) and optimizer
    state (its tensors, and fp32 masters kept apart from the parameters). Optimizer state exists after the first
    step. Per parameter this gives the table of Megatron's distributed optimizer (its docs' dist_optimizer.md; ZeRO
    stage 1, Rajbhandari et al. 2020): bf16 18 (DataParallel) vs 6 + 12/d (sharded), fp32 16 vs 8 + 8/d.
    `model`: a module, or a list of them (a pipeline rank's model chunks)."""
    modules = model_chunks(model)
    buckets = [b for m in modules if isinstance(m, DataParallel) for b in m.buckets]
    param = sum(_bytes(b.param_data) for b in buckets)
    grad = sum(_bytes(b.grad_data) for b in buckets)
    masters = sum(_bytes(b.master_shard) for b in buckets if b.master_shard is not b.param_shard)
    params = list(dict.fromkeys(p for m in modules if not isinstance(m, DataParallel) for p in m.parameters()))
    param += sum(_bytes(p) for p in params)
    grad += sum(_bytes(p) for p in params if p.requires_grad)
    state = 0 if optimizer is None else sum(_bytes(v) for s in optimizer.state.values() for v in s.values()
                                            if torch.is_tensor(v))
    return dict(param_bytes=param, grad_bytes=grad, optimizer_bytes=masters + state)
