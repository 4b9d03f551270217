"""Multi-head latent attention (MLA: DeepSeek-V2, arXiv:2405.04434 §2.1; DeepSeek-V3, arXiv:2412.19437) from the
tensor-parallel layers, laid out as Megatron-Core's (megatron/core/transformer/multi_latent_attention.py):

    c_q = RMSNorm(x W_qa)              [q_lora_rank]     (q_lora_rank None: q = x W_q, no latent)
    [q_nope; q_rope] = c_q W_qb        per head: qk_nope_head_dim + qk_rope_head_dim
    [c_kv; k_rope] = x W_kva           [kv_lora_rank + qk_rope_head_dim]: k_rope one per token, shared by the heads
    [k_nope; v] = RMSNorm(c_kv) W_kvb  per head: qk_nope_head_dim + v_head_dim
    out = softmax(q kᵀ · scale) v W_o  q = [q_nope; RoPE(q_rope)], k = [k_nope; RoPE(k_rope)]

with scale = 1/√(qk_nope_head_dim + qk_rope_head_dim), times mscale(factor, mscale_all_dim)² under YaRN scaling
(Hugging Face's yarn_apply_mscale). The latent norms use Hugging Face's eps, 1e-6.

Tensor parallelism: the down-projections W_qa, W_kva and the latent norms are whole on every tp rank (Megatron's
"duplicated" linears); the up-projections W_qb, W_kvb are column-parallel over heads, W_o row-parallel. The latents
[c_q; c_kv; k_rope] of every token are made whole once: without SP each rank projects all tokens and
`copy_to_tp_region` sums their gradient in backward (one all-reduce); with SP each rank projects and normalises its
own s/tp tokens and one all-gather of the latents (backward: one reduce-scatter) takes the place of the hidden
state's (q_lora + kv_lora + rope features per token, DeepSeek-V3 2112, instead of h = 7168), the replicated weights'
gradients then summed over tp as the norms' are. Without q_lora_rank the query projection is an ordinary column
layer on x (its own all-reduce / all-gather).

Context parallelism and attention dropout use tp.context_parallel_attention / local_attention with one kv head per
query head; those paths move k and v as one tensor, so v (or q and k) is padded with zeros to the larger head width
and the output cut back (zero features change neither the scores nor the kept outputs).

Generation (models/generation.py) caches what DeepSeek-V2 caches (§2.1.2-2.1.3): per token and layer the normalised
latent c_kv and the rotated rope key, kv_lora_rank + qk_rope_head_dim values (DeepSeek-V3: 576, against
128 heads · (192 + 128) = 40960 of expanded keys and values), whole on every tp rank like the latents they are. The
up-projection W_kvb = [W_uk; W_uv] is absorbed, not applied to the cache: each head's score
q_nope·k_nope = (q_nope W_uk)·c_kv, and its output softmax(·) (c_kv W_uvᵀ) = (softmax(·) c_kv) W_uvᵀ, so a step
attends with queries [q_nope W_uk; RoPE(q_rope)] over the cached [c_kv; RoPE(k_rope)] (one kv head shared by this
rank's heads) and maps each head's [kv_lora_rank] output through its W_uv; the prefill runs the same way.
"""
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

import tp
from tp.context import local_attention
from tp.dropout import CounterDropout
from tp.mesh import SharedGroup, resolve_cp_group, resolve_group

from .config import GPTConfig
from .norm import Norm, normal_init
from .positions import dropout_module, rope_positions, sample_ids_or_drawn
from .rope import rotary, yarn_mscale

if TYPE_CHECKING:
    from .generation import LayerCache

LATENT_NORM_EPS = 1e-6  # Hugging Face's q_a_layernorm and kv_a_layernorm (DeepseekV3RMSNorm's default)


