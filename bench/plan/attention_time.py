"""The attention core's time per layer and micro-batch (bench.plan.step_time's): flash-style kernels at measured rates
by sequence length (the profile's curves, linear in log s between their points) or one efficiency, and the
materialized scores of Megatron 2021-22 as batched GEMMs plus the softmax, mask and dropout traffic."""
import math

from .. import roofline as rl
from .gemm import gemm_time


def attention_times(config, plan, seq_len, cluster, software, e):
    """(forward, backward) seconds of one layer's attention core per micro-batch."""
    heads = plan.micro_batch_size * config.num_heads // plan.tp  # (batch × local heads) independent problems
    s_q, s_k, d = seq_len // plan.cp, seq_len, config.head_dim
    if software.attention in ("flash", "cudnn"):
        flops = 2 * heads * s_q * s_k * d  # QKᵀ and PV, causal: half of 4·s_q·s_k·d
        efficiency = cluster.cudnn_attention_efficiency if software.attention == "cudnn" else 0.0
        rate = (efficiency or cluster.attention_efficiency) * cluster.device.flops
        measured = (cluster.attention_rates or {}).get(software.attention, {})
        # the kernel's problem: s/cp queries against each block of s/cp keys (ring) or all s (all-gather)
        fwd, bwd = (rate_at(measured[way], s_q) if way in measured else rate for way in ("fwd", "bwd"))
        return flops / fwd, 2.5 * flops / bwd
    qk, pv = rl.Gemm("qk", "fwd", s_q, d, s_k), rl.Gemm("pv", "fwd", s_q, s_k, d)
    gemm = gemm_time(qk, cluster, e, heads) + gemm_time(pv, cluster, e, heads)
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
