"""Mixture of experts: the MoE layer's dispatchers (alltoall, allgather) vs the dense FFN of the same active size,
fwd+bwd per rank at ep = 1, 2, 4 on gloo CPU ranks, the bytes each moves per token, and a model of H100 at scale.

    python -m bench.moe [--iters 10] [--ep 1 2 4] [--job-steps 6] [--out PATH]    # JSON to a scratch path unless
                                                                                  # --out says so

Measured: every rank holds T tokens (its own: ep ranks are data-parallel ranks of the dense part) and runs, round-
robin in one loop, tp.moe.MoE with dispatcher "alltoall", the same layer with "allgather", and a dense SwiGLU FFN of
hidden k·F (the FLOPs a token's k experts cost); a step is timed between barriers (the slowest rank). Bytes per
token: what one fwd+bwd step sends off the rank over all collectives (a dispatch-mode counter on the c10d ops:
all-to-all, the rows to other ranks; all-gather and reduce-scatter, (p-1)/p of the gathered size; all-reduce,
2(p-1)/p), divided by the rank's tokens; model: 4·k·h·e·(ep-1)/ep for alltoall (dispatch and combine, each way;
uniform routing) and 4·(ep-1)·h·e + the routing for allgather (exact), e = 4 bytes here.

The job (`--job-steps N`, 0: skipped): `python -m models.train --model tiny-moe` on 4 gloo ranks (dp 4, fp32, seq
128, global batch 16 of micro-batches 4, alltoall) at each --ep with etp 1, its logged tokens_per_s over the steps
after the first (the median), and at dp 4 without experts split (ep 1) as the baseline.

Modelled (per GPU, one MoE layer fwd+bwd, bf16, T tokens per GPU, uniform routing): expert compute 18·T·k·h·F / C
(gate, up, down; fwd + 2× bwd), the same for the dense FFN of the same active size; alltoall moves 4·T·k·h·e·(ep-1)/ep
bytes per GPU, allgather 4·(ep-1)·T·h·e. Within a node (ep <= 8) at NVLink's 450 GB/s; beyond, the (ep-8)/ep of the
traffic bound for other nodes at the GPU's 50 GB/s InfiniBand NIC (400 Gb/s NDR), in parallel with the NVLink part;
α = 10 µs per collective (an assumption). No overlap of communication with compute (Megatron overlaps the
all-to-all with the shared expert or other micro-batches: the comm column is what there is to hide).
"""

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import tp
from models.presets import PUBLISHED_MODELS
from tp import testing
from tp.moe import DISPATCHERS

from .common import at_least, machine, print_table, round_robin_times, scratch_path, write_json
from .roofline import HARDWARE

HIDDEN, FFN, EXPERTS, TOPK, TOKENS = 256, 256, 8, 2, 256  # measured shape: small enough for a loaded 2-core box
LATENCY = 10e-6


def _expert_shape(fields: dict) -> tuple[int, int, int, int]:
    """hidden, expert FFN, experts, top-k of a named shape's fields."""
    ffn = fields.get("moe_ffn_hidden_size") or fields["ffn_hidden_size"]
    return fields["hidden_size"], ffn, fields["num_experts"], fields.get("moe_router_topk", 2)


# the published mixtures of experts of models/presets.py, and DeepSeek-V3's routed experts (not a named shape yet)
MODELS = {name: _expert_shape(fields) for name, fields in PUBLISHED_MODELS.items() if fields.get("num_experts")}
MODELS["deepseek-v3"] = (7168, 2048, 256, 8)


