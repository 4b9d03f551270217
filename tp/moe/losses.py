"""Load-balancing and z losses over the micro-batch's global tokens, and how their gradient joins backward.

Switch Transformer / GShard load balancing: aux = coeff · E · Σ_i f_i · P_i, with f_i the fraction of the T·k routed
slots that chose expert i and P_i expert i's mean probability over the T tokens. Router z-loss (ST-MoE): coeff ·
mean_t logsumexp(logits_t)². T covers every token of the micro-batch, wherever the split put them: each rank sums
its counts, probabilities and squared log-sum-exps, and one all-reduce of that small vector over the group holding the
micro-batch's tokens (the stage's tp·cp·dp ranks) gives every rank the global statistics. So the value is the same at
any tp / sequence-parallel / cp / ep / dp split (computed per shard, as in Megatron's history, it is not).

The all-reduce's backward is the identity: each rank's backward yields the gradient of its own tokens' share, so
summed over the ranks it is the gradient of the global loss. The returned LM loss is untouched: the losses' gradient
is attached to the routing weights (Megatron's MoEAuxLossAutoScaler): backward hands the aux-loss node `scale`
as its gradient. `scale` = the data-parallel size (the LM loss is a mean per data-parallel micro-batch, so data
parallelism averages gradients; the aux loss is already global) times the trainer's own loss scale (1 / the number
of accumulated micro-batches, a loss-scaling factor), set with `tp.moe.set_aux_loss_scale`.
"""
import torch
import torch.distributed as dist

from ..mappings import reduce_from_tp_region
from .router import expert_counts


class AuxLosses:
    """One forward's values (detached, fp32 tensors on the device, equal on every rank): for logging. `sequence`:
    the sequence-wise balance loss (equal on the ranks holding the micro-batch), zero when off."""

    def __init__(self, load_balancing: torch.Tensor, z: torch.Tensor, tokens_per_expert: torch.Tensor | None,
                 sequence: torch.Tensor | None = None) -> None:
        self.load_balancing, self.z, self.tokens_per_expert = load_balancing, z, tokens_per_expert
        self.sequence = torch.zeros_like(load_balancing) if sequence is None else sequence

    def __repr__(self) -> str:
        return (f"AuxLosses(load_balancing={self.load_balancing.item():.6g}, z={self.z.item():.6g}, "
                f"sequence={self.sequence.item():.6g})")


def aux_losses(probs: torch.Tensor, logits: torch.Tensor, indices: torch.Tensor, *, aux_coeff: float,
               z_coeff: float, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, AuxLosses]:
    """(aux + z for backward, the values) from this rank's probs [T, E], logits [T, E] and choices [T, k]: the
    statistics summed over `group` (one all-reduce of 2E + 2 numbers in fp64)."""
    E, k = probs.shape[-1], indices.shape[-1]
    counts = expert_counts(indices, E).double()  # [E]
    stats = torch.cat([counts, probs.double().sum(0),
                       torch.logsumexp(logits.double(), dim=-1).square().sum().reshape(1),
                       counts.new_tensor([probs.shape[0]])])
    if group is not None and dist.get_world_size(group) > 1:
        stats = reduce_from_tp_region(stats, group, check=False)  # backward: identity (each rank's share)
    counts, prob_sums, z_sum, tokens = stats.split([E, E, 1, 1])
    tokens = tokens.clamp(min=1)
    load_balancing = aux_coeff * E * ((counts.detach() / (tokens * k)) * (prob_sums / tokens)).sum()
    z = z_coeff * (z_sum / tokens).sum()
    values = AuxLosses(load_balancing.detach().float(), z.detach().float(), counts.detach())
    return load_balancing + z, values


def sequence_aux_loss(probs: torch.Tensor, indices: torch.Tensor, sequence: torch.Tensor, sequences: int, *,
                      coeff: float, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's complementary sequence-wise balance loss (arXiv:2412.19437 §2.1.2), for backward and its value:
    coeff · the mean over the micro-batch's `sequences` of Σ_i f_i·P_i, per sequence f_i = E/(k·S)·(its tokens that
    chose expert i) and P_i = the mean over its S tokens of expert i's probability (sigmoid: the scores normalised
    over E). This rank's rows are probs [T, E], choices [T, k], `sequence` [T] (each row's sequence in [0,
    sequences)); their per-sequence sums are summed over `group`, the ranks holding the rest of these sequences (the
    stage's tp·cp ranks): one all-reduce of 2·b·E + b numbers in fp64, backward the identity (each rank's share)."""
    E, k = probs.shape[-1], indices.shape[-1]
    slots = (sequence.unsqueeze(-1) * E + indices).flatten()  # [T·k] (sequence, expert) of every choice
    counts = slots.new_zeros(sequences * E, dtype=torch.float64).index_add_(
        0, slots, torch.ones_like(slots, dtype=torch.float64))
    prob_sums = probs.new_zeros(sequences, E, dtype=torch.float64).index_add(0, sequence, probs.double())
    tokens = probs.new_zeros(sequences, dtype=torch.float64).index_add_(
        0, sequence, torch.ones_like(sequence, dtype=torch.float64))
    stats = torch.cat([counts, prob_sums.flatten(), tokens])
    if group is not None and dist.get_world_size(group) > 1:
        stats = reduce_from_tp_region(stats, group, check=False)  # backward: identity (each rank's share)
    counts, prob_sums, tokens = stats.split([sequences * E, sequences * E, sequences])
    tokens = tokens.clamp(min=1).unsqueeze(-1)
    f = counts.detach().view(sequences, E) * E / (k * tokens)
    loss = coeff * (f * prob_sums.view(sequences, E) / tokens).sum(-1).mean()
    return loss, loss.detach().float()


class _AttachAuxGrad(torch.autograd.Function):
    """forward: x unchanged · backward: x's gradient, and `scale` as the gradient of the aux loss (Megatron's
    MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.aux_shape, ctx.scale = aux.shape, scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=torch.float64, device=grad.device), None


def attach_aux_grad(x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
    """x, with aux's gradient (times `scale`) joining backward where x's does."""
    if not aux.requires_grad:
        return x
    return _AttachAuxGrad.apply(x, aux, float(scale))
