"""What an MoE layer costs per micro-batch beyond the dense parts (bench.plan.step_time adds these): the experts'
grouped GEMM by shape, the token dispatch and combine over the ep group's links, the permutation's and the router's
memory traffic, the host's kernel launches after each host sync, and the busiest rank's share of the tokens.

Per MoE layer, micro-batch and rank (r = the tokens this rank routes, tokens/tp; k experts per token, h hidden,
e bytes per element, slots = routed_slots, L = E/ep local experts):

- Experts: one grouped GEMM with L groups of slots/L rows (bench.plan.gemm: tiles and waves over all groups), times
  the imbalance below; the router GEMM [r, h]·[h, E].
- Dispatch and combine (all-to-all): each moves the rank's slots·h elements, (ep − 1)/ep of them to other ranks,
  forward and again backward. The ep group's ranks are etp apart (etp innermost, Megatron's expert layout), so a node
  of G GPUs holds min(ep, G/etp) of them: of the ep − 1 peers, that many less one are reached over NVLink and the rest
  over the NIC, both at once: time = max(in-node bytes / NVLink, off-node bytes / NIC). "allgather": every token of
  the ep·etp ranks gathered and reduce-scattered back, (ep·etp − 1)·r·h each way, a ring whose slowest hop sets the
  rate (the NIC once the group spans nodes). "deepep" (DeepSeek's DeepEP): a token crosses the NIC once per
  destination node, not once per expert: with k experts drawn uniformly over n nodes, (n − 1)·(1 − (1 − 1/n)^k) copies
  per token, forwarded over NVLink inside the destination node (so every off-node slot also crosses NVLink there), at
  the fractions DeepEP's README measures on H800 (NVLink 153 of ~160 GB/s, RDMA 43 of ~50 GB/s: the lowest of its
  normal-kernel rows). Each dispatcher's volume at etp = 1 within a node equals tp.moe's TokenDispatcher.sent_bytes
  (tests). Exposed, unless the software overlaps it (Software.ep_overlap: Megatron-Core's --overlap-moe-expert-
  parallel-comm, DualPipe), then only what exceeds the layer's other compute.
- Permutation (memory-bound, at HBM, backward twice forward as the other element-wise work): gathering the k copies
  of each routed token and scattering the outputs back weighted (read and write r·k·h each, read r·k weights, write
  r·h), and with L > 1 and ep > 1 sorting the received chunks by local expert and back (read and write slots·h each
  way).
- Router: the fp32 scores over E per routed token: upcast, softmax (or sigmoid), top-k, the load-balancing
  statistics — about five fp32 passes of r·E forward.
- Host: dropless dispatch reads the per-expert counts on the host (one device-to-host sync per MoE layer forward:
  tp.moe's count table, Megatron's tokens_per_expert), so the host cannot run ahead of that layer: the kernels it
  launches after the sync (Software.moe_launches: a fixed number plus a number per local expert, e.g. Transformer
  Engine's GroupedLinear launching one GEMM per expert) are exposed where their launch time exceeds the GPU work
  they launch (the experts onwards). Launch time per kernel: Cluster.launch_overhead.
- Imbalance: the busiest of the ep ranks sets the pace. With routing as balanced as a load-balancing loss makes it
  (each slot's rank uniform), a rank's load is binomial around the mean μ slots and the busiest of ep ranks is
  μ + σ·√(2 ln ep) (σ² = μ(1 − 1/ep): the Gaussian bound on the maximum of ep draws): a factor
  1 + √(2 ln ep·(1 − 1/ep)/μ) on the expert GEMMs and the dispatch. Routers that prefer experts within a batch
  add to it (not priced: no measured distribution here).
"""
import math

from tp.moe import DISPATCHERS

from .. import roofline as rl
from . import gemm

