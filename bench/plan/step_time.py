"""bench.plan's step-time model: one training step of a GPTConfig under a plan (tp, cp, pp, virtual stages, dp,
micro-batch, recompute, SP, dp mode) on a node profile (bench.plan.hardware.Cluster), per rank of the slowest pipeline
stage.

Per micro-batch and stage (T = b·s/cp tokens per rank, T' = T/tp under SP, e bytes per element):
- GEMMs: every per-rank GEMM of the layers (fused QKV with GQA, output projection, fc1 (SwiGLU: 2F), fc2; forward,
  dgrad, wgrad) and the output layer, each at bench.roofline's Gemm roofline with the profile's achieved GEMM rate by
  shape (bench.plan.gemm: η on a full wave of 128 × 128 tiles over the SMs, times the shape's useful fraction).
- Attention core (bench.plan.attention_time): "flash" (SDPA, this package): causal forward 2·b·s²·d·a/tp/cp FLOPs
  (QKᵀ and PV, half the square), backward 2.5× (it recomputes the scores); "cudnn" (Transformer Engine's fused
  attention): the same FLOPs; each at the profile's measured rate for the kernel's s/cp (or one efficiency).
  "materialized" (Megatron 2021-22): QKᵀ and PV as batched GEMMs over the whole square, plus softmax, mask and
  dropout streaming the b·a/tp·s² scores through HBM.
- Element-wise ops (memory-bound, at HBM): "eager" — this package's norms, RoPE and residual adds as separate torch
  ops; "fused" — Megatron's fused LayerNorm, bias-GeLU and bias-dropout-add kernels. Backward streams twice forward.
- TP collectives: bench.roofline.pair_collectives for the two column→row pairs (ring bytes, SP's extra re-gather),
  plus the embedding's and output layer's; NVLink inside a node, the NIC across nodes, at η_comm, plus the profile's
  latency per collective; not overlapped (Megatron 2022 and this package run them on the critical path), except
  under Software.tp_overlap (TE's userbuffers): then only what exceeds the phase's GEMMs is exposed.
- cp: ring mode moves (cp−1)·2·b·s/cp·kv·d elements of K/V per layer forward, K/V again plus fp32 dK/dV backward,
  hidden behind the attention blocks it feeds (exposed: what exceeds them); all-gather mode: one all-gather forward
  and a reduce-scatter backward, exposed.
- Recompute (bench.plan.recompute): full adds every block's forward again; selective (core_attn) the attention
  core's (materialized: with its softmax); the other modules their own forward: layernorm the norms' traffic, mlp,
  moe and shared_experts their GEMMs (moe: with its dispatch), moe_act the activation's traffic.
- Multi-head latent attention (models.mla): its down-projections (replicated: over T' rows, T without SP), up-
  projections over the rank's heads and output projection as GEMMs; the core at q·k and v widths of their own
  (models.flops.attention_widths); tp collectives on the latents (mla_collectives), cp K/V at the wider head.
- Multi-token prediction (models.mtp) on the last stage: each depth's block, projection and lookup, and the output
  layer and loss over (1 + D)× the tokens.
- Mixture-of-experts layers (ep, etp; bench.plan.moe_time): the router GEMM over E outputs, the experts as one
  grouped GEMM over the busiest rank's slots, the shared expert as a dense MLP; the dispatch and combine over NVLink
  and the NIC at once (node-aware; DeepEP's per-node deduplication), the permutation's and router's traffic, the
  host's launches after the dispatch's host sync. The dp reduce and the optimizer count the rank's experts (E/ep)
  with the dense weights, over dp·cp (not edp: an approximation).
Per step: with equal stages, m micro-batches through the slowest stage plus the schedule's bubble ((p−1)/v micro-
batch times for 1F1B and interleaved over v virtual stages: bubble_fraction, equal to tp.pipeline.schedules'
simulation); with an uneven split (bench.plan.stages) the span tp.pipeline.schedules' simulator gives each virtual
stage's own times (bench.plan.pipeline); plans use 1F1B, or interleaved when v > 1; pp p2p of each micro-batch's
activation (×v interleaved), the dp gradient reduce (ddp all-reduce; zero1 reduce-scatter + parameter all-gather;
fsdp per-micro-batch parameter all-gathers and one gradient reduce-scatter), overlapped with the last backward where
the implementation does (and zero1's parameter all-gather with the first forward under
Software.param_gather_overlap; interleaved p2p with another chunk's compute under Software.p2p_overlap), and the
optimizer step (memory-bound over its local state).
MFU = model FLOPs (6·N + attention 12·L·h·s + logits 6·h·V per token, Narayanan et al. 2021 §5.1, full attention as
the papers count it) / (step time × peak × GPUs); HFU adds the recomputed FLOPs.
"""
from dataclasses import dataclass, replace

