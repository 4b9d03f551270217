"""The model behind `python -m bench.intensity`: per-rank GEMMs of a tensor-parallel transformer layer (FLOPs, bytes,
arithmetic intensity), the bytes its collectives move, hardware profiles, roofline times, and the TP recommendation.

GEMMs (the scaling book, "How to Scale Your Model", "All About Rooflines"). [M, K] x [K, N] does 2·M·K·N FLOPs and
touches at least e·(MK + KN + MN) bytes (e bytes per element: 2 for bf16), so its arithmetic intensity is
2MKN / (e·(MK + KN + MN)) FLOP/byte. Roofline time: max(FLOPs / C, bytes / HBM); the GEMM is compute-bound above the
ridge C / HBM. A linear layer y[T, N] = x[T, K]·Wᵀ runs forward [T, K] x [K, N], dgrad [T, N] x [N, K] and wgrad
[N, T] x [T, K]; column-parallel divides N by TP, row-parallel divides K.

Collectives (ring algorithms; n = bytes of the full, unsharded tensor; p ranks): all-reduce moves 2(p-1)/p·n per
rank, all-gather (n = its output) and reduce-scatter (n = its input) (p-1)/p·n each. One column->row pair (the MLP,
or attention's QKV -> output projection) over T tokens of hidden D, n = e·T·D, as tp.ColumnParallelLinear ->
tp.RowParallelLinear run it (tests/test_intensity.py counts their messages):
  without sequence parallelism: forward 1 all-reduce (row output), backward 1 all-reduce (column input grad);
  with it: forward all-gather (column input) + reduce-scatter (row output); backward all-gather (row output grad)
  + all-gather (the column layer re-gathers its input for wgrad) + reduce-scatter (column input grad).
A transformer layer is two pairs. Not modelled: the attention core (per-head, local), head counts (a real model also
needs TP to divide its heads) and GQA, SP's all-reduce of sequence-parallel parameter grads (norms, row biases: O(D)
bytes), and latency on the GPU profiles (bandwidth only).
The node boundary: a TP group of Y adjacent ranks stays inside a node while Y <= gpus_per_node (8 on the GPU
profiles) and its collectives run at W, NVLink; a larger group crosses nodes and runs at each device's NIC (IB,
inter_node), as bench.plan models every group (h100-ib instead takes a whole-node group's aggregate egress).

The recommendation is the scaling book's TP model ("How to Scale Your Model", "How to Think About GPUs", Tensor
Parallelism), MLP forward on Y ranks: T_math = roofline time of the local forward GEMMs (= 4·T·D·F/(Y·C) for a
two-matrix MLP once they are compute-bound; SwiGLU's gate, up and down: 6·T·D·F/(Y·C)); T_comm = an all-gather and a
reduce-scatter of the activations, each counted as moving the whole e·T·D bytes at W (the ring's (Y-1)/Y dropped, so
an upper bound by Y/(Y-1) on the ring figures the tables also give): 2·e·T·D/W = 4·T·D/W in bf16. T_comm <= T_math
<=> F/Y >= C/W for a compute-bound bf16 two-matrix MLP; C/W = 989e12/450e9 ≈ 2200 on H100 NVLink, so F = 14336 at
Y = 8 (F/Y = 1792) is communication-bound and F = 28672 (3584) is not.
max_tp_overlapped: the largest Y (every smaller degree included) with T_comm <= T_math: with compute/communication
overlap the collectives hide entirely and the MLP runs at its compute roofline (step = max(T_math, T_comm)).
max_tp_serial: the largest Y with T_comm <= T_math for the serialised step T_math + T_comm, i.e. communication is
at most half of it. It is the same inequality, so the same degree: overlap does not move the limit, it removes the
price paid at it (efficiency T_math / step: 1 overlapped, >= 1/2 serialised; tp_model reports both per degree).
"""
from dataclasses import dataclass

