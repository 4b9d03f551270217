"""Multi-head latent attention's terms in the step time (models.mla; bench.plan.layer_time adds them): its GEMMs, its
tensor-parallel collectives on the latents, and its element-wise traffic (RoPE on the rope features, the latents'
norms). The core runs at q·k and v widths of its own (models.flops.attention_widths: bench.plan.attention_time)."""
from .. import roofline as rl


def mla_gemms(config, plan, tokens):
    """Multi-head latent attention's GEMMs on one rank: the down-projections whole on every rank (over its T/tp tokens
    under SP, all T without), the up-projections over the rank's heads, the output projection row-parallel."""
    c, h, tp = config, config.hidden_size, plan.tp
    heads, rows = c.num_heads // tp, tokens // tp if plan.sp else tokens
    gemms = rl.linear_gemms("kv_down", rows, h, c.kv_lora_rank + c.qk_rope_head_dim) + \
        rl.linear_gemms("kv_up", tokens, c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim))
    if c.q_lora_rank is None:
        gemms += rl.linear_gemms("q", tokens, h, heads * c.qk_head_dim)
    else:
        gemms += rl.linear_gemms("q_down", rows, h, c.q_lora_rank) + \
            rl.linear_gemms("q_up", tokens, c.q_lora_rank, heads * c.qk_head_dim)
    return gemms + rl.linear_gemms("proj", tokens, heads * c.v_head_dim, h)


def mla_collectives(config, plan, tokens, e):
    """Multi-head latent attention's tp collectives (models.mla): the latents (q_lora + kv_lora + rope features per
    token) made whole — an all-gather under SP (backward: a reduce-scatter), else an all-reduce of their gradient —
    a query projection straight from x (no q_lora_rank) as a column layer, and the output projection's row layer;
    under SP the replicated down-projections' weight gradients all-reduced over tp."""
    c, h = config, config.hidden_size
    latents = e * tokens * ((c.q_lora_rank or 0) + c.kv_lora_rank + c.qk_rope_head_dim)
    hidden = e * tokens * h
    if not plan.sp:
        out = [rl.Collective(rl.ALL_REDUCE, "bwd", latents), rl.Collective(rl.ALL_REDUCE, "fwd", hidden)]
        return out + ([rl.Collective(rl.ALL_REDUCE, "bwd", hidden)] if c.q_lora_rank is None else [])
    # the down-projections' weight gradients, summed over tp in backward (sequence_parallel_grad_sync's default)
    weights = e * h * ((c.q_lora_rank or 0) + c.kv_lora_rank + c.qk_rope_head_dim)
    out = [rl.Collective(rl.ALL_GATHER, "fwd", latents), rl.Collective(rl.REDUCE_SCATTER, "bwd", latents),
           rl.Collective(rl.REDUCE_SCATTER, "fwd", hidden), rl.Collective(rl.ALL_GATHER, "bwd", hidden),
           rl.Collective(rl.ALL_REDUCE, "bwd", weights)]
    if c.q_lora_rank is None:  # its input gathered forward, re-gathered backward, its gradient reduce-scattered
        out += [rl.Collective(rl.ALL_GATHER, "fwd", hidden), rl.Collective(rl.ALL_GATHER, "bwd", hidden),
                rl.Collective(rl.REDUCE_SCATTER, "bwd", hidden)]
    return out


def mla_elementwise_bytes(config, plan, tokens, e):
    """Forward bytes through HBM of one layer's eager element-wise ops under MLA (bench.plan.layer_time's, which says
    what each pass is): the norms and residual adds, RoPE on the rope features of q and the one shared k (q and k
    concatenated), and the latents' RMSNorms, as the block's."""
    rows, h = tokens // plan.tp if plan.sp else tokens, config.hidden_size
    c, heads = config, config.num_heads // plan.tp
    rope = 10 * e * tokens * (heads + 1) * c.qk_rope_head_dim + 2 * 2 * e * tokens * heads * c.qk_head_dim
    latents = c.kv_lora_rank + (c.q_lora_rank or 0)
    return rows * h * (2 * (4 * e + 20) + 2 * 3 * e) + rope + rows * latents * (4 * e + 20)