DEEPEP = "deepep"
CHOICES = (*DISPATCHERS, DEEPEP)  # dispatcher= choices: tp.moe's dispatchers, and DeepEP priced
DEEPEP_NVLINK = 153 / 160  # DeepEP README, normal kernels, intranode dispatch, EP 8: 153 GB/s of ~160 (H800)
DEEPEP_RDMA = 43 / 50  # DeepEP README, internode dispatch/combine, EP 16: 43 GB/s of ~50 (CX7 400 Gb/s)
ROUTER_PASSES = 5  # fp32 passes over [r, E] forward: upcast write, softmax read+write, top-k read, statistics read


def routed_slots(config, plan, tokens):
    """Token-expert slots one rank's experts process per MoE layer and micro-batch: the micro-batch's b·s·k slots
    over its tp·cp ranks, each processed by the etp ranks holding slices of its expert: tokens·k·etp/tp (dropless:
    the balanced mean; with a capacity factor, that many times it, the padded slots)."""
    return int(tokens * config.moe_router_topk * plan.expert_tp / plan.tp * (config.moe_capacity_factor or 1.0))


def imbalance(config, plan, tokens):
    """The busiest ep rank's slots over the mean (module docstring); 1 at ep = 1 or with a capacity factor (the
    padded slots are the same on every rank)."""
    mean = routed_slots(config, plan, tokens)
    if plan.ep == 1 or config.moe_capacity_factor or mean == 0:
        return 1.0
    return 1 + math.sqrt(2 * math.log(plan.ep) * (1 - 1 / plan.ep) / mean)


