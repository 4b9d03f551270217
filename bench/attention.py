"""Context-parallel attention: ring vs all-gather vs Ulysses (a2a, a2a+ring) vs dense, measured on gloo ranks and
modelled at scale.

    python -m bench.attention [--seq 256 512 1024 2048] [--cp 1 2 4] [--heads 4 --kv-heads 4 --head-dim 64]
                              [--a2a-size 2] [--iters 5] [--out PATH] [--json]   (JSON to a temp folder unless --out)

Measured: fwd+bwd of causal attention over s tokens (batch 1, fp32, one thread per rank), each cp size on its own
spawned ranks (gloo; NCCL when there are cp GPUs):
  dense       F.scaled_dot_product_attention over the whole sequence, in this process, one thread (the cp = 1 row)
  ring        tp.context_parallel_attention(mode="ring") on cp ranks, each holding s/cp tokens (cp_shard)
  allgather   the same, mode="allgather"
  a2a         the same, mode="a2a" (Ulysses; where the heads split over cp)
  a2a+ring    the same, mode="a2a+ring", a2a_size=--a2a-size (where cp is a larger multiple of it)
Time: the modes run round-robin; a step is timed between barriers (the slowest rank); median of --iters after
--warmup. Memory per rank (the largest over the ranks), from one untimed step: "saved" = bytes of the distinct
storages autograd saves for backward (saved_tensors_hooks; inputs included), "largest" = the largest tensor any op
returns in forward or backward (a TorchDispatchMode); their sum bounds the peak the attention adds from below. Not
RSS. err = max |out − dense out| over this rank's share; "vs ring" = the largest difference of the outputs and q/k/v
grads from the ring's.

Modelled (per layer and rank, causal, balanced, batch 1, bf16 on the wire and in the blocks, fp32 dK/dV in the ring;
roofline.py's profiles, compute at the peak C, the α-β model with α = --latency-us per message or collective; W the
profile's link, each GPU's NIC (inter_node) once cp exceeds its GPUs per node): n = S/cp tokens per rank, a KV
message is 2·Hkv·n·d·e bytes. Every ring step computes the same causal work, half of an
n x n block of H heads: t_blk = 2·H·n²·d / C forward, 2.5x that backward (flash's 5 matmuls for 2), plus folding the
partial output (forward) or dq (backward) into an fp32 accumulator, t_acc = 3·4·H·n·d / HBM. The transfer hides
under the block when t_blk >= t_kv + α, i.e. n >= (Hkv/H)·e·C/W without latency.
  ring fwd       = t_blk + (cp−1)·max(t_blk, t_kv + α) + cp·t_acc
  ring bwd       = 2.5·t_blk + (cp−1)·max(2.5·t_blk, t_kv + t_dkv + α) + cp·t_acc + t_dkv + α  (dK/dV's hop home)
  allgather fwd  = (cp−1)·t_kv + α + cp·t_blk              (one all-gather, exposed; one kernel per chunk, no merge)
  allgather bwd  = cp·2.5·t_blk + (cp−1)·t_dkv + α           (one reduce-scatter of fp32 dK/dV, exposed)
  a2a fwd        = a2a(q) + a2a(k) + a2a(v) + cp·t_blk + a2a(out)   (the same causal work: H/cp heads over S tokens)
  a2a bwd        = the 4 all-to-alls again + 2.5·cp·t_blk
                   a2a(x) = α + (cp−1)/cp · bytes(x) / W, exposed; k and v carry max(Hkv, cp) heads (replicated)
  a2a+ring       all-to-alls inside sub-groups of A = --model-a2a-size ranks over the node's NVLink (h100-ib-gpu: the
                 H100 node's 450 GB/s), then the ring above across cp/A sub-groups over the profile's link, each rank
                 holding A·n tokens of H/A heads (its blocks A times larger, its KV messages of max(Hkv, A) heads)
The all-gather wins when the blocks are too small to hide anything (latency-bound: the ring pays α and a merge per
step) and KV is small (GQA); the ring wins when the exposed all-gather of K and V is large (MHA, low W); Ulysses
moves 4 tensors once per direction whatever cp (each rank's share shrinks with cp), exposed: it wins on fast links
with many heads, and loses across slow links, where a2a+ring keeps its all-to-alls inside the node.

Then multi-head latent attention against GQA at equal attention parameters (bench/attention_mla.py): modelled at
--heads-model/--kv-model/--head-dim-model and the first --model-seq, measured at --heads/--kv-heads/--head-dim and
the shortest --seq.
"""
import argparse
import contextlib
import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tp
from tp import context, testing

