"""The pipeline runner's checks of what its stages hand it: the p2p buffers' dtype and device from a stage, their
description the stages compare in the runner's first all-reduce, a sent activation or gradient against the receiving
side's buffer, the last stage's loss."""
import itertools
import math

import torch

from ..default_group import collective_device
from . import schedules


def activation_dtype_of(stage):
    """The stage's first floating parameter's (else buffer's) dtype, else torch's default (a stage holding none)."""
    tensors = itertools.chain(stage.parameters(), stage.buffers())
    return next((t.dtype for t in tensors if t.is_floating_point()), torch.get_default_dtype())


def stage_device(stage):
    """Where the stage's first parameter (else buffer) lives, else the collectives' device (a stage holding none)."""
    first = next(itertools.chain(stage.parameters(), stage.buffers()), None)
    return first.device if first is not None else collective_device()


DTYPE_CODES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)


def buffer_code(shape, dtype):
    """The p2p buffers' shape and dtype as numbers, for the stages to compare in their first all-reduce."""
    dims = [*shape[:8], *[0] * (8 - len(shape[:8]))]
    return [DTYPE_CODES.index(dtype) if dtype in DTYPE_CODES else 99, len(shape), math.prod(shape), *dims]


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def check_sent(message: schedules.Message, tensor, buffer: tuple | None) -> None:
    """One line if `tensor` is not one tensor, or (`buffer`: (shape, dtype, batch shape) of the receiving side's
    buffer, which the runners agreed on) not what that buffer holds: the receiver would read its bytes as that."""
    if message.kind == "grad" and tensor is None:
        raise ValueError(f"pipeline stage {message.stage + 1}'s backward gave its input `hidden` no gradient for "
                         f"micro-batch {message.micro}: its output does not depend on it (detached or unused)")
    sent = f"pipeline stage {message.stage - 1}'s output for micro-batch {message.micro}"  # (the receiver's - 1)
    if not torch.is_tensor(tensor):
        raise ValueError(f"{sent} is {'None' if tensor is None else 'a ' + type(tensor).__name__}; the runner moves "
                         "one tensor")
    if buffer is None or (tuple(tensor.shape), tensor.dtype) == buffer[:2]:
        return
    (shape, dtype, batch_shape), hint = buffer, ""
    if tensor.dtype != dtype:
        hint = " (PipelineRunner(activation_dtype=) sets it: under autocast, the autocast dtype)"
    raise ValueError(f"{sent} is a {dtype_name(tensor.dtype)} tensor of shape {tuple(tensor.shape)}; the runner "
                     f"moves activation_shape{batch_shape} = {shape} in {dtype_name(dtype)}{hint}")


def check_loss(out, micro):
    """The last stage's output as a 0-d tensor, if it is the micro-batch's loss (one element: backward starts
    from it)."""
    if not (torch.is_tensor(out) and out.numel() == 1):
        shape = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
        raise ValueError(f"the last pipeline stage returned shape {shape} for micro-batch {micro}: it returns the "
                         "micro-batch's mean loss (a 0-d tensor)")
    return out.reshape(())
