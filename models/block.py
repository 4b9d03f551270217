"""The transformer block from the tensor-parallel layers: pre-norm attention (fused QKV, optional q/k norms, RoPE,
GQA; or multi-head latent attention, models/mla.py, with config.multi_latent_attention) and MLP, or a mixture of
experts (tp.moe.MoE) in the MLP's place. RoPE is models/rope.py's, the norms models/norm.py's, the tokens' positions
and dropout keys models/positions.py's.

Activations are Megatron's [s, b, h]; with sequence parallelism the residual stream (norms, dropout, residual adds)
holds [s/tp, b, h] and the column layers all-gather the sequence. With context parallelism (a cp group) every
activation holds this rank's s/cp tokens in the load-balanced layout (tp.cp_shard); attention runs over the whole
sequence through tp.context_parallel_attention, RoPE and dropout follow each token's global position. Per block and
step, without SP: forward 2 all-reduces, backward 2 (+1 when kv heads are replicated); with SP: forward 2 all-gathers
+ 2 reduce-scatters, backward 4 all-gathers + 2 reduce-scatters + the norms' (and row biases') grad all-reduces.

Dropout is counter-based (tp.dropout): each mask is a pure function of (config.dropout_seed, the site's global index
`dropout_module(layer, site)`, each sample's global index `sample_ids` [b], the element's global coordinates), so
every split, recomputation and backward applies the masks of the serial run; the residual sites fuse dropout with
the residual add (kernels.dropout).
"""
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

import tp
from tp.context import local_attention
from tp.dropout import CounterDropout
from tp.mesh import SharedGroup, resolve_cp_group, resolve_group
from tp.recompute import DiscardedOutput

from .config import GPTConfig
from .mla import MLAttention
from .norm import Norm, normal_init
from .positions import (  # noqa: F401 (models.block's names before models/positions.py held them)
    document_positions,
    dropout_module,
    dropout_positions,
    rope_positions,
    sample_ids_or_drawn,
    token_positions,
    token_rows,
)
from .recompute import recompute_inside_moe
from .rope import rope, rope_frequencies, rotary  # noqa: F401 (as above, models/rope.py)

if TYPE_CHECKING:
    from .generation import LayerCache


