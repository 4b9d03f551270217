"""A step's log values kept on the device until the log asks for them: the loss, the gradient norm, the MoE and MTP
statistics of each optimizer step stay where they were computed (no host sync in the step), and the steps since the
last read are read together, in one copy to the host, at the next step that logs, evaluates or saves."""
from dataclasses import dataclass, field

import torch


@dataclass
class StepValues:
    """One optimizer step (from 1): its host numbers (`record`: time, lr, memory), its device ones (`device`: name ->
    a tensor, read later), and host entries for the end of its log record (`after`: the stragglers')."""
    step: int
    record: dict
    device: dict[str, torch.Tensor]
    after: dict = field(default_factory=dict)


def read(pending: list[StepValues]) -> list[dict[str, float | list[float]]]:
    """Each step's device values on the host (a 0-d tensor: a float; else a list), in one device-to-host copy for
    them all: the one host sync of the steps read."""
    tensors = [t.detach().reshape(-1).to(torch.float64) for values in pending for t in values.device.values()]
    if not tensors:
        return [{} for _ in pending]
    flat = torch.cat([t.to(tensors[0].device) for t in tensors]).tolist()
    out, start = [], 0
    for values in pending:
        host = {}
        for name, t in values.device.items():
            host[name] = flat[start] if t.dim() == 0 else flat[start:start + t.numel()]
            start += t.numel()
        out.append(host)
    return out
