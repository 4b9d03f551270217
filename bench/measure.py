"""What bench.intensity measures on this machine: achieved FLOP/s of the local GEMMs (torch, and kernels.linear's
compiled Triton kernels on CUDA), a square-GEMM peak, copy bandwidth, and the collectives' times for the layers'
message sizes (tp.collectives' all-reduce / all-gather / reduce-scatter) on spawned ranks or the torchrun ranks; and the
"cpu-measured" hardware profile built from them. CPU runs fp32 (its bf16 matmul is not representative), CUDA bf16.
"""
import os
import time

import numpy as np
import torch
import torch.distributed as dist

import kernels
from tp import collectives, testing

from . import roofline as rl
from .common import machine, median, time_call

# ---- local GEMMs, bandwidth ----------------------------------------------------------------------------------------


def _operands(gemm, device, dtype):
    """The layers' layouts: forward x @ Wᵀ, dgrad dy @ W, wgrad dyᵀ @ x (all stored contiguous)."""
    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)
    m, k, n = gemm.m, gemm.k, gemm.n
    if gemm.phase == "fwd":
        return randn(m, k), randn(n, k).t()
    if gemm.phase == "dgrad":
        return randn(m, k), randn(k, n)
    return randn(k, m).t(), randn(k, n)


def _kernels_call(gemm, a, b):
    """The same GEMM through kernels' compiled primitives (CUDA only)."""
    if gemm.phase == "fwd":
        return lambda: kernels.linear_forward(a, b.t())
    if gemm.phase == "dgrad":
        return lambda: kernels.linear_dgrad(a, b)
    return lambda: kernels.linear_wgrad(a.t(), b)


def measure_gemms(gemms, *, device, dtype, max_flops, min_seconds):
    """{(phase, m, k, n): {"torch": FLOP/s, "kernels": FLOP/s or None}} for each distinct GEMM up to max_flops."""
    cuda = device.type == "cuda"
    out = {}
    for g in gemms:
        key = (g.phase, g.m, g.k, g.n)
        if key in out or g.flops > max_flops:
            continue
        a, b = _operands(g, device, dtype)
        out[key] = {"torch": g.flops / time_call(lambda: a @ b, cuda=cuda, min_seconds=min_seconds), "kernels": None}
        if cuda:
            with kernels.use_backend("triton"):
                out[key]["kernels"] = g.flops / time_call(_kernels_call(g, a, b), cuda=True)
    return out


def measure_peak(size, device, dtype, min_seconds, tries=3):
    """The best of `tries` timings of a square GEMM: a peak, so a try slowed by other load does not set it."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    return max(2 * size**3 / time_call(lambda: a @ b, cuda=device.type == "cuda", min_seconds=min_seconds)
               for _ in range(tries))


def measure_bandwidth(nbytes, device, min_seconds):
    """Copy bandwidth: read + write bytes per second."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / time_call(lambda: dst.copy_(src), cuda=device.type == "cuda", min_seconds=min_seconds)


# ---- collectives ----------------------------------------------------------------------------------------------------


