"""The planner against bench.mfu's measured rows: its prediction of one device's training step (tp = cp = pp = dp = 1,
the measured shape, sequence, micro-batch size, micro-batches and recompute) on the profile of the device that ran it
(h200, h100-sxm, a100-80g by the device's name; cpu-measured on a CPU), beside the measured step time.

    python -m bench.plan --check-mfu mfu.json

On a CPU the cpu-measured profile is one rank of one thread (bench.train's runs); bench.mfu runs one process on
torch's threads, so its compute is the profile's per-core rate times the threads it used (up to the cores: the
profile's peak was timed with every core). Nothing is fitted here: a ratio far from 1 is the model's error.
"""
import functools
from dataclasses import replace

from models.config import GPTConfig

from ..common import print_table
from .hardware import CLUSTERS, Cluster, cpu_cluster
from .search import evaluate
from .software import OURS, OURS_CPU, Software
from .step_time import Plan
from .validation import cpu_op_overhead

GPU_PROFILES = {"H200": "h200", "H100": "h100-sxm", "A100": "a100-80g"}  # in the device's name -> CLUSTERS' key
TABLE = [("row", "row", "{}"), ("recompute", "recompute", "{}"), ("batch", "batch", "{}"),
         ("measured_step_s", "measured s", "{:.4g}"), ("predicted_step_s", "predicted s", "{:.4g}"),
         ("ratio", "predicted/measured", "{:.3g}"), ("profile", "profile", "{}")]


@functools.cache
def _cpu_profile() -> Cluster:
    return cpu_cluster(op_overhead=cpu_op_overhead())


def profile_for(device: str, *, threads: int = 1, dtype: str = "bf16") -> tuple[Cluster, Software]:
    """The (node profile, software) the planner prices a one-device run on `device` with: a GPU by its name, a CPU
    (a name starting "CPU") as cpu-measured with `threads` cores' compute; ValueError for any other device."""
    name = next((profile for key, profile in GPU_PROFILES.items() if key in device), None)
    if name is not None:
        return CLUSTERS[name], replace(OURS, precision=dtype)
    if device.startswith("CPU"):
        cluster = _cpu_profile()
        used = max(1, min(threads, cluster.cores))
        return replace(cluster, device=replace(cluster.device, flops=cluster.device.flops * used)), \
            replace(OURS_CPU, precision=dtype)
    raise ValueError(f"device {device!r}: no planner profile (a GPU named with one of {', '.join(GPU_PROFILES)}, "
                     "or a CPU)")


def predict_step(config: GPTConfig, *, batch: int, micro_batches: int, seq_len: int, recompute: str,
                 cluster: Cluster, software: Software) -> dict:
    """The planner's one-device step (Plan tp = cp = pp = dp = 1): its seconds, tokens/s, memory and whether it
    fits the device."""
    plan = Plan(1, 1, 1, 1, 1, batch, recompute)
    got = evaluate(config, plan, seq_len=seq_len, global_batch_size=batch * micro_batches, cluster=cluster,
                   software=software)
    return {"profile": cluster.name, "step_s": got["step_s"], "tokens_per_s": got["tokens_per_s"],
            "memory_gb": round(got["memory_per_gpu_gb"], 2), "fits": got["fits"]}


def predicted_rows(result: dict, *, candidates: bool = True) -> list[dict]:
    """Per measured row (and, with `candidates`, per measured search candidate) of bench.mfu's JSON: measured and
    predicted step seconds and their ratio (predicted / measured; > 1: the planner is slower than the device)."""
    config = GPTConfig(**result["config"])
    cluster, software = profile_for(result["machine"], threads=result["threads"], dtype=result["dtype"])
    tried = result.get("search", {}).get("candidates", []) if candidates else []
    rows = result["rows"] + [c | {"row": f"search {c['row']}"} for c in tried if c["status"] == "measured"]
    out = []
    for r in rows:
        got = predict_step(config, batch=r["batch"], micro_batches=result["micro_batches"],
                           seq_len=result["seq_len"], recompute=r["recompute"], cluster=cluster, software=software)
        out.append({"row": r["row"], "recompute": r["recompute"], "batch": r["batch"], "profile": got["profile"],
                    "measured_step_s": r["step_s"], "predicted_step_s": got["step_s"],
                    "ratio": got["step_s"] / r["step_s"]})
    return out


def check_mfu(result: dict) -> list[dict]:
    """`--check-mfu`: print predicted vs measured per row of bench.mfu's JSON (`result`); the rows."""
    rows = predicted_rows(result)
    print(f"bench.mfu on {result['machine']}: {result['shape']} vs the planner's one-device prediction")
    print_table(rows, TABLE)
    return rows
