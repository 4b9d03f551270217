"""A pipeline rank's time per micro-batch: the StageTimes of its model chunks (bench.plan.step_time's docstring):
their layers (bench.plan.layer_time), the embedding lookup on the first stage, the output layer and loss (and the
multi-token prediction depths) on the last."""
from .. import roofline as rl
from . import memory
from .comm_time import collective_time, group_bandwidth
from .gemm import gemm_time
from .layer_time import ELEMENT_SIZE, StageTimes, single_layer_times


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
    moe_layers = config.moe_layers(start, stop)
    for moe, layers in ((False, stop - start - moe_layers), (True, moe_layers)):
        if layers:
            if moe not in layer_times:
                layer_times[moe] = single_layer_times(config, plan, seq_len, cluster, software, moe)
            _add(times, layer_times[moe], layers)
    rows = tokens // plan.tp if plan.sp else tokens
    if first:  # embedding lookup (write T'·h) and its all-reduce (SP: reduce-scatter)
        comm = collective_time(rl.REDUCE_SCATTER if plan.sp else rl.ALL_REDUCE, e * tokens * config.hidden_size,
                                plan.tp, group_bandwidth(cluster, plan.tp), cluster)
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
            bandwidth = group_bandwidth(cluster, plan.tp)
            comm = 2 * collective_time(rl.ALL_GATHER, e * tokens * config.hidden_size, plan.tp, bandwidth, cluster)
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
        layer_times[moe] = single_layer_times(config, plan, seq_len, cluster, software, moe)
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
