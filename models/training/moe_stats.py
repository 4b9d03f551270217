"""The job's mixture-of-experts log: per optimizer step, over every MoE layer of the model (all pipeline stages) and
every micro-batch of every data-parallel rank,

- `moe_aux_loss`, `moe_z_loss`: the load-balancing and z losses (coefficients included, as they join the gradient),
  summed over the layers, the mean over the step's micro-batches of every dp rank (each micro-batch's value covers
  its tokens on the tp·cp ranks: models.training.model.aux_losses_per_micro_batch);
- `moe_load_imbalance`: the max over layers of the busiest expert's routed tokens / the mean per expert (1: even),
  over the step's tokens;
- `moe_dropped_tokens` (with a capacity factor): the routed (token, expert) slots the experts' capacity dropped;
- `moe_seq_aux_loss` (with DeepSeek-V3's sequence-wise loss): summed over the layers, the mean over micro-batches as
  the aux loss's.

Hooks on the routers and MoE layers add up this rank's share during the training forwards (not a recomputed
forward, nor evaluation), and `collect()` sums every rank's in one all-reduce of L·E + 4L numbers over the world:
each rank counts the tokens it routes (its own share under tp, cp and dp, so each token once), the aux values, equal
on a micro-batch's tp·cp ranks, are taken from one of them.
"""
import torch
import torch.distributed as dist
from torch import nn

import tp
from tp.host_syncs import host_values
from tp.mesh import Mesh
from tp.moe.router import expert_counts


def _recomputing() -> bool:
    """Inside a backward pass: activation recomputation's forward (its routing was counted the first time). Not
    under torch.compile (--compile), which cannot trace the question: a compiled block counts every forward."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


class MoEStats:
    """The step's MoE statistics of this rank's model chunks (see the module docstring)."""

    def __init__(self, chunks: list[nn.Module], mesh: Mesh, num_layers: int, num_experts: int, *,
                 capacity: bool = False, sequence: bool = False) -> None:
        self.mesh, self.num_experts, self.capacity, self.sequence = mesh, num_experts, capacity, sequence
        device = tp.mesh.collective_device()  # (kept there: no host sync per layer and micro-batch)
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        # aux, z, dropped slots, sequence-wise
        self.values = torch.zeros(4, num_layers, dtype=torch.float64, device=device)
        self.reports_aux = mesh.local_rank("tp-cp") == 0  # (equal on the tp·cp ranks of a micro-batch)
        for chunk in chunks:
            first = chunk.layer_range[0]
            for i, block in enumerate(chunk.layers):
                if isinstance(block.mlp, tp.moe.MoE):
                    block.mlp.router.register_forward_hook(self._routed(first + i))
                    block.mlp.register_forward_hook(self._moe(first + i))

    def _counting(self, module):
        return module.training and torch.is_grad_enabled() and not _recomputing()

    def _routed(self, layer):
        def hook(module, args, routing):
            if self._counting(module):
                self.counts[layer] += expert_counts(routing.indices, self.num_experts).to(self.counts)
        return hook

    def _moe(self, layer):
        def hook(module, args, out):
            if not self._counting(module):
                return
            if module.last is not None and self.reports_aux:
                self.values[0, layer] += module.last.load_balancing.to(self.values)
                self.values[1, layer] += module.last.z.to(self.values)
                self.values[3, layer] += module.last.sequence.to(self.values)
            if module.capacity_factor is not None:
                self.values[2, layer] += module.dropped_slots.to(self.values)
        return hook

    def collect(self, micro_batches: int) -> dict[str, float]:
        """The step's log entries (collective over the world; `micro_batches`: the step's, over every dp rank), then
        zeroed for the next step: entries(gather()), read at once (a host sync)."""
        return self.entries(self.gather().cpu(), micro_batches)

    def gather(self) -> torch.Tensor:
        """Every rank's counts and values summed (one all-reduce over the world), left on the device; the
        accumulators zeroed for the next step."""
        flat = torch.cat([self.counts.flatten(), self.values.flatten()])
        if dist.get_world_size() > 1:
            dist.all_reduce(flat)
        self.counts.zero_()
        self.values.zero_()
        return flat

    def entries(self, flat: torch.Tensor, micro_batches: int) -> dict[str, float]:
        """The log entries from what gather() returned, read on the host (a CPU tensor)."""
        counts = flat[:self.counts.numel()].view(self.counts.shape)
        aux, z, dropped, sequence = flat[self.counts.numel():].view(self.values.shape)
        busy = host_values(counts.sum(1) > 0)  # the MoE layers
        ratios = host_values(counts.max(1).values / counts.mean(1))
        (aux,), (z,), (dropped,), (sequence,) = (host_values(t.sum().reshape(1)) for t in (aux, z, dropped, sequence))
        record = {"moe_aux_loss": aux / micro_batches, "moe_z_loss": z / micro_batches,
                  "moe_load_imbalance": max((r for r, b in zip(ratios, busy) if b), default=1.0)}
        if self.capacity:
            record["moe_dropped_tokens"] = int(dropped)
        if self.sequence:
            record["moe_seq_aux_loss"] = sequence / micro_batches
        return record
