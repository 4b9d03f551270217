"""Column -> GELU -> Row MLP, fwd+bwd wall time per step at TP = 1, 2, 4 on gloo CPU ranks, side by side with torch
DTensor TP (parallelize_module + ColwiseParallel/RowwiseParallel) and plain nn.Linear at TP=1.

    python -m bench.mlp [--iters 40] [--out PATH]       # JSON to a scratch path unless --out says otherwise

Each rank runs the three models round-robin in one loop (so machine noise hits all alike); a step is timed on rank 0
between barriers. Ratios < 1 mean ours is faster. Targets: ours/DTensor <= 0.5; ours/plain (TP=1) <= 1.03.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

import tp
from tp import testing

from .common import machine, print_table, round_robin_times, write_json
from .common import parser as common_parser

SHAPES = [(128, 512, 16), (512, 2048, 64), (1024, 4096, 256)]  # hidden, ffn, tokens (first: overhead-bound)


class OursMLP(nn.Module):
    def __init__(self, dense):
        super().__init__()
        self.fc1 = tp.ColumnParallelLinear.from_linear(dense[0], activation="gelu")
        self.fc2 = tp.RowParallelLinear.from_linear(dense[2])

    def forward(self, x):
        return self.fc2(self.fc1(x))


def _dense(hidden, ffn):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))


def _dtensor(dense, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _dense(dense[0].in_features, dense[0].out_features)
    return parallelize_module(model, mesh.device_mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _step(model, x, g):
    y = model(x)
    y.backward(g)
    if isinstance(y, AsyncCollectiveTensor):  # DTensor's output all-reduce: complete its wait within the step
        y.wait()


def bench_rank(hidden, ffn, tokens, iters, warmup):
    """On every rank of a tp group: per-step times (rank 0's) of each implementation."""
    torch.set_num_threads(1)
    mesh = tp.init_mesh(tp=dist.get_world_size())
    dense = _dense(hidden, ffn)
    models = {"ours": OursMLP(dense), "dtensor": _dtensor(dense, mesh)}
    if mesh.tp_size == 1:
        models["plain"] = dense
    x = torch.randn(tokens, 1, hidden, requires_grad=True)  # [s, b, h]
    g = torch.randn(tokens, 1, hidden)

    def step(model):
        _step(model, x, g)
        model.zero_grad(set_to_none=True)
        x.grad = None

    return round_robin_times({name: (lambda m=model: step(m)) for name, model in models.items()}, iters=iters,
                             warmup=warmup, sync=dist.barrier)


def parser():
    return common_parser(__doc__, "mlp", iters=40, warmup=5)


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    ffns = [ffn for _, ffn, _ in SHAPES]
    for tp_size in args.tp:
        if any(ffn % tp_size for ffn in ffns):  # (fc1's output and fc2's input are split)
            p.error(f"--tp {tp_size} must divide the MLP's ffn sizes {', '.join(map(str, ffns))}")
    rows = []
    for hidden, ffn, tokens in SHAPES:
        for tp_size in args.tp:
            t = testing.run(bench_rank, world_size=tp_size, timeout=1800, hidden=hidden, ffn=ffn, tokens=tokens,
                            iters=args.iters, warmup=args.warmup)[0]
            rows.append({
                "hidden": hidden, "ffn": ffn, "tokens": tokens, "tp": tp_size,
                "ours_ms": 1e3 * t["ours"], "dtensor_ms": 1e3 * t["dtensor"],
                "plain_ms": 1e3 * t.get("plain", 0) or None,
                "ours_vs_dtensor": t["ours"] / t["dtensor"],
                "ours_vs_plain": t["ours"] / t["plain"] if "plain" in t else None,
            })
    testing.shutdown()
    print(f"\nColumn->GELU->Row MLP fwd+bwd, median of {args.iters} steps, on {machine()}, gloo")
    table = print_table(rows, [
        ("hidden", "hidden", "{}"), ("ffn", "ffn", "{}"), ("tokens", "tokens", "{}"), ("tp", "TP", "{}"),
        ("ours_ms", "ours ms", "{:.3f}"), ("dtensor_ms", "DTensor ms", "{:.3f}"),
        ("plain_ms", "nn.Linear ms", "{:.3f}"),
        ("ours_vs_dtensor", "ours/DTensor", "{:.2f}"), ("ours_vs_plain", "ours/nn.Linear", "{:.3f}"),
    ])
    write_json(args.out, {"machine": machine(), "iters": args.iters, "rows": rows, "table": table})


if __name__ == "__main__":
    main()