from models.flops import attention_widths, flops_per_token

from .. import roofline as rl
from . import memory, moe_time, pipeline
from .attention_time import attention_times
from .gemm import gemm_time
from .moe_time import routed_slots
from .recompute import recomputes
from .software import MEGATRON_2021, MEGATRON_2024, NEMO_2024, OURS, OURS_CPU, TORCHTITAN, Software
from .stages import EVEN, StageSplit, layer_counts

__all__ = ["ELEMENT_SIZE", "MEGATRON_2021", "MEGATRON_2024", "NEMO_2024", "OURS", "OURS_CPU", "TORCHTITAN", "Plan",
           "Software", "StageTimes", "bubble_fraction", "cp_kv_elements", "model_flops_per_token",
           "recompute_flops_per_token", "routed_slots", "stage_times", "step_time"]


@dataclass(frozen=True)
class Plan:
    """One candidate way to run a model: tp × cp × pp (virtual_stages model chunks per pipeline rank) × dp ranks,
    micro-batch size, recompute ("none" | "selective" | "full"), sequence parallelism (sp), dp mode ("ddp" | "zero1" |
    "fsdp")."""
    tp: int
    cp: int
    pp: int
    virtual_stages: int
    dp: int
    micro_batch_size: int
    recompute: str = "none"
    sp: bool = False
    dp_mode: str = "ddp"
    ep: int = 1  # experts over ep ranks (MoE)
    etp: int | None = None  # each expert's FFN over etp ranks; None: tp
    dispatcher: str = "alltoall"  # the MoE token dispatcher (bench.plan.moe_time.CHOICES)
    split: StageSplit = EVEN  # the layers over the pipeline stages (bench.plan.stages: Megatron's uneven flags)

    @property
    def expert_tp(self):
        return self.tp if self.etp is None else self.etp

    @property
    def gpus(self):
        return self.tp * self.cp * self.pp * self.dp

    @property
    def schedule(self):
        return "interleaved" if self.virtual_stages > 1 else "1f1b"


ELEMENT_SIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
OPS_PER_LAYER = 24  # forward ops of one block (norms 2x4, qkv, rope 5, core, proj, 2 adds, fc1, fc2, collectives 2+)


def model_flops_per_token(config, seq_len):
    """Training FLOPs per token (Narayanan et al. 2021, arXiv:2104.04473, §5.1), as the training log counts them
    (models.flops): 6·N (the blocks' matmul weights) + 12·L·a·d·s (attention, full square) + 6·h·V (logits). For a
    GPT-3-shaped model: Narayanan et al.'s 72·L·h²·(1 + s/(6h) + V/(12·L·h))."""
    return flops_per_token(config, seq_len)


def recompute_flops_per_token(config, seq_len, recompute):
    """FLOPs recomputed per token: full — every block's forward (a third of its 6·N and attention); selective (the
    core_attn module) — the attention core's forward (QKᵀ, PV over the full square, as Korthikanti et al. count it);
    mlp, moe, shared_experts — those modules' forward GEMMs (bench.plan.recompute; the output-discarding modules
    repeat no GEMM)."""
    logits = 6 * (1 + config.mtp_num_layers) * config.hidden_size * config.vocab_size
    if recomputes(recompute, "block"):
        return (model_flops_per_token(config, seq_len) - logits) / 3
    h, glu = config.hidden_size, 3 if config.activation == "swiglu" else 2
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    flops = 2 * config.num_layers * config.num_heads * sum(attention_widths(config)) * seq_len if recomputes(
        recompute, "core_attn") else 0
    if recomputes(recompute, "mlp"):
        flops += 2 * glu * h * config.ffn_hidden_size * (config.num_layers - moe_layers)
    if config.num_experts and recomputes(recompute, "moe"):
        flops += 2 * h * moe_layers * (config.moe_router_topk * glu * config.moe_ffn_hidden_size + config.num_experts)
    if recomputes(recompute, "moe") or recomputes(recompute, "shared_experts"):
        flops += 2 * glu * h * config.moe_shared_expert_size * moe_layers
    return flops


