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

This module prices the step; one layer is bench.plan.layer_time's (its MLA terms bench.plan.mla_time's, its MoE
terms bench.plan.moe_time's), a pipeline rank's chunks bench.plan.stage_time's, the communication pieces
bench.plan.comm_time's; their public names are importable from here too.
"""
from dataclasses import dataclass, replace

from models.flops import attention_widths, flops_per_token

from .. import roofline as rl
from . import memory, pipeline
from .comm_time import collective_time, cp_kv_elements, group_bandwidth
from .layer_time import ELEMENT_SIZE, OPS_PER_LAYER, StageTimes, attention_gemms
from .mla_time import mla_collectives
from .moe_time import routed_slots
from .recompute import recomputes
from .software import MEGATRON_2021, MEGATRON_2024, NEMO_2024, OURS, OURS_CPU, TORCHTITAN, Software
from .stage_time import chunk_times, stage_times
from .stages import EVEN, StageSplit, layer_counts

__all__ = ["ELEMENT_SIZE", "MEGATRON_2021", "MEGATRON_2024", "NEMO_2024", "OPS_PER_LAYER", "OURS", "OURS_CPU",
           "TORCHTITAN", "Plan", "Software", "StageTimes", "attention_gemms", "bubble_fraction", "chunk_times",
           "cp_kv_elements", "mla_collectives", "model_flops_per_token", "recompute_flops_per_token", "routed_slots",
           "stage_times", "step_time"]


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
    moe_layers = config.moe_layers()
    flops = 2 * config.num_layers * config.num_heads * sum(attention_widths(config)) * seq_len if recomputes(
        recompute, "core_attn") else 0
    if recomputes(recompute, "mlp"):
        flops += 2 * glu * h * config.ffn_hidden_size * (config.num_layers - moe_layers)
    if config.num_experts and recomputes(recompute, "moe"):
        flops += 2 * h * moe_layers * (config.moe_router_topk * glu * config.moe_ffn_hidden_size + config.num_experts)
    if recomputes(recompute, "moe") or recomputes(recompute, "shared_experts"):
        flops += 2 * glu * h * config.moe_shared_expert_size * moe_layers
    return flops


def bubble_fraction(pp, micro_batches, virtual_stages=1):
    """Idle fraction of the pipeline's span with equal micro-batch times: 1F1B and GPipe (p−1)/(m+p−1) (Huang et al.
    2019, GPipe §2.3); interleaved over v virtual stages (p−1)/(v·m + p−1) (Narayanan et al. 2021 §2.2.2: the bubble
    divided by v)."""
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)


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
    bandwidth = group_bandwidth(cluster, plan.tp * plan.cp * plan.dp)
    grads = software.grad_bytes * n
    window = times.bwd + times.wgrad + times.recompute if software.dp_overlap else 0.0  # the last backward
    if plan.dp_mode == "ddp":
        return max(0.0, collective_time(rl.ALL_REDUCE, grads, shards, bandwidth, cluster) - window)
    scatter = max(0.0, collective_time(rl.REDUCE_SCATTER, grads, shards, bandwidth, cluster) - window)
    gather = collective_time(rl.ALL_GATHER, e * n, shards, bandwidth, cluster)
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
    bandwidth = group_bandwidth(cluster, 2 * plan.tp * plan.cp * plan.dp)  # the neighbour is tp·cp·dp ranks away
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
