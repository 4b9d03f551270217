"""The step time's communication pieces per layer (bench.plan.step_time's docstring says what each moves): a group's
link (NVLink inside a node, else the NIC, at the profile's efficiency), one collective's time, the tensor-parallel
collectives and context parallelism's K/V traffic."""
from models.flops import attention_widths

from .. import roofline as rl
from . import memory
from .mla_time import mla_collectives


def group_bandwidth(cluster, group_span):
    """Per-device bandwidth of a group spanning `group_span` consecutive ranks: NVLink inside a node, else the NIC."""
    return rl.group_link(cluster.device, group_span)[0] * cluster.comm_efficiency


def collective_time(kind, size, ranks, bandwidth, cluster):
    """Seconds of one collective of `size` bytes over `ranks` ranks at `bandwidth`: its ring bytes, plus the
    profile's latency."""
    if ranks == 1:
        return 0.0
    return rl.Collective(kind, "fwd", size).wire_bytes(ranks) / bandwidth + cluster.device.latency


def tp_comm(config, plan, tokens, cluster, e):
    """(forward, backward) seconds of one layer's tensor-parallel collectives."""
    if plan.tp == 1:
        return 0.0, 0.0
    bandwidth = group_bandwidth(cluster, plan.tp)
    times = {"fwd": 0.0, "bwd": 0.0}
    mlp = rl.pair_collectives(tokens, config.hidden_size, plan.tp, e, sequence_parallel=plan.sp)
    attention = mla_collectives(config, plan, tokens, e) if config.multi_latent_attention else mlp
    for c in attention + mlp:
        times[c.phase] += collective_time(c.kind, c.size, plan.tp, bandwidth, cluster)
    return times["fwd"], times["bwd"]


def cp_kv_elements(config, plan, seq_len):
    """K and V elements of one rank's share per layer and micro-batch: 2·b·s/cp·kv·d (kv: this tp rank's heads; MLA:
    every head its k and v, both padded to the wider of the q·k and v head widths). Ring mode sends cp − 1 of them
    forward, as many again backward plus as many dK/dV (fp32)."""
    return 2 * plan.micro_batch_size * seq_len // plan.cp * memory.local_kv_heads(config, plan.tp) * \
        max(attention_widths(config))


def cp_comm(config, plan, seq_len, cluster, e, attention):
    """(forward, backward) exposed seconds of one layer's cp K/V traffic (bench.plan.step_time's docstring)."""
    if plan.cp == 1:
        return 0.0, 0.0
    block = cp_kv_elements(config, plan, seq_len)
    bandwidth = group_bandwidth(cluster, plan.tp * plan.cp)
    if config.cp_mode == "allgather":
        gather = collective_time(rl.ALL_GATHER, e * block * plan.cp, plan.cp, bandwidth, cluster)
        scatter = collective_time(rl.REDUCE_SCATTER, 4 * block * plan.cp, plan.cp, bandwidth, cluster)
        return gather, scatter
    step = e * block / bandwidth + cluster.device.latency  # one ring step's send (and receive)
    fwd = (plan.cp - 1) * step
    bwd = (plan.cp - 1) * (step + 4 * block / bandwidth)  # K/V again, fp32 dK/dV back
    return max(0.0, fwd - attention[0]), max(0.0, bwd - attention[1])