# ---- pieces ---------------------------------------------------------------------------------------------------------


def _bandwidth(cluster, group_span):
    """Per-device bandwidth of a group spanning `group_span` consecutive ranks: NVLink inside a node, else the NIC."""
    return rl.group_link(cluster.device, group_span)[0] * cluster.comm_efficiency


def _collective_time(kind, size, ranks, bandwidth, cluster):
    if ranks == 1:
        return 0.0
    return rl.Collective(kind, "fwd", size).wire_bytes(ranks) / bandwidth + cluster.device.latency


def attention_gemms(config, plan, tokens):
    """The attention's GEMMs on one rank: GQA's fused QKV and output projection, or multi-head latent attention's
    (models.mla): the down-projections whole on every rank (over its T/tp tokens under SP, all T without), the
    up-projections over the rank's heads, the output projection row-parallel."""
    c, h, tp = config, config.hidden_size, plan.tp
    if not c.multi_latent_attention:
        d, kv = c.head_dim, memory.local_kv_heads(c, tp)
        return (rl.linear_gemms("qkv", tokens, h, (c.num_heads // tp + 2 * kv) * d)
                + rl.linear_gemms("proj", tokens, c.num_heads * d // tp, h))
    heads, rows = c.num_heads // tp, tokens // tp if plan.sp else tokens
    gemms = rl.linear_gemms("kv_down", rows, h, c.kv_lora_rank + c.qk_rope_head_dim) + \
        rl.linear_gemms("kv_up", tokens, c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim))
    if c.q_lora_rank is None:
        gemms += rl.linear_gemms("q", tokens, h, heads * c.qk_head_dim)
    else:
        gemms += rl.linear_gemms("q_down", rows, h, c.q_lora_rank) + \
            rl.linear_gemms("q_up", tokens, c.q_lora_rank, heads * c.qk_head_dim)
    return gemms + rl.linear_gemms("proj", tokens, heads * c.v_head_dim, h)


def _layer_gemms(config, plan, tokens, moe=False):
    h, tp = config.hidden_size, plan.tp
    glu = 2 if config.activation == "swiglu" else 1
    gemms = attention_gemms(config, plan, tokens)
    if not moe:
        return gemms + rl.linear_gemms("fc1", tokens, h, glu * config.ffn_hidden_size // tp) + \
            rl.linear_gemms("fc2", tokens, config.ffn_hidden_size // tp, h)
    # the router (whole on every rank, over the tokens it routes); the experts: bench.plan.moe_time
    gemms += rl.linear_gemms("router", tokens // tp if plan.sp else tokens, h, config.num_experts)
    shared = config.moe_shared_expert_size
    if shared:
        gemms += rl.linear_gemms("shared_fc1", tokens, h, glu * shared // tp) + \
            rl.linear_gemms("shared_fc2", tokens, shared // tp, h)
    return gemms


def _elementwise_bytes(config, plan, tokens, software, e):
    """Forward bytes through HBM of one layer's element-wise ops (the module docstring); backward: twice this."""
    rows = tokens // plan.tp if plan.sp else tokens
    h = config.hidden_size
    if software.elementwise == "fused":  # LN read+write ×2, bias-dropout-add (2 in, 1 out, mask) ×2, bias-GeLU
        return rows * h * (2 * 2 * e + 2 * (3 * e + 1)) + 2 * e * tokens * config.ffn_hidden_size // plan.tp
    # RMSNorm ×2: upcast (e in, 4 out), statistics (two fp32 passes), downcast (4 in, e out), weight (e in, e out);
    # residual adds ×2 (2 in, 1 out); RoPE on q and k: ~10 passes of e (mul, rotate-half chunks and cat, mul, add)
    if config.multi_latent_attention:  # RoPE on the rope features of q and the one shared k; q and k concatenated
        c, heads = config, config.num_heads // plan.tp
        rope = 10 * e * tokens * (heads + 1) * c.qk_rope_head_dim + 2 * 2 * e * tokens * heads * c.qk_head_dim
        latents = c.kv_lora_rank + (c.q_lora_rank or 0)  # their RMSNorms, as the block's
        return rows * h * (2 * (4 * e + 20) + 2 * 3 * e) + rope + rows * latents * (4 * e + 20)
    qk = tokens * (config.num_heads // plan.tp + memory.local_kv_heads(config, plan.tp)) * config.head_dim
    rope = 10 * e * qk if config.position == "rope" else 0
    return rows * h * (2 * (4 * e + 20) + 2 * 3 * e) + rope


def _norm_bytes(config, plan, tokens, software, e):
    """Forward bytes of the layer's two norms (within _elementwise_bytes): what recomputing "layernorm" repeats."""
    rows = tokens // plan.tp if plan.sp else tokens
    return 2 * rows * config.hidden_size * (2 * e if software.elementwise == "fused" else 4 * e + 20)


def _recompute_time(config, plan, tokens, cluster, software, e, pieces):
    """Seconds per micro-batch of one layer's recomputed forward under plan.recompute's modules (bench.plan.recompute);
    `pieces`: {name: forward seconds} of the layer's parts."""
    time = 0.0
    for module, piece in (("core_attn", "attention"), ("mlp", "mlp"), ("moe", "moe"),
                          ("shared_experts", "shared")):
        if recomputes(plan.recompute, module):
            time += pieces.get(piece, 0.0)
    if recomputes(plan.recompute, "layernorm"):
        time += _norm_bytes(config, plan, tokens, software, e) / cluster.device.hbm
    if recomputes(plan.recompute, "moe_act") and "moe" in pieces:  # the experts' activation: read 2F (SwiGLU), write F
        glu = 2 if config.activation == "swiglu" else 1
        time += e * routed_slots(config, plan, tokens) * (glu + 1) * config.moe_ffn_hidden_size // plan.expert_tp / \
            cluster.device.hbm
    return time


def _tp_comm(config, plan, tokens, cluster, e):
    """(forward, backward) seconds of one layer's tensor-parallel collectives."""
    if plan.tp == 1:
        return 0.0, 0.0
    bandwidth = _bandwidth(cluster, plan.tp)
    times = {"fwd": 0.0, "bwd": 0.0}
    mlp = rl.pair_collectives(tokens, config.hidden_size, plan.tp, e, sequence_parallel=plan.sp)
    attention = mla_collectives(config, plan, tokens, e) if config.multi_latent_attention else mlp
    for c in attention + mlp:
        times[c.phase] += _collective_time(c.kind, c.size, plan.tp, bandwidth, cluster)
    return times["fwd"], times["bwd"]


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


def cp_kv_elements(config, plan, seq_len):
    """K and V elements of one rank's share per layer and micro-batch: 2·b·s/cp·kv·d (kv: this tp rank's heads; MLA:
    every head its k and v, both padded to the wider of the q·k and v head widths). Ring mode sends cp − 1 of them
    forward, as many again backward plus as many dK/dV (fp32)."""
    return 2 * plan.micro_batch_size * seq_len // plan.cp * memory.local_kv_heads(config, plan.tp) * \
        max(attention_widths(config))


def _cp_comm(config, plan, seq_len, cluster, e, attention):
    """(forward, backward) exposed seconds of one layer's cp K/V traffic (module docstring)."""
    if plan.cp == 1:
        return 0.0, 0.0
    block = cp_kv_elements(config, plan, seq_len)
    bandwidth = _bandwidth(cluster, plan.tp * plan.cp)
    if config.cp_mode == "allgather":
        gather = _collective_time(rl.ALL_GATHER, e * block * plan.cp, plan.cp, bandwidth, cluster)
        scatter = _collective_time(rl.REDUCE_SCATTER, 4 * block * plan.cp, plan.cp, bandwidth, cluster)
        return gather, scatter
    step = e * block / bandwidth + cluster.device.latency  # one ring step's send (and receive)
    fwd = (plan.cp - 1) * step
    bwd = (plan.cp - 1) * (step + 4 * block / bandwidth)  # K/V again, fp32 dK/dV back
    return max(0.0, fwd - attention[0]), max(0.0, bwd - attention[1])


def bubble_fraction(pp, micro_batches, virtual_stages=1):
    """Idle fraction of the pipeline's span with equal micro-batch times: 1F1B and GPipe (p−1)/(m+p−1) (Huang et al.
    2019, GPipe §2.3); interleaved over v virtual stages (p−1)/(v·m + p−1) (Narayanan et al. 2021 §2.2.2: the bubble
    divided by v)."""
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)


@dataclass
class StageTimes:
    """Seconds per micro-batch on one pipeline rank."""
    fwd: float = 0.0
    bwd: float = 0.0  # input-gradient part (B)
    wgrad: float = 0.0  # weight-gradient GEMMs (W; inside bwd for fused schedules)
    recompute: float = 0.0
    parts: dict = None  # per micro-batch: gemm, attention, elementwise, tp_comm, cp_comm, recompute, overhead

    @property
    def total(self):
        return self.fwd + self.bwd + self.wgrad + self.recompute


def _layer_times(config, plan, seq_len, cluster, software, moe):
    """StageTimes of one layer (dense, or an MoE layer: `moe`) per micro-batch."""
    e = ELEMENT_SIZE[software.precision]
    tokens = plan.micro_batch_size * seq_len // plan.cp
    gemms = _layer_gemms(config, plan, tokens, moe)
    g = {phase: sum(gemm_time(x, cluster, e) for x in gemms if x.phase == phase) for phase in ("fwd", "dgrad",
                                                                                                 "wgrad")}
    forward = {x.layer: gemm_time(x, cluster, e) for x in gemms if x.phase == "fwd"}
    attention = attention_times(config, plan, seq_len, cluster, software, e)
    elementwise = _elementwise_bytes(config, plan, tokens, software, e) / cluster.device.hbm
    tp_fwd, tp_bwd = _tp_comm(config, plan, tokens, cluster, e)
    if software.tp_overlap:  # each collective pipelined in chunks with the GEMM it feeds or follows: what exceeds them
        tp_fwd, tp_bwd = max(0.0, tp_fwd - g["fwd"]), max(0.0, tp_bwd - g["dgrad"] - g["wgrad"])
    cp_fwd, cp_bwd = _cp_comm(config, plan, seq_len, cluster, e, attention)
    a2a, host = (0.0, 0.0), (0.0, 0.0)
    pieces = {"attention": attention[0], "shared": forward.get("shared_fc1", 0.0) + forward.get("shared_fc2", 0.0),
              "mlp": forward.get("fc1", 0.0) + forward.get("fc2", 0.0) + tp_fwd / 2}
    if moe:
        parts = moe_time.layer_costs(config, plan, tokens, cluster, software, e,
                           (g["fwd"] + attention[0], g["dgrad"] + g["wgrad"] + attention[1]))
        g = {phase: g[phase] + parts["experts"][phase] for phase in g}
        elementwise, a2a, host = elementwise + parts["permute"], parts["a2a"], parts["host"]
        pieces["moe"] = parts["experts"]["fwd"] + forward["router"] + pieces["shared"] + parts["permute"] + a2a[0] + \
            host[0] + tp_fwd / 2
    overhead = OPS_PER_LAYER * cluster.op_overhead
    layer_fwd = g["fwd"] + attention[0] + elementwise + tp_fwd + cp_fwd + a2a[0] + host[0] + overhead
    layer_bwd = g["dgrad"] + attention[1] + 2 * elementwise + tp_bwd + cp_bwd + a2a[1] + host[1] + 2 * overhead
    recompute = layer_fwd if recomputes(plan.recompute, "block") else \
        _recompute_time(config, plan, tokens, cluster, software, e, pieces)
    parts = {"gemm": sum(g.values()), "attention": sum(attention), "elementwise": 3 * elementwise,
             "tp_comm": tp_fwd + tp_bwd, "cp_comm": cp_fwd + cp_bwd, "ep_a2a": sum(a2a), "moe_host": sum(host),
             "recompute": recompute, "overhead": 3 * overhead}
    return StageTimes(layer_fwd, layer_bwd, g["wgrad"], recompute, parts)


def _add(times, one, count=1):
    """Accumulate `count` × StageTimes `one` into `times`."""
    times.fwd, times.bwd = times.fwd + count * one.fwd, times.bwd + count * one.bwd
    times.wgrad, times.recompute = times.wgrad + count * one.wgrad, times.recompute + count * one.recompute
    for name, value in one.parts.items():
        times.parts[name] = times.parts.get(name, 0.0) + count * value


def chunk_times(config, plan, seq_len, cluster, software, chunk, layer_times=None):
    """StageTimes of one model chunk (first layer, stop, pre_process, post_process): its layers, and the embedding /
    output layer where it holds them. `layer_times`: {is MoE: one layer's StageTimes}, when the caller has them."""
    start, stop, first, last = chunk
    e = ELEMENT_SIZE[software.precision]
    tokens = plan.micro_batch_size * seq_len // plan.cp
    times = StageTimes(parts={})
    layer_times = {} if layer_times is None else layer_times
    for moe in (False, True):
        layers = sum(config.is_moe_layer(i) == moe for i in range(start, stop))
        if layers:
            if moe not in layer_times:
                layer_times[moe] = _layer_times(config, plan, seq_len, cluster, software, moe)
            _add(times, layer_times[moe], layers)
    rows = tokens // plan.tp if plan.sp else tokens
    if first:  # embedding lookup (write T'·h) and its all-reduce (SP: reduce-scatter)
        comm = _collective_time(rl.REDUCE_SCATTER if plan.sp else rl.ALL_REDUCE, e * tokens * config.hidden_size,
                                plan.tp, _bandwidth(cluster, plan.tp), cluster)
        lookup = e * rows * config.hidden_size / cluster.device.hbm
        times.fwd += lookup + comm
        _add(times, StageTimes(parts={"elementwise": lookup, "tp_comm": comm}))
    if last and config.mtp_num_layers:
        _add_mtp(times, config, plan, seq_len, cluster, software, layer_times)
    if last:  # output layer GEMMs, the loss's fp32 softmax over this rank's vocabulary (~4 passes each way); with
        # MTP over every depth's tokens at once (models.gpt: one output GEMM for 1 + D depths)
        tokens *= 1 + config.mtp_num_layers
        head = rl.linear_gemms("logits", tokens, config.hidden_size, config.padded_vocab_size(plan.tp) // plan.tp)
        loss = 16 * tokens * config.padded_vocab_size(plan.tp) // plan.tp / cluster.device.hbm
        comm = 0.0
        if plan.sp:  # the output layer gathers the sequence, and reduce-scatters its input gradient
            bandwidth = _bandwidth(cluster, plan.tp)
            comm = 2 * _collective_time(rl.ALL_GATHER, e * tokens * config.hidden_size, plan.tp, bandwidth, cluster)
        times.fwd += gemm_time(head[0], cluster, e) + loss + comm / 2
        times.bwd += gemm_time(head[1], cluster, e) + loss + comm / 2
        times.wgrad += gemm_time(head[2], cluster, e)
        _add(times, StageTimes(parts={"gemm": sum(gemm_time(x, cluster, e) for x in head), "elementwise": 2 * loss,
                                      "tp_comm": comm}))
    return times


def _add_mtp(times, config, plan, seq_len, cluster, software, layer_times):
    """The multi-token prediction depths on the last stage (models.mtp), beside their share of the output layer: each
    a block of the last layer's kind, its [2h → h] projection (whole on every rank: over T/tp tokens under SP, all T
    without) and the embedding lookup of the tokens it reads."""
    moe = config.is_moe_layer(config.num_layers - 1)
    if moe not in layer_times:
        layer_times[moe] = _layer_times(config, plan, seq_len, cluster, software, moe)
    e = ELEMENT_SIZE[software.precision]
    tokens = plan.micro_batch_size * seq_len // plan.cp
    rows = tokens // plan.tp if plan.sp else tokens
    proj = [gemm_time(x, cluster, e) for x in rl.linear_gemms("mtp_proj", rows, 2 * config.hidden_size,
                                                               config.hidden_size)]
    lookup = e * rows * config.hidden_size / cluster.device.hbm
    one = StageTimes(proj[0] + lookup, proj[1], proj[2], 0.0, {"gemm": sum(proj), "elementwise": lookup})
    _add(times, layer_times[moe], config.mtp_num_layers)
    _add(times, one, config.mtp_num_layers)


def stage_times(config, plan, seq_len, cluster, software, stage, layer_times=None):
    """StageTimes of pipeline rank `stage`: the sum of its model chunks'."""
    times, layer_times = StageTimes(parts={}), {} if layer_times is None else layer_times
    for chunk in memory.stage_chunks(config.num_layers, plan.pp, stage, plan.virtual_stages, plan.split):
        _add(times, chunk_times(config, plan, seq_len, cluster, software, chunk, layer_times))
    return times


# ---- the step --------------------------------------------------------------------------------------------------------


def _stage_params(config, plan, stage):
    return memory.stage_numel(config, plan.tp, plan.pp, stage, plan.virtual_stages, ep=plan.ep, etp=plan.etp,
                              split=plan.split)


def _dp_time(config, plan, cluster, software, stage, times, micro_batches):
    """Exposed seconds of the data-parallel traffic per step on `stage`."""
    shards = plan.dp * plan.cp  # gradients are reduced over dp x cp
    if shards == 1:
        return 0.0
    n = _stage_params(config, plan, stage)
    e = ELEMENT_SIZE[software.precision]
    bandwidth = _bandwidth(cluster, plan.tp * plan.cp * plan.dp)
    grads = software.grad_bytes * n
    window = times.bwd + times.wgrad + times.recompute if software.dp_overlap else 0.0  # the last backward
    if plan.dp_mode == "ddp":
        return max(0.0, _collective_time(rl.ALL_REDUCE, grads, shards, bandwidth, cluster) - window)
    scatter = max(0.0, _collective_time(rl.REDUCE_SCATTER, grads, shards, bandwidth, cluster) - window)
    gather = _collective_time(rl.ALL_GATHER, e * n, shards, bandwidth, cluster)
    if plan.dp_mode == "zero1":  # the gather prefetched bucket by bucket during the first micro-batch's forward
        return scatter + (max(0.0, gather - times.fwd) if software.param_gather_overlap else gather)
    # fsdp: every micro-batch gathers the parameters for its forward and again for its backward, prefetched
    return scatter + micro_batches * max(0.0, 2 * gather - times.total)


def _optimizer_time(config, plan, cluster, software, stage):
    n = _stage_params(config, plan, stage)
    local = n / (plan.dp * plan.cp) if plan.dp_mode != "ddp" else n  # zero1 and fsdp: a dp·cp shard
    touched = 32 if software.precision in ("bf16", "fp16") else 28  # Adam: read and write param, master, moments
    return local * touched / cluster.device.hbm


def _p2p_time(config, plan, seq_len, cluster, software):
    """Seconds of one activation send between neighbouring stages."""
    if plan.pp == 1:
        return 0.0
    e = ELEMENT_SIZE[software.precision]
    rows = plan.micro_batch_size * seq_len // plan.cp // (plan.tp if plan.sp else 1)
    size = e * rows * config.hidden_size
    if software.p2p_scatter_gather and not plan.sp:
        size /= plan.tp
    bandwidth = _bandwidth(cluster, 2 * plan.tp * plan.cp * plan.dp)  # the neighbour is tp·cp·dp ranks away
    return size / bandwidth + cluster.device.latency


def _with_cpu_sharing(cluster, plan):
    """On the CPU profile ranks beyond the cores share them: each gets cores / ranks of a core's rate."""
    if not cluster.cores or plan.gpus <= cluster.cores:
        return cluster
    slow = cluster.cores / plan.gpus
    device = replace(cluster.device, flops=cluster.device.flops * slow, hbm=cluster.device.hbm * slow)
    return replace(cluster, device=device, op_overhead=cluster.op_overhead / slow)


def _even_pipeline(config, plan, seq_len, cluster, software, m):
    """(span, slowest rank, its StageTimes, its seconds per micro-batch with p2p, p2p per send) of equal stages:
    the slowest rank's micro-batches plus the schedule's closed-form bubble ((p − 1)/v of them)."""
    # Only the ends can be the slowest (or hold the most parameters): rank 0 has at least any middle rank's layers
    # and the embedding, the last rank the output layer and the loss (bench.plan.memory.estimate says why).
    layers = {}
    distinct = [(s, stage_times(config, plan, seq_len, cluster, software, s, layers)) for s in sorted({0, plan.pp - 1})]
    slowest, t = max(distinct, key=lambda item: item[1].total)
    p2p = _p2p_time(config, plan, seq_len, cluster, software)
    if software.p2p_overlap and plan.virtual_stages > 1:  # each send behind another model chunk's compute
        p2p = max(0.0, p2p - t.total / plan.virtual_stages)
    per_micro = t.total + 2 * p2p * plan.virtual_stages if plan.pp > 1 else t.total
    idle = bubble_fraction(plan.pp, m, plan.virtual_stages)
    return m * per_micro / (1 - idle), distinct, slowest, per_micro, p2p


def _simulated_pipeline(config, plan, seq_len, cluster, software, m):
    """As _even_pipeline for stages that differ (an uneven split): every virtual stage's (F, B, W) from its own
    chunk, the span from tp.pipeline.schedules' simulator (bench.plan.pipeline)."""
    counts = layer_counts(config.num_layers, plan.pp, plan.virtual_stages, plan.split)
    starts = [sum(counts[:s]) for s in range(len(counts))]
    layers = {}
    chunks = [chunk_times(config, plan, seq_len, cluster, software,
                          (starts[s], starts[s] + counts[s], s == 0, s == len(counts) - 1), layers)
              for s in range(len(counts))]
    p2p = _p2p_time(config, plan, seq_len, cluster, software)
    if software.p2p_overlap and plan.virtual_stages > 1:
        p2p = max(0.0, p2p - min(c.total for c in chunks))
    costs = [(c.fwd + p2p, c.bwd + c.recompute + p2p, c.wgrad) for c in chunks]
    span = pipeline.span(plan.schedule, plan.pp, plan.virtual_stages, m, costs)
    ranks = {0, min(1, plan.pp - 1), plan.pp - 1}  # the middle ranks are alike: rank 1 stands for them
    distinct = [(r, stage_times(config, plan, seq_len, cluster, software, r, layers)) for r in sorted(ranks)]
    slowest, t = max(distinct, key=lambda item: item[1].total)
    return span, distinct, slowest, t.total + 2 * p2p * plan.virtual_stages, p2p


def step_time(config, plan, *, seq_len, global_batch_size, cluster, software=OURS):
    """{"step_s", "tokens_per_s", "mfu", "hfu", "breakdown": {part: seconds per step}} of one training step."""
    peak = min(plan.gpus, cluster.cores or plan.gpus) * cluster.device.flops  # ranks beyond the cores share them
    cluster = _with_cpu_sharing(cluster, plan)
    m = global_batch_size // (plan.dp * plan.micro_batch_size)
    pipelined = _even_pipeline if plan.split.even or plan.pp == 1 else _simulated_pipeline
    span, distinct, slowest, per_micro, p2p = pipelined(config, plan, seq_len, cluster, software, m)
    t = dict(distinct)[slowest]
    dp = max(_dp_time(config, plan, cluster, software, s, times, m) for s, times in distinct)
    optimizer = max(_optimizer_time(config, plan, cluster, software, s) for s, _ in distinct)
    step = span + dp + optimizer
    tokens = global_batch_size * seq_len
    flops = model_flops_per_token(config, seq_len) * tokens
    recomputed = recompute_flops_per_token(config, seq_len, plan.recompute) * tokens
    breakdown = {name: m * value for name, value in t.parts.items()}
    breakdown.update(pp_p2p=m * 2 * p2p * plan.virtual_stages if plan.pp > 1 else 0.0, bubble=span - m * per_micro,
                     dp_comm=dp, optimizer=optimizer)
    return {"step_s": step, "tokens_per_s": tokens / step, "mfu": flops / (step * peak),
            "hfu": (flops + recomputed) / (step * peak), "micro_batches": m, "slowest_stage": slowest,
            "breakdown": breakdown}