def ep_ranks_per_node(plan, gpus_per_node):
    """(ep ranks of the group in one node, nodes the group spans): its ranks are etp apart."""
    if not gpus_per_node or plan.ep * plan.expert_tp <= gpus_per_node:
        return plan.ep, 1
    local = min(plan.ep, max(1, gpus_per_node // plan.expert_tp))
    return local, math.ceil(plan.ep / local)


def a2a_bytes(config, plan, tokens, gpus_per_node, e, dispatcher="alltoall"):
    """(bytes over NVLink, bytes over the NIC) one rank sends in one dispatch (or one combine) of one MoE layer and
    micro-batch (module docstring)."""
    if plan.ep == 1:
        return 0.0, 0.0
    h, k = config.hidden_size, config.moe_router_topk
    local, nodes = ep_ranks_per_node(plan, gpus_per_node)
    if dispatcher == "allgather":  # a ring over the ep·etp ranks: every hop carries (ep·etp − 1)·r·h
        size = e * (plan.ep * plan.expert_tp - 1) * (tokens // plan.tp) * h
        return (size, 0.0) if nodes == 1 else (0.0, size)
    slot = e * h * routed_slots(config, plan, tokens) / k  # one copy of each routed token
    in_node, off_node = k * (local - 1) / plan.ep, k * (plan.ep - local) / plan.ep  # copies per token
    if dispatcher == DEEPEP and nodes > 1:  # once per destination node, forwarded inside it over NVLink
        return slot * (in_node + off_node), slot * (nodes - 1) * (1 - (1 - 1 / nodes) ** k)
    return slot * in_node, slot * off_node


def a2a_time(config, plan, tokens, cluster, e, dispatcher="alltoall"):
    """Seconds of one MoE layer's dispatch + combine per micro-batch forward (backward: as much), the busiest rank's
    share (imbalance) over NVLink and the NIC at once."""
    nvlink_bytes, nic_bytes = a2a_bytes(config, plan, tokens, cluster.device.gpus_per_node, e, dispatcher)
    if not nvlink_bytes + nic_bytes:
        return 0.0
    deepep = dispatcher == DEEPEP
    nvlink = cluster.device.link * (DEEPEP_NVLINK if deepep else cluster.comm_efficiency)
    nic = cluster.device.inter_node * (DEEPEP_RDMA if deepep else cluster.comm_efficiency)
    one = max(nvlink_bytes / nvlink, nic_bytes / nic) * imbalance(config, plan, tokens) + cluster.device.latency
    return 2 * one


def expert_gemms(config, plan, tokens):
    """([bench.roofline.Gemm] of one local expert's share, local experts): the grouped GEMM's groups."""
    local = config.num_experts // plan.ep
    rows = math.ceil(routed_slots(config, plan, tokens) * imbalance(config, plan, tokens) / local)
    glu = 2 if config.activation == "swiglu" else 1
    f = config.moe_ffn_hidden_size // plan.expert_tp
    return rl.linear_gemms("experts_fc1", rows, config.hidden_size, glu * f) + \
        rl.linear_gemms("experts_fc2", rows, f, config.hidden_size), local


def elementwise_bytes(config, plan, tokens, e):
    """Forward bytes through HBM of the permutation and the router's fp32 scores (module docstring)."""
    routed, k, h = tokens // plan.tp, config.moe_router_topk, config.hidden_size
    copies = routed * k
    permute = 2 * e * copies * h + 4 * copies + e * routed * h + 2 * e * copies * h  # gather; scatter back weighted
    if config.num_experts // plan.ep > 1 and plan.ep > 1:  # received chunks sorted by local expert, and back
        permute += 2 * 2 * e * routed_slots(config, plan, tokens) * h
    return permute + ROUTER_PASSES * 4 * routed * config.num_experts


def host_time(config, plan, cluster, software, gpu_after_sync):
    """(forward, backward) seconds the host's launches expose per MoE layer and micro-batch: after the forward's
    host sync, launches beyond the GPU work they start; the backward's launches (twice the forward's) run ahead
    unless they exceed the backward's GPU work."""
    fixed, per_expert = software.moe_launches
    launches = fixed + per_expert * config.num_experts // plan.ep
    host = launches * cluster.launch_overhead
    return max(0.0, host - gpu_after_sync[0]), max(0.0, 2 * host - gpu_after_sync[1])


def expert_time(config, plan, tokens, cluster, e):
    """{phase: seconds} of the experts' grouped GEMMs (fwd, dgrad, wgrad)."""
    gemms, groups = expert_gemms(config, plan, tokens)
    out = {"fwd": 0.0, "dgrad": 0.0, "wgrad": 0.0}
    for g in gemms:
        out[g.phase] += gemm.gemm_time(g, cluster, e, groups)
    return out


def layer_costs(config, plan, tokens, cluster, software, e, other):
    """{part: forward or backward seconds} of an MoE layer's experts, dispatch, permutation and host launches per
    micro-batch (bench.plan.moe_time); `other`: (forward, backward) seconds of the rest of the layer, behind which
    software that overlaps the dispatch hides it."""
    experts = expert_time(config, plan, tokens, cluster, e)
    a2a = a2a_time(config, plan, tokens, cluster, e, plan.dispatcher)
    exposed = (max(0.0, a2a - other[0]), max(0.0, a2a - other[1])) if software.ep_overlap else (a2a, a2a)
    permute = elementwise_bytes(config, plan, tokens, e) / cluster.device.hbm
    after_sync = (experts["fwd"] + permute / 2, experts["dgrad"] + experts["wgrad"] + permute)
    host = host_time(config, plan, cluster, software, after_sync)
    return {"experts": experts, "a2a": exposed, "permute": permute, "host": host}


def dense_gemms(config, plan, tokens):
    """An MoE layer's GEMMs beside the experts': the router (whole on every rank, over the tokens it routes) and the
    shared expert, a dense MLP split over tp."""
    h, tp = config.hidden_size, plan.tp
    glu = 2 if config.activation == "swiglu" else 1
    gemms = rl.linear_gemms("router", tokens // tp if plan.sp else tokens, h, config.num_experts)
    shared = config.moe_shared_expert_size
    if shared:
        gemms += rl.linear_gemms("shared_fc1", tokens, h, glu * shared // tp) + \
            rl.linear_gemms("shared_fc2", tokens, shared // tp, h)
    return gemms


def activation_bytes(config, plan, tokens, e):
    """Forward bytes of the experts' activation per micro-batch (what recomputing "moe_act" repeats): read 2F
    (SwiGLU; F otherwise), write F, per routed slot."""
    glu = 2 if config.activation == "swiglu" else 1
    return e * routed_slots(config, plan, tokens) * (glu + 1) * config.moe_ffn_hidden_size // plan.expert_tp