class FullQKNorm(nn.Module):
    """OLMoE's q (or k) norm: RMSNorm over the whole projection (every head), whose features are split over tp by
    heads: each rank holds its slice of the weight. The statistics are Hugging Face's (fp32 over the whole row, also
    in fp64 models), so under tp every rank all-gathers the projection's features, normalises the whole row and keeps
    its features (backward: one all-gather of the output gradient, the row's backward on every rank, its slice
    kept): Hugging Face's numbers exactly, forward and backward, for [s, b, (H + KV)·d] moved each way."""

    group = SharedGroup()

    def __init__(self, width: int, eps: float, *, rows: torch.Tensor, group: dist.ProcessGroup | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.width, self.eps, self.group = width, eps, group
        self.rows = rows  # the dense features this rank holds, contiguous (models.hf reads/writes the weight by them)
        self.weight = nn.Parameter(torch.ones(len(rows), dtype=dtype, device=device))
        self.weight.tensor_parallel, self.weight.partition_dim = True, 0

    def shard_indices(self) -> torch.Tensor:
        return self.rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [.., width/tp]
        x = x.float()  # Hugging Face's: fp32 statistics, weight applied in the input dtype
        split = self.group is not None and dist.get_world_size(self.group) > 1
        if split:  # every rank: the whole row [.., width] (backward: the complete gradient, split)
            x = tp.gather_from_sp_region(x.movedim(-1, 0), self.group, tensor_parallel_output_grad=False)
            x = x.movedim(0, -1).contiguous()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if split:  # this rank's features (backward: every rank's gradient gathered, so each has the whole row's)
            normed = tp.scatter_to_tp_region(normed, self.group)
        return self.weight * normed.to(self.weight.dtype)

    def extra_repr(self) -> str:
        return f"rmsnorm over {self.width} (here {len(self.rows)}), eps={self.eps}"


class Attention(nn.Module):
    """Causal self-attention: one fused QKV ColumnParallelLinear (each rank its own q, k and v heads; kv heads
    replicated when fewer than tp), RoPE, scaled_dot_product_attention, RowParallelLinear out. `document_ids` and
    `position_ids` ([b, s] of the whole window) keep attention inside each document and place RoPE. `layer`: the
    global layer index (keys the attention dropout masks)."""

    group, cp_group = SharedGroup(), SharedGroup()  # deep copies (EMA, reference models) share the groups

    def __init__(self, config: GPTConfig, *, group: dist.ProcessGroup | None = None,
                 cp_group: dist.ProcessGroup | None = None, layer: int = 0, _init: bool = True) -> None:
        super().__init__()
        self.group, self.cp_group = resolve_group(group), resolve_cp_group(cp_group)
        size = dist.get_world_size(self.group)
        config.check_tp(size)
        config.check_cp(1 if self.cp_group is None else dist.get_world_size(self.cp_group), size)
        heads, kv_heads, d = config.num_heads, config.num_kv_heads, config.head_dim
        kv_replicas = size // kv_heads if kv_heads < size else 1
        self.local_heads, self.local_kv_heads = heads // size, kv_heads * kv_replicas // size
        self.head_dim, self.config, self.layer = d, config, layer
        self.first_head = dist.get_rank(self.group) * self.local_heads  # (the global index of this rank's first)
        sp = config.sequence_parallel
        self.qkv = tp.ColumnParallelLinear(
            config.hidden_size, (heads + 2 * kv_heads) * d, bias=config.bias or config.qkv_bias,
            parts=(heads * d, kv_heads * d, kv_heads * d), part_replicas=(1, kv_replicas, kv_replicas),
            sequence_parallel=sp, group=self.group, init_method=normal_init(config.init_std),
            fp8_recipe=config.fp8_recipe, _init=_init)
        self.proj = tp.RowParallelLinear(
            heads * d, config.hidden_size, bias=config.bias, sequence_parallel=sp, group=self.group,
            sequence_parallel_grad_sync=config.sequence_parallel_grad_sync, fp8_recipe=config.fp8_recipe,
            init_method=normal_init(config.init_std / math.sqrt(2 * config.num_layers)), _init=_init)
        self.q_norm, self.k_norm = _qk_norms(config, self.group, kv_replicas) if config.qk_norm else (None, None)

    def cache_shapes(self, batch_size: int, max_len: int) -> list[tuple[int, ...]]:
        """What generation caches per layer (models/generation.py): this rank's keys and values."""
        return [(batch_size, self.local_kv_heads, max_len, self.head_dim)] * 2

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None,
             sample_ids: torch.Tensor | None = None) -> torch.Tensor:  # [b, n, s(/cp), d]
        """Softmax(qkᵀ/√d)v, causal (inside each document with `document_ids` [b, s]); in training, attention dropout's
        masks keyed by `sample_ids` [b] and each head's, query's and key's global index. Under context parallelism the
        queries of this rank's tokens attend to the whole sequence (tp.context_parallel_attention)."""
        c = self.config
        dropout = None
        if self.training and c.attention_dropout:
            dropout = CounterDropout(c.attention_dropout, c.dropout_seed, dropout_module(self.layer, 2),
                                     sample_ids_or_drawn(sample_ids, q.shape[0], q.device), self.first_head)
        if self.cp_group is not None and dist.get_world_size(self.cp_group) > 1:
            return tp.context_parallel_attention(q, k, v, causal=True, mode=c.cp_mode, group=self.cp_group,
                                                 document_ids=document_ids, a2a_size=c.cp_a2a_size, dropout=dropout)
        return local_attention(q, k, v, True, None, document_ids, dropout)  # GQA: query head i reads kv head i // g

    def forward(self, x: torch.Tensor, *, document_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: "LayerCache | None" = None,
                sample_ids: torch.Tensor | None = None) -> torch.Tensor:  # [s(/cp)(/tp), b, h]
        qkv = self.qkv(x)  # [s(/cp), b, (heads + 2 kv_heads)·d / tp]
        if self.q_norm is not None:
            qkv = self._normed_qk(qkv)
        q_and_k = (self.local_heads + self.local_kv_heads) * self.head_dim
        qk, v = (rearrange(t, "s b (n d) -> b n s d", d=self.head_dim) for t in qkv.split(
            [q_and_k, qkv.shape[-1] - q_and_k], dim=-1))
        if self.config.position == "rope":  # (this rank's tokens: the SP gather above gave it all of them)
            positions = rope_positions(qkv.shape[0], qkv.device, tp_group=self.group, cp_group=self.cp_group,
                                       cache=cache, position_ids=position_ids)
            qk = rotary(qk, self.config, positions)  # q and k in one pass
        q, k = qk.split([self.local_heads, self.local_kv_heads], dim=1)
        if cache is not None:  # generation (models/generation.py): attend to this rank's heads' cached keys too
            return self.proj(rearrange(cache.attend(q, k, v), "b n s d -> s b (n d)"))
        if self.training and self.config.attention_dropout:  # (drawn here, not again in a recomputation)
            sample_ids = sample_ids_or_drawn(sample_ids, q.shape[0], q.device)
        if "core" in self.config.recompute_parts and torch.is_grad_enabled():  # keep q, k, v; masks redrawn
            context = checkpoint(self.core, q, k, v, document_ids, sample_ids, use_reentrant=False,
                                 preserve_rng_state=False)
        else:
            context = self.core(q, k, v, document_ids, sample_ids)
        return self.proj(rearrange(context, "b n s d -> s b (n d)"))  # [s(/tp), b, h]

    def _normed_qk(self, qkv):
        """q and k of the fused [.., (q | k | v) / tp] output through their norms (per head, or over every head)."""
        d, widths = self.head_dim, [self.local_heads * self.head_dim, self.local_kv_heads * self.head_dim]
        q, k, v = qkv.split([*widths, qkv.shape[-1] - sum(widths)], dim=-1)
        if self.config.qk_norm == "head":
            q, k = (norm(t.unflatten(-1, (-1, d))).flatten(-2) for norm, t in ((self.q_norm, q), (self.k_norm, k)))
        else:
            q, k = self.q_norm(q), self.k_norm(k)
        return torch.cat([q, k, v], dim=-1)


