"""Multi-token prediction (DeepSeek-V3, arXiv:2412.19437 §2.2; Megatron's --mtp-num-layers): D extra depths on the
last pipeline stage, depth k predicting the token k + 1 after each position.

    h'_k = W_k · [RMSNorm(Emb(t_{i+k})); RMSNorm(h_{k-1})]      (embedding first: DeepSeek's eh_proj layout)
    h_k = Block_k(h'_k),  logits_k = Output(RMSNorm_k(h_k))       (Emb and Output: the main model's, shared)
    L_MTP = mtp_loss_scaling_factor / D · Σ_k CE(logits_k, t_{i+k+1})

h_0 is the main model's last hidden state (before its final norm). The window keeps its length: at depth k the last
k positions have no token to read or predict (their targets are ignored), and under documents a position whose
token k ahead lies in another document is ignored too. Each depth's block is the main model's kind (an MoE block when
the last layer is one), its layer index num_layers + k - 1 (its own dropout masks). W_k is whole on every tp rank
(models.mla.ReplicatedLinear: under SP each rank projects its own tokens).

The loss joins backward through the LM loss the model returns, whose value it leaves unchanged (it adds
L_MTP - L_MTP, exactly zero, whose gradient is L_MTP's): pipelines, gradient accumulation and loss scaling then scale
it as they scale the LM loss. `GPT.mtp_loss()` gives its value (Σ_k CE_k / D, without the factor) for logging.
"""
import math

import torch
import torch.distributed as dist
from torch import nn

from .config import GPTConfig
from .mla import ReplicatedLinear
from .norm import Norm

IGNORE_INDEX = -100


class MTPLayer(nn.Module):
    """One depth (the module docstring): [s(/cp)(/tp), b, h] hidden and embedded tokens -> the next depth's hidden."""

    def __init__(self, config: GPTConfig, block: nn.Module, *, group: dist.ProcessGroup | None = None,
                 _init: bool = True) -> None:
        super().__init__()
        c, sp = config, config.sequence_parallel
        norm = dict(sequence_parallel=sp, grad_sync=c.sequence_parallel_grad_sync, group=group)
        self.embedding_norm = Norm(c.norm, c.hidden_size, c.norm_eps, **norm)
        self.hidden_norm = Norm(c.norm, c.hidden_size, c.norm_eps, **norm)
        self.proj = ReplicatedLinear(2 * c.hidden_size, c.hidden_size, sequence_parallel=sp,
                                     grad_sync=c.sequence_parallel_grad_sync, group=group,
                                     init_std=c.init_std / math.sqrt(2 * c.num_layers), _init=_init)
        self.block = block
        self.final_norm = Norm(c.norm, c.hidden_size, c.norm_eps, **norm)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, **inputs: torch.Tensor | None) -> torch.Tensor:
        x = self.proj(torch.cat([self.embedding_norm(embedded), self.hidden_norm(hidden)], dim=-1))
        return self.block(x, **inputs)


def shifted(tokens: torch.Tensor, targets: torch.Tensor, depth: int,
            document_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [b, s] `depth` ahead, targets `depth` ahead) of the whole window: position i reads t_{i+depth} and
    predicts targets[i+depth]; the last `depth` positions, and those whose token ahead is in another document, read
    token 0 and are ignored, as in each document run alone."""
    ahead = torch.cat([tokens[:, depth:], tokens.new_zeros(tokens.shape[0], depth)], dim=1)
    goal = torch.cat([targets[:, depth:], targets.new_full((targets.shape[0], depth), IGNORE_INDEX)], dim=1)
    if document_ids is not None:  # (as each document alone: nothing past its end)
        same = torch.cat([document_ids[:, depth:] == document_ids[:, :-depth],
                          document_ids.new_zeros(document_ids.shape[0], depth, dtype=torch.bool)], dim=1)
        ahead, goal = torch.where(same, ahead, 0), torch.where(same, goal, IGNORE_INDEX)
    return ahead, goal


def with_mtp_loss(loss: torch.Tensor, mtp: torch.Tensor, factor: float) -> torch.Tensor:
    """`loss`'s value, with factor·mtp's gradient joining backward wherever loss's does."""
    scaled = factor * mtp
    return loss + (scaled - scaled.detach())
