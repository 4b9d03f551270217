"""The router: top-k experts per token, scores in fp32.

logits = x·Wᵀ with W [E, h] replicated on every rank, scored by one of SCORES. "softmax" (Mixtral, Qwen, OLMoE):
probabilities over all E experts in fp32, the k largest chosen, renormalised over the k when `norm_topk_prob`
(Mixtral and Qwen3-MoE do, Qwen2-MoE and OLMoE do not by default). "sigmoid" (DeepSeek-V3): per-expert sigmoid
scores, a per-expert bias added for the choice only (auxiliary-loss-free balancing, `update_expert_bias`), the chosen
unbiased scores normalised. Either can be group-limited (DeepSeek-V2/V3: `num_groups`, `group_topk`,
Score.choose_in_groups) and the weights scaled (`scaling_factor`, DeepSeek's routed_scaling_factor).

Every rank routes its own tokens (under tensor parallelism the MoE layer gives each tp rank a different share), so
no token is routed twice. The weight stays equal on every rank because it starts from the same seed and its gradient
is summed over the tp group inside backward (each rank's covers its tokens only) before any optimizer sees it; debug
mode (tp.set_debug) checks it on every forward.
"""
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import debug
from ..grads import sync_grads_over_tp
from ..mesh import SharedGroup


class Score:
    """How a router scores the experts (Megatron-Core's --moe-router-score-function): the scores of every expert
    from the logits, the top-k choice from them, and the probabilities the load-balancing loss reads. A subclass
    and its line in SCORES add one."""

    selection_bias = False  # a per-expert bias added for the choice only, updated from the loads (update_expert_bias)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Every expert's score [T, E] from the fp32 logits [T, E]."""
        raise NotImplementedError

    def choose(self, scores: torch.Tensor, topk: int,
               bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], indices [T, k]) of the chosen experts: the k largest scores."""
        return scores.topk(topk, dim=-1)

    def probabilities(self, scores: torch.Tensor) -> torch.Tensor:
        """Every expert's probability [T, E] for the aux loss: the scores themselves."""
        return scores

    group_best = 1  # group-limited routing: a group's score is the sum of its `group_best` best choice scores

    def choice_scores(self, scores: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """What group-limited routing ranks the experts by [T, E] (no gradient): the scores."""
        return scores.detach()

    def choose_in_groups(self, scores: torch.Tensor, topk: int, bias: torch.Tensor | None, groups: int,
                         group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], indices [T, k]) of group-limited routing (DeepSeek-V2/V3): the E experts in `groups`
        consecutive groups, each group scored by the sum of its `group_best` best choice scores, the k best experts
        of the `group_topk` best groups chosen; the weights their scores."""
        choice = self.choice_scores(scores, bias)
        grouped = choice.unflatten(-1, (groups, -1))  # [T, G, E/G]
        best = grouped.topk(self.group_best, dim=-1).values.sum(-1).topk(group_topk, dim=-1).indices  # [T, topk_group]
        kept = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(-1, best, True)  # [T, G]
        choice = grouped.masked_fill(~kept.unsqueeze(-1), -math.inf).flatten(-2)
        indices = choice.topk(topk, dim=-1).indices
        return scores.gather(-1, indices), indices


class SoftmaxScore(Score):
    """Probabilities over all E experts (Mixtral, Qwen, OLMoE)."""

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, dim=-1)


class SigmoidScore(Score):
    """Per-expert sigmoids, chosen with a selection bias and normalised over E for the aux loss (DeepSeek-V3)."""

    selection_bias = True
    group_best = 2  # (DeepSeek-V3's group score: its best two experts')

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(logits)

    def choice_scores(self, scores: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return scores.detach() + bias

    def choose(self, scores: torch.Tensor, topk: int,
               bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        indices = (scores.detach() + bias).topk(topk, dim=-1).indices
        return scores.gather(-1, indices), indices

    def probabilities(self, scores: torch.Tensor) -> torch.Tensor:
        return scores / scores.sum(-1, keepdim=True)


# name -> score function: the one list (GPTConfig's moe_router_score, the job's --moe-router-score)
SCORES = {"softmax": SoftmaxScore(), "sigmoid": SigmoidScore()}


def check_groups(num_experts: int, topk: int, groups: int, group_topk: int | None) -> None:
    """Raise a ValueError naming the value unless group-limited routing can choose `topk` of `num_experts` experts
    in `group_topk` of `groups` equal groups (groups = 1: not group-limited, group_topk unused)."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or num_experts % groups:
        raise ValueError(f"moe_router_num_groups={groups!r} must be an integer >= 1 dividing num_experts="
                         f"{num_experts}")
    if groups == 1:
        return
    per_group = num_experts // groups
    if isinstance(group_topk, bool) or not isinstance(group_topk, int) or not 1 <= group_topk <= groups \
            or group_topk * per_group < topk:
        raise ValueError(f"moe_router_group_topk={group_topk!r} must be an integer in [1, moe_router_num_groups="
                         f"{groups}] whose groups hold at least moe_router_topk={topk} experts ({per_group} each)")