from . import attention_mla
from .common import at_least, check_out, machine, print_table, round_robin_times, scratch_path, step_memory, write_json
from .roofline import HARDWARE, group_link

MODES = tuple(context.MODES)
memory = step_memory  # (its name here before bench.common held it)
# A cp ring across nodes sends over each GPU's own NIC: roofline's h100-ib is a node's 8 NICs (400 GB/s), one is 50.
PROFILES = {"h100-nvlink": HARDWARE["h100-nvlink"], "a100-nvlink": HARDWARE["a100-nvlink"],
            "h100-ib-gpu": dataclasses.replace(HARDWARE["h100-ib"], name="h100-ib-gpu", link=50e9)}
NODE_LINK = {"h100-ib-gpu": HARDWARE["h100-nvlink"].link}  # a2a+ring's all-to-alls inside the node (else the link)


def measured_modes(cp, heads, kv_heads, a2a_size):
    """{mode: a2a_size} of the modes that run at this cp: those that keep the heads whole, a2a where the heads split
    over cp, a2a+ring where cp is a larger multiple of a2a_size and the heads split over it."""
    modes = {}
    for name, mode in context.MODES.items():
        if mode.sub_groups and (cp <= a2a_size or cp % a2a_size):
            continue
        size = context.heads_split(name, cp, a2a_size)
        if size is None or (heads % size == 0 and (kv_heads % size == 0 or size % kv_heads == 0)):
            modes[name] = a2a_size if mode.sub_groups else None
    return modes


def left_out(cp, heads, kv_heads, a2a_size):
    """Why each mode measured_modes leaves out at this cp does not run, one line each."""
    lines, measured = [], measured_modes(cp, heads, kv_heads, a2a_size)
    for name, mode in context.MODES.items():
        if name in measured:
            continue
        if mode.sub_groups and (cp <= a2a_size or cp % a2a_size):
            lines.append(f"cp={cp}: {name} left out (cp is not a larger multiple of --a2a-size {a2a_size})")
        else:
            size = context.heads_split(name, cp, a2a_size)
            lines.append(f"cp={cp}: {name} left out (--heads {heads} / --kv-heads {kv_heads} do not split over "
                         f"{size} ranks)")
    return lines


# ---- measured ------------------------------------------------------------------------------------------------------


def _inputs(seq, heads, kv_heads, head_dim, device):
    """The full q, k, v and output gradient [1, heads, s, d] (the same on every rank) and the dense output."""
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, h, seq, head_dim, generator=g).to(device) for h in (heads, kv_heads, kv_heads, heads)]
    with torch.no_grad():
        return full, _dense(*full[:3])


