"""The attention core's time per layer and micro-batch (bench.plan.step_time's): flash-style kernels at measured rates
by sequence length (the profile's curves, linear in log s between their points) or one efficiency, and the
materialized scores of Megatron 2021-22 as batched GEMMs plus the softmax, mask and dropout traffic."""
import math

from models.flops import attention_widths

from .. import roofline as rl
from .gemm import gemm_time


def attention_times(config, plan, seq_len, cluster, software, e):
    """(forward, backward) seconds of one layer's attention core per micro-batch; q·k and v of their own widths
    (models.flops.attention_widths: MLA's nope + rope and v_head_dim), the kernels' rates measured at head dim 128."""
    heads = plan.micro_batch_size * config.num_heads // plan.tp  # (batch × local heads) independent problems
    s_q, s_k = seq_len // plan.cp, seq_len
    qk, v = attention_widths(config)
    if software.attention in ("flash", "cudnn"):
        flops = heads * s_q * s_k * (qk + v)  # QKᵀ and PV, causal: half of 2·s_q·s_k·(qk + v)
        efficiency = cluster.cudnn_attention_efficiency if software.attention == "cudnn" else 0.0
        rate = (efficiency or cluster.attention_efficiency) * cluster.device.flops
        measured = (cluster.attention_rates or {}).get(software.attention, {})
        # the kernel's problem: s/cp queries against each block of s/cp keys (ring) or all s (all-gather)
        fwd, bwd = (rate_at(measured[way], s_q) if way in measured else rate for way in ("fwd", "bwd"))
        return flops / fwd, 2.5 * flops / bwd
    qk_gemm, pv_gemm = rl.Gemm("qk", "fwd", s_q, qk, s_k), rl.Gemm("pv", "fwd", s_q, s_k, v)
    gemm = gemm_time(qk_gemm, cluster, e, heads) + gemm_time(pv_gemm, cluster, e, heads)
    scores = heads * s_q * s_k
    # forward: softmax (read, write), dropout (read, write, 1-byte mask); backward: dropout and softmax grads
    stream = cluster.device.hbm
    return gemm + scores * (4 * e + 1) / stream, 2 * gemm + scores * (6 * e + 1) / stream


def rate_at(points, seq_len):
    """FLOP/s at `seq_len` from measured (sequence length, TFLOP/s) points: linear in log s between, flat beyond."""
    x = math.log2(seq_len)
    (x0, y0), *rest = [(math.log2(s), t * 1e12) for s, t in points]
    if x <= x0:
        return y0
    for x1, y1 in rest:
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        x0, y0 = x1, y1
    return y0