TP_DEGREES = (1, 2, 4, 8, 16, 32, 64)
ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all_reduce", "all_gather", "reduce_scatter"


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # peak dense matmul FLOP/s per device, in `dtype`
    hbm: float  # memory bandwidth, bytes/s
    link: float  # collective bandwidth W per device and direction, bytes/s
    source: str
    dtype: str = "bf16"
    element_size: int = 2
    latency: float = 0.0  # seconds per collective
    gpus_per_node: int = 0  # the node boundary: groups of more ranks cross it (0: not modelled, one link)
    inter_node: float = 0.0  # bandwidth per device and direction across nodes (its NIC), bytes/s

    @property
    def ridge(self):
        """FLOP/byte above which a GEMM is compute-bound."""
        return self.flops / self.hbm

    @property
    def flops_per_link_byte(self):
        """C/W: the scaling book's threshold for F/TP."""
        return self.flops / self.link


HARDWARE = {
    "h100-nvlink": Hardware(
        "h100-nvlink", flops=989e12, hbm=3.35e12, link=450e9, gpus_per_node=8, inter_node=50e9,
        source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity = 989 "
               "dense; GPU memory bandwidth 3.35 TB/s; NVLink 900 GB/s counts both directions (18 NVLink-4 links), "
               "450 GB/s per direction = the scaling book's H100 'GPU egress bandwidth' 450e9; across nodes (a TP "
               "group beyond the 8 GPUs of a DGX H100) each GPU's ConnectX-7 NDR 400 Gb/s = 50 GB/s, as bench.plan's "
               "h100-sxm"),
    "h100-ib": Hardware(
        "h100-ib", flops=989e12, hbm=3.35e12, link=400e9,
        source="H100 SXM as h100-nvlink; a TP group spanning whole 8-GPU nodes over InfiniBand: 8 ConnectX-7 NDR "
               "NICs per node at 400 Gb/s = 50 GB/s each, 400 GB/s node egress = the scaling book's H100 'node egress "
               "bandwidth' 400e9 (C/W ≈ 2475 'beyond a node', its chapter 'How to Think About GPUs'). One GPU per node "
               "would get 50 GB/s"),
    "a100-nvlink": Hardware(
        "a100-nvlink", flops=312e12, hbm=2.039e12, link=300e9, gpus_per_node=8, inter_node=25e9,
        source="NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: BF16 Tensor Core 312 TFLOPS (624 with sparsity); "
               "GPU memory bandwidth 2,039 GB/s; NVLink 600 GB/s counts both directions (12 NVLink-3 links), 300 GB/s "
               "per direction; across nodes (beyond the 8 GPUs of a DGX A100) each GPU's HDR 200 Gb/s = 25 GB/s, as "
               "bench.plan's a100-80g"),
}