def time_collectives(sizes, group, dtype, min_seconds):
    """This rank's median seconds of each tp.collectives helper on `group` per full-tensor size (elements)."""
    p, device = dist.get_world_size(group), testing.device()
    cuda = device.type == "cuda"
    out = []
    for n in sizes:
        full = torch.zeros(n, device=device, dtype=dtype)  # zeros: repeated in-place sums stay finite
        shard = full[: n // p].clone()
        calls = {rl.ALL_REDUCE: lambda: collectives.all_reduce(full, group, inplace=True),
                 rl.ALL_GATHER: lambda: collectives.gather_first(shard, group),
                 rl.REDUCE_SCATTER: lambda: collectives.reduce_scatter_first(full, group)}
        for kind, call in calls.items():
            first = _timed(call, group, cuda)  # warm-up; sets the repetitions, agreed by all ranks (else a hang)
            reps = torch.tensor([min_seconds / max(first, 1e-9)], device=device)
            dist.all_reduce(reps, op=dist.ReduceOp.MIN, group=group)
            times = [_timed(call, group, cuda) for _ in range(int(min(max(reps.item(), 3), 200)))]
            out.append({"kind": kind, "elements": n, "seconds": median(times)})
    return out


def _timed(call, group, cuda):
    dist.barrier(group)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def spawned_collectives_rank(sizes, dtype, min_seconds):
    """Body of each spawned rank (tp.testing.run)."""
    return time_collectives(sizes, dist.group.WORLD, getattr(torch, dtype), min_seconds)


def _slowest(per_rank):
    """A collective ends when its slowest rank does: the max over ranks of each rank's median."""
    return [dict(r, seconds=max(rank[i]["seconds"] for rank in per_rank)) for i, r in enumerate(per_rank[0])]


def measure_collectives(degrees, sizes, dtype, min_seconds):
    """{tp: [{"kind", "elements", "seconds"}]}: on the torchrun ranks when launched so, else on spawned ranks."""
    results = {}
    if dist.is_initialized():
        world = dist.get_world_size()
        for p in [d for d in degrees if d <= world]:
            group = dist.new_group(list(range(p)))  # every rank takes part in creating it
            mine = time_collectives(sizes, group, dtype, min_seconds) if dist.get_rank() < p else None
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            results[p] = _slowest(gathered[:p])
        return results
    for p in degrees:
        results[p] = _slowest(testing.run(spawned_collectives_rank, world_size=p, timeout=1800, sizes=sizes,
                                          dtype=str(dtype).removeprefix("torch."), min_seconds=min_seconds))
    return results


def fit_link(collectives, element_size):
    """Fit t = latency + wire_bytes / W to every measured collective, in relative error (small messages count as
    much as large ones) -> (W bytes/s, latency s)."""
    points = [(rl.Collective(r["kind"], "fwd", r["elements"] * element_size).wire_bytes(p), r["seconds"])
              for p, rows in collectives.items() for r in rows]
    wire, seconds = map(np.array, zip(*points))
    slope, intercept = np.polyfit(wire, seconds, 1, w=1 / seconds) if len(set(wire)) > 1 else (0.0, 0.0)
    if slope <= 0:  # one size, or noise: bandwidth only
        return float(np.max(wire / seconds)), 0.0
    return 1 / float(slope), max(float(intercept), 0.0)


def measure(shapes, *, degrees, max_gflop, max_message_mb, peak_size, bandwidth_mb, min_seconds):
    """Everything measured for these shapes (lists of rl.Shape), or None on torchrun ranks other than 0 (they only
    join the collectives). GEMMs above max_gflop (None: no limit) and messages above max_message_mb are skipped."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    element_size = torch.finfo(dtype).bits // 8
    started = time.perf_counter()
    sizes = sorted({s.tokens * s.hidden for group in shapes for s in group})
    sizes = [n for n in sizes if n * element_size <= max_message_mb * 2**20 and all(n % p == 0 for p in degrees)]
    collectives = measure_collectives(degrees, sizes, dtype, min_seconds) if sizes else {}
    if dist.is_initialized():
        dist.barrier()  # every rank is done with collectives; only rank 0 goes on
        if dist.get_rank() != 0:
            return None
    gemms = [g for group in shapes for s in group for tp in rl.TP_DEGREES if s.shardable(tp)
             for g in rl.layer_gemms(s, tp)]
    link, latency = fit_link(collectives, element_size) if collectives else (None, None)
    return {
        "device": machine(), "dtype": str(dtype).removeprefix("torch."), "element_size": element_size,
        "kernels": "compiled Triton" if device.type == "cuda" else "skipped (no CUDA: the Triton interpreter is no "
                                                                   "performance proxy)",
        "peak_flops": measure_peak(peak_size, device, dtype, min_seconds),
        "bandwidth": measure_bandwidth(bandwidth_mb * 2**20, device, min_seconds),
        "gemms": measure_gemms(gemms, device=device, dtype=dtype,
                               max_flops=float("inf") if max_gflop is None else max_gflop * 1e9,
                               min_seconds=min_seconds),
        "collectives": collectives, "link": link, "latency": latency,
        "ranks_per_core": max(degrees, default=0) / (os.cpu_count() or 1) if device.type == "cpu" else None,
        "seconds": time.perf_counter() - started,
    }


def measured_profile(measured):
    if measured is None:
        raise ValueError("--hardware cpu-measured needs measurements: drop --no-measure")
    if measured["link"] is None:
        raise ValueError("--hardware cpu-measured needs measured collectives: --measure-tp and message sizes "
                         "within --max-message-mb")
    return rl.Hardware(
        "cpu-measured", flops=measured["peak_flops"], hbm=measured["bandwidth"], link=measured["link"],
        latency=measured["latency"], dtype=measured["dtype"], element_size=measured["element_size"],
        source=f"measured on {measured['device']}: square-GEMM peak, copy bandwidth, link bandwidth and latency "
               f"fitted to the timed collectives ({measured['dtype']})")