class ReplicatedLinear(nn.Module):
    """y = x Wᵀ with W [out, in] whole on every tp rank. Under sequence parallelism each rank multiplies its own
    tokens: W's gradient is summed over tp inside backward, or (`grad_sync=False`) tagged `sequence_parallel` for
    tp.allreduce_sequence_parallel_grads."""

    group = SharedGroup()

    def __init__(self, in_features: int, out_features: int, *, sequence_parallel: bool = False,
                 grad_sync: bool = True, group: dist.ProcessGroup | None = None, init_std: float = 0.02,
                 _init: bool = True) -> None:
        super().__init__()
        self.group = resolve_group(group)
        self.sync = sequence_parallel and grad_sync
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.weight.sequence_parallel = sequence_parallel and not grad_sync
        if _init:
            with torch.no_grad():
                normal_init(init_std)(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, = tp.sync_grads_over_tp(self.weight, group=self.group) if self.sync else (self.weight,)
        return F.linear(x, weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[1]} -> {self.weight.shape[0]}, replicated"


def softmax_scale(config: GPTConfig) -> float:
    """1/√(qk head dim), times YaRN's mscale(factor, mscale_all_dim)² when the scaling gives mscale_all_dim."""
    scale = config.qk_head_dim ** -0.5
    scaling = config.rope_scaling or {}
    if scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


class MLAttention(nn.Module):
    """Causal multi-head latent attention (the module docstring), the drop-in for models.block.Attention: the same
    forward (documents, positions, dropout keyed by `layer`, recompute of the core), [s(/cp)(/tp), b, h] -> same."""

    group, cp_group = SharedGroup(), SharedGroup()  # deep copies (EMA, reference models) share the groups

    def __init__(self, config: GPTConfig, *, group: dist.ProcessGroup | None = None,
                 cp_group: dist.ProcessGroup | None = None, layer: int = 0, _init: bool = True) -> None:
        super().__init__()
        self.group, self.cp_group = resolve_group(group), resolve_cp_group(cp_group)
        size, c = dist.get_world_size(self.group), config
        c.check_tp(size)
        c.check_cp(1 if self.cp_group is None else dist.get_world_size(self.cp_group), size)
        self.config, self.layer, self.scale = c, layer, softmax_scale(c)
        self.local_heads = self.local_kv_heads = c.num_heads // size
        self.first_head = dist.get_rank(self.group) * self.local_heads
        sp, h, heads = c.sequence_parallel, c.hidden_size, c.num_heads
        down = dict(sequence_parallel=sp, grad_sync=c.sequence_parallel_grad_sync, group=self.group, _init=_init)
        norm = dict(sequence_parallel=sp, grad_sync=c.sequence_parallel_grad_sync, group=self.group)
        column = dict(bias=False, group=self.group, init_method=normal_init(c.init_std), _init=_init)
        if c.q_lora_rank is None:
            self.q = tp.ColumnParallelLinear(h, heads * c.qk_head_dim, sequence_parallel=sp, **column)
        else:
            self.q_down = ReplicatedLinear(h, c.q_lora_rank, init_std=c.init_std, **down)
            self.q_latent_norm = Norm("rmsnorm", c.q_lora_rank, LATENT_NORM_EPS, **norm)
            self.q_up = tp.ColumnParallelLinear(c.q_lora_rank, heads * c.qk_head_dim, disable_grad_reduce=True,
                                                **column)
        self.kv_down = ReplicatedLinear(h, c.kv_lora_rank + c.qk_rope_head_dim, init_std=c.init_std, **down)
        self.kv_latent_norm = Norm("rmsnorm", c.kv_lora_rank, LATENT_NORM_EPS, **norm)
        self.kv_up = tp.ColumnParallelLinear(c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim),
                                             disable_grad_reduce=True, **column)
        self.proj = tp.RowParallelLinear(
            heads * c.v_head_dim, h, bias=False, sequence_parallel=sp, group=self.group,
            sequence_parallel_grad_sync=c.sequence_parallel_grad_sync,
            init_method=normal_init(c.init_std / math.sqrt(2 * c.num_layers)), _init=_init)

    def latents(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[c_q (with q_lora_rank), c_kv normalised, k_rope] of every token of this cp rank: [s(/cp), b, width]
        each, whole on every tp rank (see the module docstring)."""
        c = self.config
        parts = list(self.kv_down(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1))
        parts[0] = self.kv_latent_norm(parts[0])
        if c.q_lora_rank is not None:
            parts.insert(0, self.q_latent_norm(self.q_down(x)))
        widths = [p.shape[-1] for p in parts]
        whole = torch.cat(parts, dim=-1)
        if dist.get_world_size(self.group) > 1:
            whole = tp.gather_from_sp_region(whole, self.group) if c.sequence_parallel else \
                tp.copy_to_tp_region(whole, self.group)
        return list(whole.split(widths, dim=-1))

    def cache_shapes(self, batch_size: int, max_len: int) -> list[tuple[int, ...]]:
        """What generation caches per layer (models/generation.py): [RMSNorm(c_kv); RoPE(k_rope)] of every position,
        kv_lora_rank + qk_rope_head_dim values a token, whole on every tp rank (the module docstring)."""
        c = self.config
        return [(batch_size, 1, max_len, c.kv_lora_rank + c.qk_rope_head_dim)]

    def forward(self, x: torch.Tensor, *, document_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: "LayerCache | None" = None,
                sample_ids: torch.Tensor | None = None) -> torch.Tensor:  # [s(/cp)(/tp), b, h]
        c = self.config
        *q_latent, kv_latent, k_rope = self.latents(x)
        q = self.q_up(q_latent[0]) if q_latent else self.q(x)  # [s(/cp), b, heads/tp · qk]
        q = rearrange(q, "s b (n d) -> b n s d", d=c.qk_head_dim)
        positions = rope_positions(k_rope.shape[0], k_rope.device, tp_group=self.group, cp_group=self.cp_group,
                                   cache=cache, position_ids=position_ids)
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        rotated = rotary(torch.cat([q_rope, rearrange(k_rope, "s b d -> b 1 s d")], dim=1), c, positions)
        q_rope, k_rope = rotated.split([self.local_heads, 1], dim=1)  # (q and k in one pass)
        if cache is not None:  # generation (models/generation.py)
            context = self.attend_cached(q_nope, q_rope, rearrange(kv_latent, "s b r -> b 1 s r"), k_rope, cache)
            return self.proj(rearrange(context, "b n s d -> s b (n d)"))
        kv = rearrange(self.kv_up(kv_latent), "s b (n d) -> b n s d", d=c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.local_heads, -1, -1)], dim=-1)
        if self.training and c.attention_dropout:  # (drawn here, not again in a recomputation)
            sample_ids = sample_ids_or_drawn(sample_ids, q.shape[0], q.device)
        if "core" in c.recompute_parts and torch.is_grad_enabled():  # keep q, k, v; masks redrawn
            context = checkpoint(self.core, q, k, v, document_ids, sample_ids, use_reentrant=False,
                                 preserve_rng_state=False)
        else:
            context = self.core(q, k, v, document_ids, sample_ids)
        return self.proj(rearrange(context, "b n s d -> s b (n d)"))  # [s(/tp), b, h]

    def attend_cached(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_latent: torch.Tensor,
                      k_rope: torch.Tensor, cache: "LayerCache") -> torch.Tensor:  # [b, heads/tp, s, v_head_dim]
        """Generation: the new tokens' latents [b, 1, s, kv_lora_rank] and rotated rope keys [b, 1, s, rope] join
        the cache; the queries [b, heads/tp, s, nope | rope] attend to every cached position through W_kvb absorbed
        (the module docstring): softmax([q_nope W_uk; q_rope] [c_kv; k_rope]ᵀ · scale) c_kv W_uvᵀ per head."""
        c = self.config
        cached, = cache.store(torch.cat([kv_latent, k_rope], dim=-1))  # [b, 1, length, kv_lora_rank + rope]
        up = self.kv_up.weight.view(self.local_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        key_up, value_up = up.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)  # [heads/tp, nope | v, kv_lora_rank]
        q = torch.cat([q_nope @ key_up, q_rope], dim=-1)  # [b, heads/tp, s, kv_lora_rank + rope]
        context = cache.attention(q, cached, cached[..., :c.kv_lora_rank], scale=self.scale)
        return context @ value_up.transpose(1, 2)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None,
             sample_ids: torch.Tensor | None = None) -> torch.Tensor:  # [b, n, s(/cp), d]
        """Softmax(qkᵀ·scale)v as models.block.Attention.core computes it (causal, documents, dropout, context
        parallelism), v's head width its own."""
        c = self.config
        dropout = None
        if self.training and c.attention_dropout:
            dropout = CounterDropout(c.attention_dropout, c.dropout_seed, dropout_module(self.layer, 2),
                                     sample_ids_or_drawn(sample_ids, q.shape[0], q.device), self.first_head)
        context_parallel = self.cp_group is not None and dist.get_world_size(self.cp_group) > 1
        width, value_width = max(q.shape[-1], v.shape[-1]), v.shape[-1]
        if (context_parallel or dropout is not None) and q.shape[-1] != value_width:  # one width for k and v
            q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        if context_parallel:
            out = tp.context_parallel_attention(q, k, v, causal=True, mode=c.cp_mode, group=self.cp_group,
                                                scale=self.scale, document_ids=document_ids, a2a_size=c.cp_a2a_size,
                                                dropout=dropout)
        else:
            out = local_attention(q, k, v, True, self.scale, document_ids, dropout)
        return out[..., :value_width] if out.shape[-1] != value_width else out