class _Bytes(TorchDispatchMode):
    """Bytes this rank sends off-rank per c10d op kind (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.sent = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op, kwargs = func._overloadpacket, kwargs or {}
        c10d = torch.ops.c10d
        if op in (c10d.alltoall_base_, c10d._allgather_base_, c10d._reduce_scatter_base_, c10d.allreduce_):
            self._count(op, args)
        return func(*args, **kwargs)

    def _count(self, op, args):
        c10d = torch.ops.c10d
        group = dist.ProcessGroup.unbox(args[1] if op is c10d.allreduce_ else args[2])  # (a ScriptObject here)
        p, me = group.size(), group.rank()
        if op is c10d.alltoall_base_:
            x, splits = args[1], args[4]
            row = x.element_size() * (x[0].numel() if x.shape[0] else 0)
            sent = row * (sum(splits) - splits[me]) if splits else x.nbytes * (p - 1) // p
        elif op is c10d.allreduce_:
            sent = sum(2 * (p - 1) * t.nbytes // p for t in args[0])
        else:
            big = args[0] if op is c10d._allgather_base_ else args[1]
            sent = (p - 1) * big.nbytes // p
        name = op.__name__.split(".")[-1].strip("_")
        self.sent[name] = self.sent.get(name, 0) + sent


def _dense(ffn):
    return torch.nn.Sequential(tp.ColumnParallelLinear(HIDDEN, 2 * ffn, bias=False, activation="swiglu"),
                               tp.RowParallelLinear(ffn, HIDDEN, bias=False))


def bench_rank(ep, iters, warmup):
    """On each of ep ranks: rank 0's median step times and every rank's bytes sent per token."""
    torch.set_num_threads(1)
    tp.init_mesh(ep=ep)
    torch.manual_seed(0)
    layers = {d: tp.moe.MoE(HIDDEN, FFN, EXPERTS, TOPK, dispatcher=d) for d in DISPATCHERS}
    layers["dense"] = _dense(TOPK * FFN)
    x = torch.randn(TOKENS, 1, HIDDEN, generator=torch.Generator().manual_seed(dist.get_rank()), requires_grad=True)
    g = torch.randn(TOKENS, 1, HIDDEN)

    def step(layer):
        layer(x).backward(g)
        layer.zero_grad(set_to_none=True)
        x.grad = None

    bytes_per_token = {}
    for name, layer in layers.items():
        with _Bytes() as counter:
            step(layer)
        bytes_per_token[name] = {k: v / TOKENS for k, v in counter.sent.items()}
    times = round_robin_times({n: (lambda m=m: step(m)) for n, m in layers.items()}, iters=iters, warmup=warmup,
                              sync=dist.barrier)
    return times, bytes_per_token


def model_bytes(ep, h, k, e, dispatcher):
    """Bytes per token one fwd+bwd step sends off a GPU (the dispatcher's sent_bytes): alltoall under uniform
    routing (the slots of (ep-1)/ep of the experts leave); allgather exactly (+ the routing: k fp32 weights each
    way, k int64 expert ids)."""
    return DISPATCHERS[dispatcher].sent_bytes(ep, h, k, e)


def model_row(name, ep, tokens, hw_name="h100-nvlink"):
    """Modelled per-GPU ms of one MoE layer fwd+bwd (module docstring)."""
    h, F, E, k = MODELS[name]
    hw = HARDWARE[hw_name]
    e = hw.element_size
    compute = 18 * tokens * k * h * F / hw.flops
    row = {"model": name, "h": h, "F": F, "E": E, "k": k, "ep": ep, "tokens": tokens, "compute_ms": 1e3 * compute}
    for dispatcher in DISPATCHERS:
        sent = model_bytes(ep, h, k, e, dispatcher) * tokens
        local = min(ep, hw.gpus_per_node)
        nvlink, ib = sent * (local - 1) / max(ep - 1, 1), sent * (ep - local) / max(ep - 1, 1)
        comm = max(nvlink / hw.link, ib / hw.inter_node) + 4 * LATENCY * (ep > 1)
        row[f"{dispatcher}_comm_ms"] = 1e3 * comm
        row[f"{dispatcher}_ms"] = 1e3 * (compute + comm)
        row[f"{dispatcher}_vs_dense"] = (compute + comm) / compute
    row["bytes_per_token"] = model_bytes(ep, h, k, e, "alltoall")
    return row


def parser():
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=at_least(1), default=10)
    p.add_argument("--warmup", type=at_least(0), default=3)
    p.add_argument("--ep", type=at_least(1), nargs="+", default=[1, 2, 4])
    p.add_argument("--job-steps", type=at_least(0), default=6, help="steps of the training job per ep (0: skip it)")
    p.add_argument("--out", default=scratch_path("moe.json"),
                   help="JSON output (the committed table is bench/results/moe.json: pass it to refresh it)")
    return p


MEASURED = [("ep", "ep", "{}"), ("layer", "layer", "{}"), ("ms", "fwd+bwd ms", "{:.2f}"),
            ("vs_dense", "vs dense", "{:.2f}"), ("bytes", "bytes/token", "{:.0f}"),
            ("model_bytes", "model bytes/token", "{:.0f}"), ("by_op", "by collective", "{}")]
MODELLED = [("model", "model", "{}"), ("ep", "ep", "{}"), ("tokens", "T/GPU", "{}"),
            ("compute_ms", "experts ms", "{:.3f}"), ("alltoall_comm_ms", "a2a comm ms", "{:.3f}"),
            ("alltoall_vs_dense", "a2a vs dense", "{:.2f}"), ("allgather_comm_ms", "allgather comm ms", "{:.3f}"),
            ("allgather_vs_dense", "allgather vs dense", "{:.2f}")]


JOB = ["--model", "tiny-moe", "--seq-len", "128", "--global-batch-size", "16", "--micro-batch-size", "4", "--tp",
       "1", "--pp", "1", "--dp", "4", "--etp", "1", "--no-sample"]
JOB_COLUMNS = [("ep", "ep", "{}"), ("edp", "edp", "{}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
               ("vs_ep1", "vs ep 1", "{:.2f}"), ("loss", "last loss", "{:.4f}")]


def _job_rank(flags, log):
    """models.train on this rank; rank 0 returns its log records."""
    import json

    from models.training.cli import parser as job_parser
    from models.training.cli import train

    train(job_parser().parse_args([*flags, "--log-jsonl", log]))
    if dist.get_rank() == 0:
        with open(log) as f:
            return [json.loads(line) for line in f]


def job_rows(eps, steps):
    """The training job's tokens/s at each ep (4 ranks, dp 4, etp 1): the median over the steps after the first."""
    import os
    import statistics
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ep in eps:
            flags = [*JOB, "--ep", str(ep), "--steps", str(steps)]
            records = testing.run(_job_rank, world_size=4, timeout=1800, flags=flags,
                                  log=os.path.join(tmp, f"ep{ep}.jsonl"))[0]
            rows.append({"ep": ep, "edp": 4 // ep, "loss": records[-1]["loss"],
                         "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records[1:])})
    for row in rows:
        row["vs_ep1"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def main(argv=None):
    args = parser().parse_args(argv)
    rows = []
    for ep in args.ep:
        out = testing.run(bench_rank, world_size=ep, timeout=1800, ep=ep, iters=args.iters, warmup=args.warmup)
        times = out[0][0]
        for layer in ("dense", *DISPATCHERS):
            sent = [per_rank[1][layer] for per_rank in out]
            total = sum(sum(s.values()) for s in sent) / ep
            by_op = {k: round(sum(s.get(k, 0) for s in sent) / ep) for k in sorted({k for s in sent for k in s})}
            rows.append({"ep": ep, "layer": layer, "ms": 1e3 * times[layer], "vs_dense": times[layer] / times["dense"],
                         "bytes": total, "by_op": " ".join(f"{k}:{v}" for k, v in by_op.items()) or "-",
                         "model_bytes": None if layer == "dense" else model_bytes(ep, HIDDEN, TOPK, 4, layer)})
    jobs = job_rows([ep for ep in args.ep if 4 % ep == 0], args.job_steps) if args.job_steps else []
    testing.shutdown()
    print(f"\nMoE layer fwd+bwd (h={HIDDEN}, F={FFN}, E={EXPERTS}, top-{TOPK}, {TOKENS} tokens per rank, fp32) vs the "
          f"dense SwiGLU FFN of hidden {TOPK * FFN}, median of {args.iters} steps, on {machine()}, gloo")
    measured = print_table(rows, MEASURED)
    modelled_rows = [model_row(name, ep, 8192) for name in MODELS for ep in (1, 8, 16, 64) if MODELS[name][2] % ep == 0]
    print(f"\nModelled on H100 (bf16, 8192 tokens per GPU, NVLink {HARDWARE['h100-nvlink'].link / 1e9:.0f} GB/s within "
          f"8 GPUs, IB {HARDWARE['h100-nvlink'].inter_node / 1e9:.0f} GB/s per GPU beyond, α = 10 µs)")
    modelled = print_table(modelled_rows, MODELLED)
    job_table = None
    if jobs:
        print(f"\nThe training job: {' '.join(JOB)} --ep N, {args.job_steps} steps (median tokens/s after the first)")
        job_table = print_table(jobs, JOB_COLUMNS)
    write_json(args.out, {"machine": machine(), "iters": args.iters, "shape": dict(
        hidden=HIDDEN, ffn=FFN, experts=EXPERTS, topk=TOPK, tokens=TOKENS), "rows": rows, "table": measured,
        "model_rows": modelled_rows, "model_table": modelled, "job_rows": jobs, "job_table": job_table})


if __name__ == "__main__":
    main()
