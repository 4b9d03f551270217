"""One transformer layer's time per micro-batch and pipeline rank (bench.plan.step_time's docstring says how each
piece is priced): its GEMMs (the attention's, the MLP's or the MoE layer's router and shared expert), the attention
core, the element-wise traffic, tp and cp communication, MoE's experts and dispatch (bench.plan.moe_time) and the
recomputed forward, summed into StageTimes."""
from dataclasses import dataclass

from .. import roofline as rl
from . import memory, moe_time
from .attention_time import attention_times
from .comm_time import cp_comm, tp_comm
from .gemm import gemm_time
from .mla_time import mla_elementwise_bytes, mla_gemms
from .recompute import recomputes

ELEMENT_SIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
OPS_PER_LAYER = 24  # forward ops of one block (norms 2x4, qkv, rope 5, core, proj, 2 adds, fc1, fc2, collectives 2+)


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


def attention_gemms(config, plan, tokens):
    """The attention's GEMMs on one rank: GQA's fused QKV and output projection, or multi-head latent attention's
    (bench.plan.mla_time)."""
    if config.multi_latent_attention:
        return mla_gemms(config, plan, tokens)
    c, h, tp = config, config.hidden_size, plan.tp
    d, kv = c.head_dim, memory.local_kv_heads(c, tp)
    return (rl.linear_gemms("qkv", tokens, h, (c.num_heads // tp + 2 * kv) * d)
            + rl.linear_gemms("proj", tokens, c.num_heads * d // tp, h))


def _layer_gemms(config, plan, tokens, moe=False):
    h, tp = config.hidden_size, plan.tp
    gemms = attention_gemms(config, plan, tokens)
    if moe:  # the router and the shared expert; the experts: bench.plan.moe_time.layer_costs
        return gemms + moe_time.dense_gemms(config, plan, tokens)
    glu = 2 if config.activation == "swiglu" else 1
    return gemms + rl.linear_gemms("fc1", tokens, h, glu * config.ffn_hidden_size // tp) + \
        rl.linear_gemms("fc2", tokens, config.ffn_hidden_size // tp, h)


def _elementwise_bytes(config, plan, tokens, software, e):
    """Forward bytes through HBM of one layer's element-wise ops (bench.plan.step_time's docstring); backward: twice
    this."""
    rows = tokens // plan.tp if plan.sp else tokens
    h = config.hidden_size
    if software.elementwise == "fused":  # LN read+write ×2, bias-dropout-add (2 in, 1 out, mask) ×2, bias-GeLU
        return rows * h * (2 * 2 * e + 2 * (3 * e + 1)) + 2 * e * tokens * config.ffn_hidden_size // plan.tp
    # RMSNorm ×2: upcast (e in, 4 out), statistics (two fp32 passes), downcast (4 in, e out), weight (e in, e out);
    # residual adds ×2 (2 in, 1 out); RoPE on q and k: ~10 passes of e (mul, rotate-half chunks and cat, mul, add)
    if config.multi_latent_attention:
        return mla_elementwise_bytes(config, plan, tokens, e)
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
    if recomputes(plan.recompute, "moe_act") and "moe" in pieces:
        time += moe_time.activation_bytes(config, plan, tokens, e) / cluster.device.hbm
    return time


def single_layer_times(config, plan, seq_len, cluster, software, moe):
    """StageTimes of one layer (dense, or an MoE layer: `moe`) per micro-batch."""
    e = ELEMENT_SIZE[software.precision]
    tokens = plan.micro_batch_size * seq_len // plan.cp
    gemms = _layer_gemms(config, plan, tokens, moe)
    g = {phase: sum(gemm_time(x, cluster, e) for x in gemms if x.phase == phase) for phase in ("fwd", "dgrad",
                                                                                                 "wgrad")}
    forward = {x.layer: gemm_time(x, cluster, e) for x in gemms if x.phase == "fwd"}
    attention = attention_times(config, plan, seq_len, cluster, software, e)
    elementwise = _elementwise_bytes(config, plan, tokens, software, e) / cluster.device.hbm
    tp_fwd, tp_bwd = tp_comm(config, plan, tokens, cluster, e)
    if software.tp_overlap:  # each collective pipelined in chunks with the GEMM it feeds or follows: what exceeds them
        tp_fwd, tp_bwd = max(0.0, tp_fwd - g["fwd"]), max(0.0, tp_bwd - g["dgrad"] - g["wgrad"])
    cp_fwd, cp_bwd = cp_comm(config, plan, seq_len, cluster, e, attention)
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