def _qk_norms(config, group, kv_replicas):
    """(q norm, k norm) of an Attention: per-head RMSNorms over head_dim (weights shared by the heads: grads summed
    over tp) or RMSNorms over the whole projections, each rank holding its heads' features."""
    d, eps = config.head_dim, config.norm_eps
    if config.qk_norm == "head":
        norm = dict(sequence_parallel=dist.get_world_size(group) > 1, grad_sync=config.sequence_parallel_grad_sync,
                    group=group)
        return Norm("rmsnorm", d, eps, **norm), Norm("rmsnorm", d, eps, **norm)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if kv_replicas > 1:
        raise ValueError(f"qk_norm='full' with num_kv_heads={config.num_kv_heads} < tp={size}: the k norm's gathered "
                         "features would hold the replicated kv heads twice")
    q, k = config.num_heads * d, config.num_kv_heads * d
    return (FullQKNorm(q, eps, rows=torch.arange(q).chunk(size)[rank], group=group),
            FullQKNorm(k, eps, rows=torch.arange(k).chunk(size)[rank], group=group))


class MLP(nn.Module):
    """ColumnParallelLinear with the activation fused in its epilogue (SwiGLU: fused gate/up) -> RowParallelLinear."""

    def __init__(self, config: GPTConfig, *, group: dist.ProcessGroup | None = None, _init: bool = True) -> None:
        super().__init__()
        swiglu, ffn, sp = config.activation == "swiglu", config.ffn_hidden_size, config.sequence_parallel
        self.fc1 = tp.ColumnParallelLinear(
            config.hidden_size, 2 * ffn if swiglu else ffn, bias=config.bias, activation=config.activation,
            sequence_parallel=sp, group=group, init_method=normal_init(config.init_std),
            fp8_recipe=config.fp8_recipe, _init=_init)
        self.fc2 = tp.RowParallelLinear(
            ffn, config.hidden_size, bias=config.bias, sequence_parallel=sp, group=group,
            sequence_parallel_grad_sync=config.sequence_parallel_grad_sync, fp8_recipe=config.fp8_recipe,
            init_method=normal_init(config.init_std / math.sqrt(2 * config.num_layers)), _init=_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s(/tp), b, h]
        return self.fc2(self.fc1(x))  # fc1: [s, b, ffn/tp]