@dataclass(frozen=True)
class Shape:
    """One transformer layer's sizes: hidden D, FFN F, tokens T per micro-batch; mlp "gelu" (fc1 D->F) or "swiglu"
    (fused gate/up fc1 D->2F)."""
    hidden: int
    ffn: int
    tokens: int
    mlp: str = "gelu"

    def __post_init__(self):
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"mlp must be 'gelu' or 'swiglu', got {self.mlp!r}")
        for name in ("hidden", "ffn", "tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def shardable(self, tp):
        """Whether every sharded dim (F, D for attention) splits evenly across tp ranks."""
        return self.ffn % tp == 0 and self.hidden % tp == 0


def default_ffn(hidden, mlp):
    """4·D for GELU; SwiGLU 8/3·D rounded up to a multiple of 256 (Llama's rule: 4096 -> 11008)."""
    return 4 * hidden if mlp == "gelu" else -(-8 * hidden // 3 // 256) * 256


@dataclass(frozen=True)
class Gemm:
    layer: str
    phase: str  # "fwd" | "dgrad" | "wgrad"
    m: int
    k: int
    n: int

    @property
    def flops(self):
        return 2 * self.m * self.k * self.n

    def bytes(self, element_size):
        """Minimal traffic: read both operands, write the result once."""
        return element_size * (self.m * self.k + self.k * self.n + self.m * self.n)

    def intensity(self, element_size):
        return self.flops / self.bytes(element_size)

    def time(self, hw):
        """Roofline time on hw."""
        return max(self.flops / hw.flops, self.bytes(hw.element_size) / hw.hbm)


def linear_gemms(layer, tokens, k, n):
    """Forward, dgrad and wgrad of y[T, n] = x[T, k]·W[n, k]ᵀ on one rank."""
    return [Gemm(layer, "fwd", tokens, k, n), Gemm(layer, "dgrad", tokens, n, k), Gemm(layer, "wgrad", n, tokens, k)]


def mlp_gemms(shape, tp):
    """fc1 column-parallel [D -> F/tp] (SwiGLU: fused [D -> 2F/tp]), fc2 row-parallel [F/tp -> D]."""
    fused = 2 if shape.mlp == "swiglu" else 1
    local_ffn = shape.ffn // tp
    return linear_gemms("fc1", shape.tokens, shape.hidden, fused * local_ffn) + \
        linear_gemms("fc2", shape.tokens, local_ffn, shape.hidden)


def attention_gemms(shape, tp):
    """QKV column-parallel [D -> 3D/tp] (multi-head, no GQA), output projection row-parallel [D/tp -> D]."""
    return linear_gemms("qkv", shape.tokens, shape.hidden, 3 * shape.hidden // tp) + \
        linear_gemms("proj", shape.tokens, shape.hidden // tp, shape.hidden)


def layer_gemms(shape, tp):
    """Every per-rank GEMM of one transformer layer's projections: MLP, then attention."""
    return mlp_gemms(shape, tp) + attention_gemms(shape, tp)


@dataclass(frozen=True)
class Collective:
    kind: str
    phase: str  # "fwd" | "bwd"
    size: int  # bytes of the full tensor: the all-reduced one, the all-gather's output, the reduce-scatter's input

    def wire_bytes(self, tp):
        """Bytes each rank sends (and receives) in a ring over tp ranks."""
        return (2 if self.kind == ALL_REDUCE else 1) * (tp - 1) / tp * self.size


def pair_collectives(tokens, hidden, tp, element_size, *, sequence_parallel):
    """The collectives of one column->row pair, forward and backward (see the module docstring)."""
    if tp == 1:
        return []
    n = element_size * tokens * hidden
    if not sequence_parallel:
        return [Collective(ALL_REDUCE, "fwd", n), Collective(ALL_REDUCE, "bwd", n)]
    return [Collective(ALL_GATHER, "fwd", n), Collective(REDUCE_SCATTER, "fwd", n),
            Collective(ALL_GATHER, "bwd", n), Collective(ALL_GATHER, "bwd", n), Collective(REDUCE_SCATTER, "bwd", n)]


def group_link(hw, ranks):
    """(bytes/s, name) of a collective over `ranks` adjacent ranks (a TP group, the rank order keeping it inside a
    node while it fits): the node's link (NVLink) inside a node, each device's NIC (IB) once the group crosses the
    node boundary; bench.plan prices its groups with it too (bench/plan/step_time.py, on its Cluster's device)."""
    if hw.gpus_per_node and ranks > hw.gpus_per_node:
        return hw.inter_node, "IB"
    return hw.link, "NVLink" if hw.gpus_per_node else "link"


def comm_time(collectives, tp, hw):
    return sum(c.wire_bytes(tp) / group_link(hw, tp)[0] + hw.latency for c in collectives)


def mlp_forward_times(shape, tp, hw):
    """(T_math, T_comm) of one MLP forward under the scaling book's model (module docstring)."""
    t_math = sum(g.time(hw) for g in mlp_gemms(shape, tp) if g.phase == "fwd")
    t_comm = 0.0 if tp == 1 else 2 * (hw.element_size * shape.tokens * shape.hidden / group_link(hw, tp)[0]
                                      + hw.latency)
    return t_math, t_comm


def max_tp(shape, hw, degrees=TP_DEGREES):
    """Largest degree (with every smaller one) whose MLP-forward communication fits under its compute; degrees that
    do not divide the sizes are skipped."""
    best = None
    for tp in sorted(d for d in degrees if shape.shardable(d)):
        t_math, t_comm = mlp_forward_times(shape, tp, hw)
        if t_comm > t_math:
            break
        best = tp
    return best


def recommendation(shape, hw, degrees=TP_DEGREES):
    """max_tp_overlapped and max_tp_serial (equal by construction: module docstring) with the numbers behind them."""
    limit = max_tp(shape, hw, degrees)
    matrices = 3 if shape.mlp == "swiglu" else 2
    return {
        "hidden": shape.hidden, "ffn": shape.ffn, "mlp": shape.mlp, "tokens": shape.tokens,
        "max_tp_overlapped": limit, "max_tp_serial": limit,
        # compute-bound GEMMs: 2·matrices·T·D·F/(Y·C) >= 2·e·T·D/W  <=>  F/Y >= e/matrices · C/W (bf16 MLP: C/W)
        "f_over_tp_threshold": hw.element_size / matrices * hw.flops_per_link_byte,
        "flops_per_link_byte": hw.flops_per_link_byte,
    }


def tp_model(shape, tp, hw):
    """One row per (shape, TP degree): modelled compute and communication of the MLP and attention projections."""
    e = hw.element_size
    mlp, attn = mlp_gemms(shape, tp), attention_gemms(shape, tp)
    plain = pair_collectives(shape.tokens, shape.hidden, tp, e, sequence_parallel=False)
    sp = pair_collectives(shape.tokens, shape.hidden, tp, e, sequence_parallel=True)

    def phase(gemms, fwd):
        return [g for g in gemms if (g.phase == "fwd") == fwd]

    t_math, t_comm = mlp_forward_times(shape, tp, hw)
    return {
        "hidden": shape.hidden, "ffn": shape.ffn, "mlp": shape.mlp, "tokens": shape.tokens, "tp": tp,
        "link": "-" if tp == 1 else group_link(hw, tp)[1], "ffn_shard": shape.ffn // tp,
        "mlp_min_intensity": min(g.intensity(e) for g in mlp),
        "attn_min_intensity": min(g.intensity(e) for g in attn),
        "ridge": hw.ridge,
        "mlp_fwd_flops": sum(g.flops for g in phase(mlp, True)),
        "mlp_fwd_compute_s": t_math, "mlp_bwd_compute_s": sum(g.time(hw) for g in phase(mlp, False)),
        "attn_fwd_compute_s": sum(g.time(hw) for g in phase(attn, True)),
        "attn_bwd_compute_s": sum(g.time(hw) for g in phase(attn, False)),
        # per pair (MLP or attention; SP moves the same forward); a layer moves twice this
        "pair_fwd_wire_bytes": sum(c.wire_bytes(tp) for c in plain if c.phase == "fwd"),
        "pair_bwd_wire_bytes": sum(c.wire_bytes(tp) for c in plain if c.phase == "bwd"),
        "pair_bwd_wire_bytes_sp": sum(c.wire_bytes(tp) for c in sp if c.phase == "bwd"),
        "pair_fwd_comm_ring_s": comm_time([c for c in plain if c.phase == "fwd"], tp, hw),
        "mlp_fwd_comm_s": t_comm,
        "comm_over_compute": t_comm / t_math,
        "communication_bound": t_comm > t_math,
        "efficiency_overlapped": t_math / max(t_math, t_comm),
        "efficiency_serial": t_math / (t_math + t_comm),
    }
