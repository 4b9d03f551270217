"""Activation memory per rank: what one transformer block saves for backward per micro-batch (dense and MoE), what
a deferred W holds under ZB-H1, the tensors outside the blocks, and how many micro-batches each schedule keeps in
flight on a pipeline stage (bench.plan.memory adds the parameters, gradients and optimizer states).

Backends "triton" and "torch" count this package's layers (byte-exact against the training job: tests), per layer
and micro-batch (T = b·s/cp tokens on this rank, T' = T/tp under SP, e = 2 bf16 / 4 fp32 bytes, h hidden, a heads,
k kv heads (local k' = max(k/tp, 1)), d head dim, f ffn). Korthikanti et al. 2022's count
(arXiv:2205.05198, activation memory per layer) redone for this code: SDPA keeps no s×s scores, SwiGLU, GQA,
RMSNorm's fp32 statistics:
  norm (×2)  RMSNorm: input in fp32 (4·T'h: it upcasts), rstd 4·T', normed and weighted output e·2·T'h;
             LayerNorm: input and output e·2·T'h, mean and rstd 8·T'
  attention  fused qkv e·T(a/tp + 2k')d, roped q,k e·T(a/tp + k')d (RoPE only: else views of qkv), output
             e·T·a/tp·d, log-sum-exp 4·T·a/tp
             (selective recompute drops the lse only: with SDPA there are no scores to drop)
  mlp        pre-activation e·T·(2)f/tp, output e·T·f/tp; at tp = 1 on the torch backend without main_grad,
             autograd's own SwiGLU keeps an fp32 pre-activation and silu(gate) instead (4·3T·f + e·T·f)
  dropout    p > 0: a 1-byte mask per residual dropout (2·T'h)
  cp > 1     the same tensors on s/cp tokens (ring and all-gather attention keep q, k, v, output and lse of this
             rank's share), plus cos/sin gathered at its positions per layer (2·e·s/cp·d)
  MLA        in place of the attention line: mla_activation_bytes (models.mla's tensors, per tensor as above)
  full recompute: the block input only, e·T'h (plus one block recomputed at a time: `transient`)
  recompute modules (selective, `recompute_modules`: models/recompute.py): core_attn drops the lse; mlp a dense
             MLP's activations, moe an MoE layer's MLP's, shared_experts the shared expert's (each keeps its input, the
             norm's output); moe_act the experts' activation output (e·slots·f/etp); layernorm keeps each norm's input
             (e·T'h) in place of the norm's tensors and its output (which the next linear no longer keeps)
Per micro-batch and stage: token ids (8 B) and the embedding's mask; on the last stage the final norm, the loss's
fp32 softmax over this rank's real vocabulary columns, targets and masks; on other stages the output kept for the
backward send (e·T'h, not a saved tensor but held by the runner); with MTP on the last stage each depth's block and
mtp_activation_bytes. RoPE's cos/sin tables once per stage.
In flight (micro-batches whose activations are alive at once, stage i of p): 1F1B and ZB-H1 min(p − i, m), GPipe m,
interleaved (p − i − 1)·2 + (v − 1)·p + 1 chunks of 1/v stage each (Megatron's warm-up; rank 0: p + (p − 1)/v);
each equal to tp.pipeline.schedules' simulated peak (tests). ZB-H1 also keeps, from a micro-batch's B to its W, every
linear's input and output gradient (layer_wgrad_bytes; the last stage's output layer its vocabulary gradient too),
and its ranks hold W's back: the peak over the schedule's actions of awaiting-B micro-batches × their activations +
awaiting-W ones × that (the last of p ranks: up to p W's, against 1F1B's one micro-batch there).

Backend "te" counts a Megatron-Core layer on Transformer Engine, as NVIDIA's NeMo / Megatron-LM recipes run it,
from Korthikanti et al. 2022 (arXiv:2205.05198) §4.1 and Table 2 redone without the s×s terms: per layer with tp +
SP, sbh·34/t bytes for a GPT-3 layer (LayerNorm, 4h GELU MLP, dropout) once the 5as/h attention term is gone (flash /
cuDNN attention keeps no scores) — LayerNorm inputs 4, QKV input (the first norm's output) 2, Q and K 4, V 2, the
projection's input 2, its dropout mask 1; fc1's input (the second norm's output) 2, GELU's input 8, fc2's input 8,
dropout mask 1 — which Megatron-LM's megatron/training/theoretical_memory_usage.py writes sbh·(18 + 4·ffn/h)/t.
Counted per tensor, so GQA, SwiGLU and no dropout follow: each fused norm (TE's LayerNormLinear / LayerNormMLP)
keeps its input and its output (the GEMM's input, the local T' rows under SP, re-gathered in backward) plus fp32
statistics (mean and rstd, RMSNorm rstd); fused RoPE keeps no rotated copy (its backward needs only the angles,
computed once per forward); the attention kernel keeps q, k, v, its output (also the projection's input) and the
fp32 log-sum-exp per head and token (dropped by selective recompute); the MLP its pre-activation and activation
output. What this package saves beyond that: an fp32 copy of each RMSNorm input, RoPE's rotated q and k, and under
cp per-layer cos/sin. The MoE layer, MLA and the loss are counted as this package's (not re-derived for Megatron's).
"""
import functools