def _dense(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def _run(attend, inputs, *, iters, warmup, sync):
    """{name: [seconds, saved bytes, largest bytes]} and {name: (out, q/k/v grads)} of fwd+bwd steps."""

    def step(name):
        q, k, v, dout = inputs[name]
        for t in (q, k, v):
            t.grad = None
        out = attend[name](q, k, v)
        out.backward(dout)
        return out

    times = round_robin_times({name: (lambda name=name: step(name)) for name in inputs}, iters=iters, warmup=warmup,
                              sync=sync)
    result = {name: [times[name], *step_memory(lambda name=name: step(name))] for name in inputs}
    return result, {name: (step(name).detach(), *(t.grad for t in inputs[name][:3])) for name in inputs}


def measure_dense(seq, heads, kv_heads, head_dim, iters, warmup):
    """The cp = 1 row, in this process (one thread, as a rank): [seconds, saved bytes, largest bytes]."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        full, _ = _inputs(seq, heads, kv_heads, head_dim, device)
        inputs = {"dense": [t.clone().requires_grad_(i < 3) for i, t in enumerate(full)]}
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        return _run({"dense": _dense}, inputs, iters=iters, warmup=warmup, sync=sync)[0]["dense"]
    finally:
        torch.set_num_threads(threads)


def measure_rank(seq, heads, kv_heads, head_dim, iters, warmup, a2a_size):
    """On the cp ranks: {mode: [seconds (the slowest rank's), saved bytes, largest bytes (this rank's), max error vs
    dense, max difference from the ring (outputs and grads)]}."""
    torch.set_num_threads(1)
    tp.init_mesh(cp=dist.get_world_size())
    device = testing.device()
    full, dense_out = _inputs(seq, heads, kv_heads, head_dim, device)
    modes = measured_modes(dist.get_world_size(), heads, kv_heads, a2a_size)
    inputs = {mode: [tp.cp_shard(t, 2).clone().requires_grad_(i < 3) for i, t in enumerate(full)] for mode in modes}
    attend = {mode: (lambda q, k, v, mode=mode: tp.context_parallel_attention(q, k, v, mode=mode,
                                                                              a2a_size=modes[mode])) for mode in modes}
    sync = (lambda: (torch.cuda.synchronize(), dist.barrier())) if device.type == "cuda" else dist.barrier
    result, outputs = _run(attend, inputs, iters=iters, warmup=warmup, sync=sync)
    for mode in modes:
        result[mode].append((outputs[mode][0] - tp.cp_shard(dense_out, 2)).abs().max().item())
        result[mode].append(max((a - b).abs().max().item() for a, b in zip(outputs[mode], outputs["ring"])))
    return result


def measure(a):
    rows = []
    for seq in a.seq:
        dense_s = None
        for cp in sorted(set(a.cp)):
            if cp == 1:
                dense_s, saved, largest = measure_dense(seq, a.heads, a.kv_heads, a.head_dim, a.iters, a.warmup)
                rows.append(_row(seq, 1, "dense", dense_s, saved, largest, None, None, dense_s))
                continue
            per_rank = testing.run(measure_rank, world_size=cp, timeout=3600, seq=seq, heads=a.heads,
                                   kv_heads=a.kv_heads, head_dim=a.head_dim, iters=a.iters, warmup=a.warmup,
                                   a2a_size=a.a2a_size)
            for mode in measured_modes(cp, a.heads, a.kv_heads, a.a2a_size):
                saved, largest, err, vs_ring = (max(r[mode][i] for r in per_rank) for i in (1, 2, 3, 4))
                rows.append(_row(seq, cp, mode, per_rank[0][mode][0], saved, largest, err,
                                 None if mode == "ring" else vs_ring, dense_s))
    return rows


def _row(seq, cp, mode, seconds, saved, largest, err, vs_ring, dense_s):
    return {"seq": seq, "cp": cp, "mode": mode, "ms": 1e3 * seconds, "vs_dense": seconds / dense_s if dense_s else None,
            "saved_mib": saved / 2**20, "largest_mib": largest / 2**20, "peak_mib": (saved + largest) / 2**20,
            "err": err, "vs_ring": vs_ring}


# ---- modelled ------------------------------------------------------------------------------------------------------


def _ring_seconds(cp, t_blk, t_kv, t_dkv, t_acc, latency):
    """fwd + bwd of the ring (module docstring)."""
    fwd = t_blk + (cp - 1) * max(t_blk, t_kv + latency) + cp * t_acc
    bwd = 2.5 * t_blk + (cp - 1) * max(2.5 * t_blk, t_kv + t_dkv + latency) + cp * t_acc + t_dkv + latency
    return fwd + bwd


def _a2a_seconds(size, tensor_bytes, link, latency):
    """The 4 all-to-alls forward and 4 backward over `size` ranks: (size−1)/size of each tensor leaves a rank."""
    return 2 * sum(latency + (size - 1) / size * b / link for b in tensor_bytes)


def model_row(hw, seq, cp, heads, kv_heads, head_dim, latency, a2a_size=4):
    """Modelled per-rank fwd+bwd seconds of one causal attention layer in every mode (module docstring)."""
    n, e, acc, d = seq // cp, hw.element_size, 4, head_dim
    t_blk = 2 * heads * n * n * d / hw.flops
    t_acc = 3 * acc * heads * n * d / hw.hbm
    link = group_link(hw, cp)[0]  # (each GPU's NIC once the group spans nodes)
    t_kv, t_dkv = (2 * kv_heads * n * d * size / link for size in (e, acc))
    ring = _ring_seconds(cp, t_blk, t_kv, t_dkv, t_acc, latency)
    allgather = (cp - 1) * t_kv + latency + cp * t_blk + cp * 2.5 * t_blk + (cp - 1) * t_dkv + latency
    a2a = 3.5 * cp * t_blk + _a2a_seconds(cp, [x * n * d * e for x in (heads, max(kv_heads, cp)) * 2], link, latency)
    a, kv_a = a2a_size, max(kv_heads, a2a_size)  # the ring's ranks hold a·n tokens of heads/a heads
    a2a_ring = _a2a_seconds(a, [x * n * d * e for x in (heads, kv_a) * 2],
                            NODE_LINK.get(hw.name, group_link(hw, a)[0]), latency)
    a2a_ring += _ring_seconds(cp // a, a * t_blk, 2 * kv_a * n * d * e / link, 2 * kv_a * n * d * acc / link,
                              t_acc, latency)
    times = {"ring": ring, "allgather": allgather, "a2a": a2a, "a2a+ring": a2a_ring}
    return {"hardware": hw.name, "seq": seq, "cp": cp, "heads": f"{heads}/{kv_heads}", "n": n,
            "block_us": 1e6 * t_blk, "kv_us": 1e6 * (t_kv + latency), "hidden": t_blk >= t_kv + latency,
            "hide_from_n": kv_heads / heads * e * hw.flops / link,
            **{f"{mode.replace('+', '_')}_ms": 1e3 * t for mode, t in times.items()},
            "compute_ms": 1e3 * 3.5 * cp * t_blk, "winner": min(times, key=times.get)}


def model(a):
    return [model_row(PROFILES[name], seq, cp, a.heads_model, kv, a.head_dim_model, a.latency_us * 1e-6,
                      a.model_a2a_size)
            for name in a.hardware for cp in a.model_cp for seq in a.model_seq for kv in (a.heads_model, a.kv_model)]


# ---- the command ---------------------------------------------------------------------------------------------------

MEASURED_COLUMNS = [
    ("seq", "s", "{}"), ("cp", "cp", "{}"), ("mode", "mode", "{}"), ("ms", "fwd+bwd ms", "{:.2f}"),
    ("vs_dense", "vs dense", "{:.2f}"), ("saved_mib", "saved MiB", "{:.2f}"), ("largest_mib", "largest MiB", "{:.2f}"),
    ("peak_mib", "saved+largest MiB", "{:.2f}"), ("err", "err vs dense", "{:.1e}"),
    ("vs_ring", "vs ring", "{:.1e}")]
MODEL_COLUMNS = [
    ("hardware", "hardware", "{}"), ("seq", "S", "{}"), ("cp", "cp", "{}"), ("heads", "H/Hkv", "{}"),
    ("n", "n=S/cp", "{}"), ("block_us", "block us", "{:.1f}"), ("kv_us", "KV+α us", "{:.1f}"),
    ("hidden", "hidden", "{}"), ("ring_ms", "ring ms", "{:.3f}"), ("allgather_ms", "allgather ms", "{:.3f}"),
    ("a2a_ms", "a2a ms", "{:.3f}"), ("a2a_ring_ms", "a2a+ring ms", "{:.3f}"), ("compute_ms", "compute ms", "{:.3f}"),
    ("winner", "fastest", "{}")]


def parser():
    p = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=at_least(2), nargs="+", default=[256, 512, 1024, 2048], help="measured lengths")
    p.add_argument("--cp", type=at_least(1), nargs="+", default=[1, 2, 4], help="measured cp sizes (1: dense)")
    p.add_argument("--heads", type=at_least(1), default=4)
    p.add_argument("--kv-heads", type=at_least(1), default=4)
    p.add_argument("--head-dim", type=at_least(1), default=64)
    p.add_argument("--a2a-size", type=at_least(1), default=2, help="measured a2a+ring's sub-group size")
    p.add_argument("--iters", type=at_least(1), default=5)
    p.add_argument("--warmup", type=at_least(0), default=1)
    p.add_argument("--hardware", nargs="+", choices=tuple(PROFILES), default=list(PROFILES))
    p.add_argument("--model-seq", type=at_least(1), nargs="+", default=[8192, 32768, 131072], help="modelled S")
    p.add_argument("--model-cp", type=at_least(2), nargs="+", default=[8, 16])
    p.add_argument("--heads-model", type=at_least(1), default=32, help="modelled query heads (Llama 3 8B: 32)")
    p.add_argument("--kv-model", type=at_least(1), default=8, help="modelled GQA kv heads (beside MHA)")
    p.add_argument("--head-dim-model", type=at_least(1), default=128)
    p.add_argument("--model-a2a-size", type=at_least(1), default=4,
                   help="modelled a2a+ring's sub-group size (its all-to-alls inside a node)")
    p.add_argument("--latency-us", type=float, default=10.0,
                   help="α per p2p message or collective, µs (an assumption; the profiles list bandwidth only)")
    p.add_argument("--out", default=scratch_path("attention.json"),
                   help="JSON (bench/results/attention.json: committed)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    return p


def main(argv=None):
    p = parser()
    a = p.parse_args(argv)
    check_out(p, "--out", a.out)
    bad = [(s, cp) for s in a.seq for cp in a.cp if s % (2 * cp)]
    if bad:
        p.error(f"--seq {bad[0][0]} is not divisible by 2·cp = {2 * bad[0][1]}")
    if a.heads % a.kv_heads or a.heads_model % a.kv_model:
        p.error(f"--heads {a.heads} / --heads-model {a.heads_model} must be multiples of --kv-heads {a.kv_heads} / "
                f"--kv-model {a.kv_model}")
    bad = [cp for cp in a.model_cp if a.heads_model % cp or cp % a.model_a2a_size or a.heads_model % a.model_a2a_size]
    if bad:
        p.error(f"--model-cp {bad[0]}: --heads-model {a.heads_model} must split over it (a2a) and it over "
                f"--model-a2a-size {a.model_a2a_size} (a2a+ring), heads too")
    measured, modelled = measure(a), model(a)
    latent = {"model": attention_mla.modelled(a.heads_model * a.head_dim_model, a.heads_model, a.kv_model,
                                              a.head_dim_model, a.model_seq[0]),
              "measured": attention_mla.measured(a.heads * a.head_dim, a.heads, a.kv_heads, a.head_dim, min(a.seq),
                                                 a.iters, a.warmup)}
    payload = {"machine": machine(), "load_average": os.getloadavg(), "args": vars(a), "measured": measured,
               "model": modelled, "mla_vs_gqa": latent}
    if a.json:
        print(json.dumps(payload))
    else:
        print(f"\nCausal attention fwd+bwd, batch 1, {a.heads}/{a.kv_heads} heads, head dim {a.head_dim}, fp32, median "
              f"of {a.iters}, on {machine()}; memory per rank (the largest rank)")
        payload["measured_table"] = print_table(measured, MEASURED_COLUMNS)
        for cp in sorted({cp for cp in a.cp if cp > 1}):
            for line in left_out(cp, a.heads, a.kv_heads, a.a2a_size):
                print(line)
        print(f"\nModel: per layer and rank, bf16, α = {a.latency_us:g} us, compute at peak (see the docstring)")
        payload["model_table"] = print_table(modelled, MODEL_COLUMNS)
        for name in a.hardware:
            hw = PROFILES[name]
            past_node = f"; cp > {hw.gpus_per_node}, over each GPU's NIC: " \
                f"{hw.element_size * hw.flops / hw.inter_node:.0f}·Hkv/H" if hw.gpus_per_node else ""
            print(f"{name}: ring hides the KV transfer once n >= (Hkv/H)·e·C/W = "
                  f"{hw.element_size * hw.flops_per_link_byte:.0f}·Hkv/H tokens per rank{past_node} (without α)")
        print("\nMLA vs GQA at equal attention parameters (bench/attention_mla.py): per layer, bf16, modelled on "
              f"{latent['model'][0]['hardware']}")
        print_table(latent["model"], attention_mla.MODEL_COLUMNS)
        print(f"measured on this CPU: fp32, one thread, median of {a.iters}; MLA's head widths as GQA's")
        print_table(latent["measured"], attention_mla.MEASURED_COLUMNS)
    with contextlib.redirect_stdout(sys.stderr if a.json else sys.stdout):  # --json: stdout is the JSON alone
        write_json(a.out, payload)
    return 0


if __name__ == "__main__":
    main()
