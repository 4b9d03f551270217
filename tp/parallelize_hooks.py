"""The hooks tp.parallelize adds to a model's modules: the shared copy of the column layers' input, gradient sums over
tp for replicated parameters and for the tail of a replicated output, and the per-rank RNG for attention dropout
over this rank's heads."""
import torch

from . import debug
from .grads import sync_grads_over_tp
from .mappings import copy_to_tp_region
from .mesh import SharedGroup
from .random import fork_rng


class SharedInputCopy:
    """Column layers reading the same tensor one after another (q, k and v; gate and up) share one
    copy_to_tp_region of it, so their summed input gradient is all-reduced once in backward, not once per layer (the
    layers have disable_grad_reduce).

    Correct whatever else reads the tensor: only the column layers' (partial) gradients pass through the copy. Only
    the latest input is held (another input gets its own copy: one all-reduce more, never a wrong sum), so nothing
    outlives the next column layer call or the end of the model's forward.
    """

    group = SharedGroup()

    def __init__(self, group):
        self.group, self.last = group, (None, None)

    def __call__(self, name, layer, args):
        x = args[0]
        if self.last[0] is not x:
            if debug.is_debug():  # name the layer (the mapping's own check would say "CopyToTP")
                debug.check(x, self.group, f"the input of {name}", replicated=True)
            self.last = (x, copy_to_tp_region(x, self.group))
        return (self.last[1], *args[1:])

    def clear(self, *_):
        self.last = (None, None)


def sum_grads_in_backward(module, group):
    """The module's own parameters enter each forward through sync_grads_over_tp: one all-reduce of their grads in
    backward, before they reach .grad (so gradient accumulation stays right)."""
    def swap_in(mod, args):
        whole = {n: p for n, p in mod._parameters.items() if p is not None}
        mod.__dict__["_tp_whole_params"] = whole
        mod._parameters.update(zip(whole, sync_grads_over_tp(*whole.values(), group=group)))

    def swap_back(mod, args, output):
        mod._parameters.update(mod.__dict__.pop("_tp_whole_params"))

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(swap_back, always_call=True)


class TailGradSum:
    """A forward hook: the output's last `width` features pass through copy_to_tp_region (identity forward, the
    gradient all-reduced over tp in backward), the features before them as they are. A hook object holding its
    group in a SharedGroup, so a deep copy of the model shares the group."""

    group = SharedGroup()

    def __init__(self, width, group):
        self.width, self.group = width, group

    def __call__(self, module, args, output):
        head, tail = output.split([output.shape[-1] - self.width, self.width], dim=-1)
        return torch.cat([head, copy_to_tp_region(tail, self.group)], dim=-1)


def attention_dropout(attention):
    """The attention-probability dropout an HF attention module applies in training (0.0: none)."""
    p = getattr(attention, "attention_dropout", None)
    if p is None:
        p = getattr(getattr(attention, "attn_dropout", None), "p", 0.0)  # GPT-2
    return float(p or 0.0)


class HeadsRngFork:
    """Attention dropout over this rank's heads draws from the per-tp-rank stream (Megatron's), from the attention's
    entry to its output projection: different heads get independent masks, and what follows the projection
    (replicated, e.g. GPT-2's resid_dropout) keeps the shared stream. Recompute-safe (tp.fork_rng). A hook object
    (not closures), so a deep copy of the model gets its own."""

    def __init__(self, attention, out_proj):
        self.active = None
        attention.register_forward_pre_hook(self.enter)
        if out_proj is not None:
            out_proj.register_forward_pre_hook(self.leave)
        attention.register_forward_hook(self.leave, always_call=True)

    def enter(self, attention, args):
        if attention.training and attention_dropout(attention) > 0:
            try:
                fork = fork_rng()
                fork.__enter__()
            except RuntimeError as e:
                raise RuntimeError(f"attention dropout over tensor-parallel heads draws per-rank masks: {e}") from None
            self.active = fork

    def leave(self, *_):
        if self.active is not None:
            fork, self.active = self.active, None
            fork.__exit__(None, None, None)