from tp.pipeline.schedules import SCHEDULES, build

from .recompute import block_parts

PRECISIONS = {"fp32": 4, "bf16": 2}  # activation / parameter bytes
MAIN_GRAD = {"bf16": True, "fp32": False}  # the training job keeps an fp32 main_grad under bf16 (as ZeRO's table)


def local_kv_heads(config, tp):
    """kv heads on one tp rank: k/tp, or 1 when fewer than tp (each held by tp/k ranks)."""
    return config.num_kv_heads * (tp // config.num_kv_heads if config.num_kv_heads < tp else 1) // tp


def norm_activation_bytes(config, rows, precision, backend="triton"):
    """What one norm over `rows` tokens saves with the next linear's input (its output): this package's RMSNorm
    an fp32 copy of its input (it upcasts), rstd, the normed and the weighted output; F.layer_norm and TE's fused
    norms (LayerNormLinear / LayerNormMLP) the input and the output, with fp32 mean and rstd (RMSNorm: rstd)."""
    e, h = PRECISIONS[precision], config.hidden_size
    if config.norm == "rmsnorm" and backend != "te":
        return (4 + 2 * e) * rows * h + 4 * rows
    return 2 * e * rows * h + (8 if config.norm == "layernorm" else 4) * rows


def layer_activation_bytes(config, *, tp, cp=1, micro_batch_size, seq_len, sequence_parallel, recompute,
                           precision, backend="triton", layer=0, etp=None, recompute_modules=None):
    """Bytes TransformerBlock `layer` saves for backward per micro-batch on one rank (the module docstring), or with
    `backend` "te" what a Megatron-Core layer on Transformer Engine saves in its place. `recompute_modules`: what
    "selective" recomputes (models.recompute.MODULES names; None: core_attn)."""
    e = PRECISIONS[precision]
    h, f = config.hidden_size, config.ffn_hidden_size
    tokens = micro_batch_size * seq_len // cp
    rows = tokens // tp if sequence_parallel else tokens  # the residual stream's tokens
    parts = block_parts(recompute, recompute_modules)
    if "block" in parts:
        return e * rows * h
    heads, te = config.num_heads // tp, backend == "te"
    norm = e * rows * h if "norm" in parts else norm_activation_bytes(config, rows, precision, backend)
    attention = attention_activation_bytes(config, tp=tp, cp=cp, tokens=tokens, rows=rows, precision=precision,
                                           backend=backend)
    attention += 0 if "core" in parts else 4 * tokens * heads
    if cp > 1 and config.position == "rope" and not te:  # cos/sin gathered at this rank's positions, per layer
        attention += 2 * e * tokens // micro_batch_size * rope_width(config)
    native = backend == "torch" and tp == 1 and not MAIN_GRAD[precision]
    if config.is_moe_layer(layer):
        mlp = 0 if "moe" in parts else moe_activation_bytes(config, tp=tp, tokens=tokens, rows=rows,
                                                            precision=precision, etp=etp, parts=parts)
    elif "mlp" in parts:
        mlp = 0
    elif config.activation == "swiglu" and native:  # autograd's SwiGLU at accumulator precision
        mlp = 4 * tokens * 3 * f + e * tokens * f
    else:
        mlp = e * tokens * ((2 if config.activation == "swiglu" else 1) * f // tp + f // tp)
    masks = 2 * rows * h if config.dropout else 0
    return 2 * norm + attention + mlp + masks


def attention_activation_bytes(config, *, tp, cp=1, tokens, rows, precision, backend="triton"):
    """What the attention saves per micro-batch on one rank beside the log-sum-exp and the norms (the module
    docstring): GQA's fused qkv, RoPE's q and k, the output; or multi-head latent attention's
    (mla_activation_bytes)."""
    if config.multi_latent_attention:
        return mla_activation_bytes(config, tp=tp, cp=cp, tokens=tokens, rows=rows, precision=precision)
    heads, kv = config.num_heads // tp, local_kv_heads(config, tp)
    roped = heads + kv if config.position == "rope" and backend != "te" else 0  # RoPE writes q and k anew; TE's not
    return PRECISIONS[precision] * tokens * config.head_dim * ((heads + 2 * kv) + roped + heads)


def rope_width(config):
    """Features RoPE rotates per head (its cos/sin tables' width): MLA's qk_rope_head_dim, else the head dim."""
    return config.qk_rope_head_dim if config.multi_latent_attention else config.head_dim


def mla_activation_bytes(config, *, tp, cp=1, tokens, rows, precision):
    """Multi-head latent attention's saved tensors per micro-batch on one rank (models.mla; the log-sum-exp and the
    block's norms apart), a' = a/tp heads: each latent RMSNorm (q_lora_rank, kv_lora_rank) its fp32 input, rstd and
    normed output on the T' rows it projects (in fp32 the kv norm's input is a view of the whole down-projection,
    the RoPE key with it); the latents made whole, e·T·(q_lora + kv_lora + rope), which both up-projections keep; the
    attention kernel's q and k (T·a'·(nope + rope)) and v, a view of the kv up-projection's output (T·a'·(nope + v));
    its output and the output projection's input, a contiguous copy of it (2·T·a'·v). Under cp the k/v paths move
    one width, so q, k, v and the output are padded to max(nope + rope, v)."""
    c, e = config, PRECISIONS[precision]
    heads, qk, v = c.num_heads // tp, c.qk_head_dim, c.v_head_dim
    latents = [c.kv_lora_rank] + ([c.q_lora_rank] if c.q_lora_rank is not None else [])
    norms = sum((4 + e) * rows * r + 4 * rows for r in latents) + (4 * rows * c.qk_rope_head_dim if e == 4 else 0)
    whole = e * tokens * (sum(latents) + c.qk_rope_head_dim)
    if cp > 1 and qk != v:  # the padded copies (models.mla.MLAttention.core)
        width = max(qk, v)
        return norms + whole + e * tokens * heads * (4 * width + v)
    return norms + whole + e * tokens * heads * (2 * qk + c.qk_nope_head_dim + v + 2 * v)


def moe_activation_bytes(config, *, tp, tokens, rows, precision, etp=None, parts=frozenset()):
    """An MoE layer's MLP activations per micro-batch on one rank (in place of the dense MLP's), as the alltoall
    dispatcher's layer saves them. Each tp rank routes its r = tokens/tp share (under SP its sequence shard, else a
    copy it scatters: then the norm's output, counted with the norm, is not saved, the copy is): the router keeps
    fp32 [r, E] probabilities and the top-k's int64 indices, sums and weights. The grouped GEMMs keep per expert row
    (r·k·etp slots, each processed by etp ranks holding slices of its expert: the balanced mean when dropless,
    imbalance moves it; at most the capacity factor times it with one) the input, the pre-activation and the
    activation (e bytes each). Back on the routing rank, per slot (r·k, dropped ones as zero rows): the combined
    output and the weighted output (the index_add's source), the weight and three int64 indices. The dispatch and
    combine keep no tensor (their backward is each other, from the count table). The shared expert as a dense MLP
    of its size. `parts`: what recomputation drops (models/recompute.py): "expert_act" the experts' activation
    output, "shared_expert" the shared expert's activations, "norm" the norm's output."""
    e, h, experts, f = PRECISIONS[precision], config.hidden_size, config.num_experts, config.moe_ffn_hidden_size
    etp = tp if etp is None else etp
    glu, k = (2 if config.activation == "swiglu" else 1), config.moe_router_topk
    routed = tokens // tp
    router = 4 * routed * experts + routed * (12 * k + 4)
    copy = e * routed * h if tp > 1 and rows == tokens else 0  # the replicated tokens' scattered share
    if copy and not config.moe_shared_expert_size and "norm" not in parts:  # nothing keeps the norm's output (the
        copy -= e * tokens * h  # shared expert would), counted with the norm
    slots = routed * k
    kept = (glu + 1 - ("expert_act" in parts)) * f // etp  # the pre-activation, the activation's output
    gemms = int(slots * etp * min(config.moe_capacity_factor or 1.0, 1.0)) * e * (h + kept)
    combine = slots * (2 * e * h + e + 24)
    shared = 0 if "shared_expert" in parts else e * tokens * (glu + 1) * config.moe_shared_expert_size // tp
    return router + copy + gemms + combine + shared


def layer_wgrad_bytes(config, *, tp, cp=1, micro_batch_size, seq_len, precision):
    """Bytes a deferred W (ZB-H1) holds per layer and micro-batch from its B on: each linear's input (the column
    layers' whole, re-gathered under SP) and output gradient, as tp.pipeline.DeferredWgrads queues them."""
    e = PRECISIONS[precision]
    h, d, f = config.hidden_size, config.head_dim, config.ffn_hidden_size
    heads, kv = config.num_heads // tp, local_kv_heads(config, tp)
    fc1 = (2 if config.activation == "swiglu" else 1) * f // tp
    attention = h + (heads + 2 * kv) * d + heads * d + h  # qkv: x, dz; proj: x, dz
    if config.multi_latent_attention:  # the tp layers: q_up (or q), kv_up, proj (the replicated ones run W in B)
        c = config
        q_in = h if c.q_lora_rank is None else c.q_lora_rank
        attention = q_in + heads * c.qk_head_dim + c.kv_lora_rank + heads * (c.qk_nope_head_dim + c.v_head_dim) + \
            heads * c.v_head_dim + h
    #                                                          fc1: x, dz   fc2: x, dz
    return e * micro_batch_size * seq_len // cp * (attention + h + fc1 + f // tp + h)


@functools.lru_cache(maxsize=4096)
def split_backward_states(schedule, pp, stage, micro_batches):
    """[(micro-batches awaiting B, awaiting W)] after each action of pipeline rank `stage` under a schedule that runs
    backward as B and W (ZB-H1)."""
    states, alive, deferred = [], 0, 0
    for action in build(schedule, pp, micro_batches, 1).actions[stage]:
        alive += {"F": 1, "B": -1}.get(action.kind, 0)
        deferred += {"B": 1, "W": -1}.get(action.kind, 0)
        states.append((alive, deferred))
    return tuple(states)


def zb_states(pp, stage, micro_batches):
    """split_backward_states of ZB-H1."""
    return split_backward_states("zb", pp, stage, micro_batches)


def edge_activation_bytes(config, *, tp, cp=1, micro_batch_size, seq_len, sequence_parallel, precision,
                          first, last, backend="triton"):
    """Per micro-batch bytes outside the blocks: embedding (first stage), final norm and loss (last stage), or the
    output held for the backward send (other stages)."""
    e = PRECISIONS[precision]
    h = config.hidden_size
    tokens = micro_batch_size * seq_len // cp
    rows = tokens // tp if sequence_parallel else tokens
    total = 0
    if first:
        total += 8 * tokens + (tokens if tp > 1 else 0)  # ids, and the out-of-shard mask
        total += rows * h if config.dropout else 0
    if last:
        real = min(config.padded_vocab_size(tp) // tp, config.vocab_size)  # rank 0's columns: the most
        total += norm_activation_bytes(config, rows, precision, backend)
        total += 4 * tokens * real + 10 * tokens + 8  # fp32 softmax, targets (int64), two masks, the token count
    else:
        total += e * rows * h  # the stage output, kept until its gradient arrives
    return total


def mtp_activation_bytes(config, *, tp, cp=1, micro_batch_size, seq_len, sequence_parallel, precision,
                         backend="triton"):
    """Per micro-batch bytes each multi-token prediction depth (models.mtp) saves on the last stage beside its block
    (a layer of the last layer's kind, counted by the caller): the token ids it reads and the embedding's mask, its
    two input norms, the [2h → h] projection's input (T'·2h), its final norm and the output layer's share of the
    loss (the fp32 softmax over this rank's real vocabulary, targets and masks, as edge_activation_bytes')."""
    e, h = PRECISIONS[precision], config.hidden_size
    tokens = micro_batch_size * seq_len // cp
    rows = tokens // tp if sequence_parallel else tokens
    real = min(config.padded_vocab_size(tp) // tp, config.vocab_size)
    ids = 8 * tokens + (tokens if tp > 1 else 0)
    norms = 3 * norm_activation_bytes(config, rows, precision, backend)
    return config.mtp_num_layers * (ids + norms + 2 * e * rows * h + 4 * tokens * real + 10 * tokens)


def in_flight(schedule, pp, stage, virtual_stages=1, micro_batches=None):
    """Micro-batches of whole-stage activations alive at once on pipeline rank `stage`: the schedule's closed form
    (tp.pipeline.schedules.SCHEDULES; equal to its simulated peak)."""
    return SCHEDULES[schedule].in_flight(pp, stage, virtual_stages, micro_batches)