def moe_mlp(config: GPTConfig, *, group: dist.ProcessGroup | None = None, _init: bool = True) -> tp.moe.MoE:
    """The MLP of an MoE layer: tp.moe.MoE on the mesh's expert groups (ep, etp), initialised like MLP (the experts'
    and shared expert's output projections with std / √(2·layers))."""
    c = config
    return tp.moe.MoE(c.hidden_size, c.moe_ffn_hidden_size, c.num_experts, c.moe_router_topk, activation=c.activation,
                      score=c.moe_router_score, norm_topk_prob=c.moe_router_norm_topk,
                      shared_expert_size=c.moe_shared_expert_size, shared_expert_gate=c.moe_shared_expert_gate,
                      aux_loss_coeff=c.moe_aux_loss_coeff, z_loss_coeff=c.moe_z_loss_coeff,
                      capacity_factor=c.moe_capacity_factor, dispatcher=c.moe_dispatcher,
                      num_groups=c.moe_router_num_groups, group_topk=c.moe_router_group_topk,
                      scaling_factor=c.moe_router_topk_scaling_factor, seq_aux_loss_coeff=c.moe_seq_aux_loss_coeff,
                      sequence_parallel=c.sequence_parallel, grad_sync=c.sequence_parallel_grad_sync, group=group,
                      init_std=c.init_std, output_std=c.init_std / math.sqrt(2 * c.num_layers),
                      fp8_recipe=c.fp8_recipe, _init=_init)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + dropout(attention(norm(x))), then x + dropout(mlp(norm(x))). [s(/tp), b, h] -> same;
    `document_ids` and `position_ids` ([b, s] of the whole window) go to the attention, `sample_ids` [b] (each
    sample's global index in the run) key the dropout masks. `layer`: the global layer index."""

    group, cp_group = SharedGroup(), SharedGroup()  # deep copies (EMA, reference models) share the groups

    def __init__(self, config: GPTConfig, *, group: dist.ProcessGroup | None = None,
                 cp_group: dist.ProcessGroup | None = None, layer: int = 0, moe: bool = False,
                 _init: bool = True) -> None:
        super().__init__()
        self.config, self.layer = config, layer
        self.group, self.cp_group = resolve_group(group), resolve_cp_group(cp_group)
        norm = dict(sequence_parallel=config.sequence_parallel, grad_sync=config.sequence_parallel_grad_sync,
                    group=self.group)
        self.norm1 = Norm(config.norm, config.hidden_size, config.norm_eps, **norm)
        attention = MLAttention if config.multi_latent_attention else Attention
        self.attention = attention(config, group=self.group, cp_group=self.cp_group, layer=layer, _init=_init)
        self.norm2 = Norm(config.norm, config.hidden_size, config.norm_eps, **norm)
        self.mlp = moe_mlp(config, group=self.group, _init=_init) if moe else MLP(config, group=self.group, _init=_init)
        if moe:
            recompute_inside_moe(self.mlp, config.recompute_parts)
        # full recomputation of this block alone (models.GPT groups a chunk's blocks by config.recompute_method)
        self.recompute_whole = "block" in config.recompute_parts

    def _forward(self, x, document_ids=None, position_ids=None, cache=None, sample_ids=None):
        c = self.config
        parts = c.recompute_parts if cache is None and torch.is_grad_enabled() else frozenset()
        normed, discard = self._normed(self.norm1, x, parts)
        attention = self.attention(normed, document_ids=document_ids, position_ids=position_ids, cache=cache,
                                   sample_ids=sample_ids)
        discard(attention)
        dropout = c.dropout and self.training and cache is None
        if dropout:
            positions = dropout_positions(x.shape[0], sequence_parallel=c.sequence_parallel, tp_group=self.group,
                                          cp_group=self.cp_group, device=x.device)
            x = self._dropout(0, sample_ids).add(attention, x, positions=positions)  # x + dropout(attention), fused
            normed, discard = self._normed(self.norm2, x, parts)
        elif "norm" in parts:
            x = x + attention
            normed, discard = self._normed(self.norm2, x, parts)
        else:  # the residual add fused into the norm (one kernel where the fused kernels run)
            (normed, x), discard = self.norm2.add_forward(attention, x), lambda after: None
        mlp = checkpoint(self.mlp, normed, use_reentrant=False) if self._mlp_part in parts else self.mlp(normed)
        discard(mlp)
        return self._dropout(1, sample_ids).add(mlp, x, positions=positions) if dropout else x + mlp

    @property
    def _mlp_part(self):
        """The recomputation part of this block's MLP (models/recompute.py)."""
        return "moe" if isinstance(self.mlp, tp.moe.MoE) else "mlp"

    @staticmethod
    def _normed(norm, x, parts):
        """(norm(x), what frees its output once its consumer ran forward: call it with their output). Under "norm"
        the output is refilled from the kept x when that output's gradient arrives (tp.recompute)."""
        if "norm" not in parts:
            return norm(x), lambda after: None
        kept = DiscardedOutput(norm, x, params=norm.parameters())
        return kept.output, kept.discard

    def _dropout(self, site, sample_ids):
        c = self.config
        return CounterDropout(c.dropout, c.dropout_seed, dropout_module(self.layer, site), sample_ids)

    def forward(self, x: torch.Tensor, *, document_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: "LayerCache | None" = None,
                sample_ids: torch.Tensor | None = None) -> torch.Tensor:  # [s(/tp), b, h]
        if cache is not None:  # generation: no graph to recompute, no dropout
            return self._forward(x, cache=cache)
        c = self.config
        if self.training and (c.dropout or c.attention_dropout):  # (drawn here, not again in a recomputation)
            sample_ids = sample_ids_or_drawn(sample_ids, x.shape[1], x.device)
        if self.recompute_whole and torch.is_grad_enabled():  # keep the block's input; masks redrawn
            return checkpoint(self._forward, x, document_ids, position_ids, None, sample_ids, use_reentrant=False,
                              preserve_rng_state=False)
        return self._forward(x, document_ids, position_ids, None, sample_ids)
