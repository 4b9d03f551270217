"""The job's multi-token-prediction log: `mtp_loss`, per optimizer step the mean over the step's micro-batches of
every dp rank of the MTP loss (models/mtp.py: the mean over the depths, without mtp_loss_scaling_factor), which the
last pipeline stage computes beside the LM loss. A hook on each last-stage chunk adds up this rank's micro-batches;
one rank of each tp·cp group (where the value is equal) reports; `collect()` sums over the world in one all-reduce."""
import torch
import torch.distributed as dist
from torch import nn

import tp
from tp.mesh import Mesh


class MTPStats:
    """The step's MTP loss of this rank's model chunks (see the module docstring)."""

    def __init__(self, chunks: list[nn.Module], mesh: Mesh) -> None:
        self.total = torch.zeros((), dtype=torch.float64, device=tp.mesh.collective_device())
        self.reports = mesh.local_rank("tp-cp") == 0
        for chunk in chunks:
            if chunk.post_process:
                chunk.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        value = module.mtp_loss()
        if self.reports and value is not None:
            self.total += value.to(self.total)

    def collect(self, micro_batches: int) -> dict[str, float]:
        """{"mtp_loss": ...} (collective over the world; `micro_batches`: the step's, over every dp rank), then
        zeroed for the next step: entries(gather()), read at once (a host sync)."""
        return self.entries(self.gather().item(), micro_batches)

    def gather(self) -> torch.Tensor:
        """The step's sum over the world (one all-reduce), left on the device; zeroed for the next step."""
        total = self.total.clone()
        if dist.get_world_size() > 1:
            dist.all_reduce(total)
        self.total.zero_()
        return total

    @staticmethod
    def entries(total: float, micro_batches: int) -> dict[str, float]:
        """The log entry from gather()'s value, read."""
        return {"mtp_loss": total / micro_batches}