class Routing(NamedTuple):
    """A router's decision for T tokens."""

    weights: torch.Tensor  # [T, k] fp32: the combine weights of the chosen experts
    indices: torch.Tensor  # [T, k] int64: the chosen experts
    probs: torch.Tensor  # [T, E]: every expert's probability (sigmoid: scores normalised over E), for the aux loss
    logits: torch.Tensor  # [T, E], for the z-loss (both fp32, fp64 for fp64 inputs)


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of `indices` (any shape, each in [0, num_experts)) name each expert: [num_experts] int64.
    (torch.bincount's output size depends on the values: torch.compile cannot trace it without a break.)"""
    flat = indices.flatten()
    return flat.new_zeros(num_experts, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat,
                                                                                                dtype=torch.int64))


def _recomputing():
    """Whether this forward runs inside a backward pass (activation recomputation): count the loads once. (Not
    asked under torch.compile, which cannot trace it: a compiled layer counts every forward.)"""
    return not torch.compiler.is_compiling() and getattr(torch._C, "_current_graph_task_id", lambda: -1)() != -1


class TopKRouter(nn.Module):
    """Top-k routing over `num_experts` (see the module docstring). `group`: the tp group whose ranks route different
    tokens with this weight (its grads are summed over it in backward, or, `grad_sync=False`, tagged
    `sequence_parallel` for tp.allreduce_sequence_parallel_grads); `check_group`: where debug mode checks the weight
    is equal (the ranks of one pipeline stage)."""

    group, check_group, token_group = SharedGroup(), SharedGroup(), SharedGroup()  # (token_group: set by MoE)
    # kept by mixed precision (tp.optim.DataParallel): a bf16 bias could not move by 1e-3 once |bias| >= 0.5 (half
    # its ulp), bf16 loads would miscount past 256
    fixed_dtype_buffers = ("expert_bias", "expert_load")

    def __init__(self, hidden_size: int, num_experts: int, topk: int, *, score: str = "softmax",
                 norm_topk_prob: bool = True, group: dist.ProcessGroup | None = None, grad_sync: bool = True,
                 check_group: dist.ProcessGroup | None = None, init_std: float = 0.02,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 num_groups: int = 1, group_topk: int | None = None, scaling_factor: float = 1.0,
                 _init: bool = True) -> None:
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"moe_router_score={score!r} must be one of {tuple(SCORES)}")
        if not 1 <= topk <= num_experts:
            raise ValueError(f"moe_router_topk={topk} must be between 1 and num_experts={num_experts}")
        self.num_experts, self.topk, self.score, self.norm_topk_prob = num_experts, topk, score, norm_topk_prob
        check_groups(num_experts, topk, num_groups, group_topk)  # (DeepSeek's group-limited routing)
        self.num_groups, self.group_topk, self.scaling_factor = num_groups, group_topk, scaling_factor
        self.group, self.check_group, self.token_group = group, check_group, None
        self.sync = grad_sync and group is not None and dist.get_world_size(group) > 1
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype, device=device))
        self.weight.sequence_parallel = group is not None and dist.get_world_size(group) > 1 and not grad_sync
        # the selection bias (not a gradient-trained parameter) and the loads it is updated from
        biased = SCORES[score].selection_bias
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device) if biased else None)
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.float64, device=device)
                             if biased else None, persistent=False)
        if _init:
            with torch.no_grad():
                nn.init.normal_(self.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> Routing:  # [T, h]
        if debug.is_debug() and self.check_group is not None:
            debug.check_router(self.weight, self.expert_bias, self.check_group)
        weight = sync_grads_over_tp(self.weight, group=self.group)[0] if self.sync else self.weight
        raw = F.linear(x, weight)  # [T, E] in x's dtype
        logits = raw.float()  # the choice and the weights in fp32 (Hugging Face's routers' rounding)
        score = SCORES[self.score]
        scores = score.scores(logits)
        if self.num_groups > 1:
            weights, indices = score.choose_in_groups(scores, self.topk, self.expert_bias, self.num_groups,
                                                      self.group_topk)
        else:
            weights, indices = score.choose(scores, self.topk, self.expert_bias)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.scaling_factor != 1.0:  # (DeepSeek's routed_scaling_factor)
            weights = weights * self.scaling_factor
        if self.expert_load is not None and self.training and not _recomputing():
            self.expert_load += expert_counts(indices, self.num_experts)
        # The aux losses see the logits at the input's precision, fp32 at least: an fp64 model's are then exact
        # whatever the split (fp32 reductions over a row are not batch-invariant on every backend).
        hi = raw if raw.dtype == torch.float64 else logits
        aux_probs = score.probabilities(scores if hi is logits else score.scores(hi))
        return Routing(weights, indices, aux_probs, hi)

    def extra_repr(self) -> str:
        groups = f", top-{self.group_topk} of {self.num_groups} groups" if self.num_groups > 1 else ""
        scaled = f", scaling_factor={self.scaling_factor}" if self.scaling_factor != 1.0 else ""
        return (f"{self.weight.shape[1]} -> {self.num_experts} experts, top-{self.topk}{groups}, {self.score}, "
                f"norm_topk_prob={self.norm_topk_prob}{scaled}")
