"""Arithmetic intensity vs shard size, roofline, communication vs compute, and a TP-degree recommendation.

    python -m bench.intensity [--hardware h100-nvlink|h100-ib|a100-nvlink|cpu-measured] [--out DIR]
                              [--hidden D [--ffn F] [--mlp gelu|swiglu]] [--tokens T ...] [--no-measure | --quick]
    torchrun --nproc-per-node N -m bench.intensity ...   # collectives timed on the launched ranks (NCCL on GPUs)

For GPT layer shapes (hidden 1024-8192, FFN 4x and SwiGLU 8/3x, 1-16384 tokens per micro-batch) and TP = 1..64:
- modelled (bench/roofline.py: formulas, hardware sources, the recommendation rule): the per-rank GEMMs of the
  column->row MLP and of the attention projections (forward, dgrad, wgrad): FLOPs, minimal bytes, intensity, roofline
  time on the chosen hardware; the collective bytes of each pair; MLP-forward compute vs communication per TP degree;
- measured on this machine (unless --no-measure): achieved FLOP/s of torch.matmul at every local GEMM shape up to
  --max-gflop (and of kernels.linear's compiled Triton kernels on CUDA; on CPU they are skipped: the interpreter says
  nothing about speed), copy bandwidth, a square-GEMM peak, and all-reduce / all-gather / reduce-scatter times for
  the layers' message sizes (tp.mappings' collectives) on spawned gloo ranks (NCCL when enough GPUs), or on the
  torchrun ranks. CPU runs fp32 (its bf16 matmul is not representative), CUDA runs bf16.
--hardware cpu-measured models with the measured numbers instead (fp32 on CPU; link bandwidth and per-collective
latency fitted to the measured collectives). --out DIR gets gemms.csv, tp.csv, collectives.csv, intensity.json,
recommendation.json and intensity.png; the terminal shows the table (one layer: every token count; a sweep: the
largest) and the recommendation.
"""
import argparse
import csv
import os

import torch
import torch.distributed as dist

from . import roofline as rl
from .common import machine, print_table, write_json
from .measure import measure, measured_profile

DEFAULT_HIDDEN = (1024, 2048, 4096, 8192)
DEFAULT_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
QUICK = dict(hidden=(1024,), tokens=(16, 256, 2048), max_gflop=2, max_message_mb=8, peak_size=1024,
             bandwidth_mb=128, min_seconds=0.02)


# ---- shapes -------------------------------------------------------------------------------------------------------


def shapes_from(args):
    """[(Shape for each token count)] grouped by layer: one group per (hidden, ffn, mlp)."""
    if args.hidden is None:
        if args.ffn is not None:
            raise ValueError(f"--ffn {args.ffn} needs --hidden")
        layers = [(d, rl.default_ffn(d, mlp), mlp) for mlp in args.mlp for d in args.hiddens]
    else:
        layers = [(args.hidden, args.ffn or rl.default_ffn(args.hidden, mlp), mlp) for mlp in args.mlp]
    return [[rl.Shape(d, f, t, mlp) for t in sorted(set(args.tokens))] for d, f, mlp in layers]  # largest T last


# ---- rows -----------------------------------------------------------------------------------------------------------


def gemm_rows(shapes, hw, measured):
    gemms_measured = measured["gemms"] if measured else {}
    rows = []
    for group in shapes:
        for s in group:
            for tp in (d for d in rl.TP_DEGREES if s.shardable(d)):
                for g in rl.layer_gemms(s, tp):
                    m = gemms_measured.get((g.phase, g.m, g.k, g.n), {})
                    rows.append({
                        "hidden": s.hidden, "ffn": s.ffn, "mlp": s.mlp, "tokens": s.tokens, "tp": tp,
                        "layer": g.layer, "phase": g.phase, "M": g.m, "K": g.k, "N": g.n, "flops": g.flops,
                        "bytes": g.bytes(hw.element_size), "intensity": g.intensity(hw.element_size),
                        "bound": "compute" if g.intensity(hw.element_size) >= hw.ridge else "memory",
                        "model_s": g.time(hw),
                        "measured_intensity": g.intensity(measured["element_size"]) if measured else None,
                        "measured_flops": m.get("torch"), "kernels_flops": m.get("kernels"),
                    })
    return rows


def tp_rows(shapes, hw, measured):
    gemms_measured = measured["gemms"] if measured else {}
    collectives = measured["collectives"] if measured else {}
    rows = []
    for group in shapes:
        for s in group:
            for tp in (d for d in rl.TP_DEGREES if s.shardable(d)):
                fc1 = rl.mlp_gemms(s, tp)[0]
                timed = {r["kind"]: r["seconds"] for r in collectives.get(tp, ())
                         if r["elements"] == s.tokens * s.hidden}
                rows.append(dict(
                    rl.tp_model(s, tp, hw),
                    measured_fc1_fwd_flops=gemms_measured.get((fc1.phase, fc1.m, fc1.k, fc1.n), {}).get("torch"),
                    measured_all_reduce_s=timed.get(rl.ALL_REDUCE), measured_all_gather_s=timed.get(rl.ALL_GATHER),
                    measured_reduce_scatter_s=timed.get(rl.REDUCE_SCATTER)))
    return rows


def collective_rows(measured):
    rows = []
    for p, timed in (measured["collectives"] if measured else {}).items():
        for r in timed:
            size = r["elements"] * measured["element_size"]
            wire = rl.Collective(r["kind"], "fwd", size).wire_bytes(p)
            rows.append(dict(r, tp=p, bytes=size, wire_bytes=wire, bus_bandwidth=wire / r["seconds"]))
    return rows


# ---- output ---------------------------------------------------------------------------------------------------------

TABLE = [
    ("hidden", "D", "{}"), ("ffn", "F", "{}"), ("mlp", "mlp", "{}"), ("tokens", "T", "{}"), ("tp", "TP", "{}"),
    ("link", "link", "{}"),
    ("ffn_shard", "F/TP", "{}"), ("mlp_min_intensity", "FLOP/B", "{:.0f}"), ("ridge", "ridge", "{:.0f}"),
    ("mlp_fwd_compute_us", "compute us", "{:.1f}"), ("mlp_fwd_comm_us", "comm us", "{:.1f}"),
    ("comm_over_compute", "comm/comp", "{:.2f}"), ("efficiency_serial", "eff serial", "{:.2f}"),
    ("measured_fc1_gflops", "meas fc1 GFLOP/s", "{:.1f}"), ("measured_all_reduce_us", "meas AR us", "{:.1f}"),
    ("measured_ag_rs_us", "meas AG+RS us", "{:.1f}"),
]


def _display(row):
    ag, rs = row["measured_all_gather_s"], row["measured_reduce_scatter_s"]
    scaled = lambda v, k: None if v is None else v * k  # noqa: E731
    return dict(row, mlp_fwd_compute_us=1e6 * row["mlp_fwd_compute_s"], mlp_fwd_comm_us=1e6 * row["mlp_fwd_comm_s"],
                measured_fc1_gflops=scaled(row["measured_fc1_fwd_flops"], 1e-9),
                measured_all_reduce_us=scaled(row["measured_all_reduce_s"], 1e6),
                measured_ag_rs_us=None if ag is None or rs is None else 1e6 * (ag + rs))


def recommendation_line(rec, rows, hw):
    by_tp = {r["tp"]: r for r in rows if (r["hidden"], r["ffn"], r["mlp"], r["tokens"]) ==
             (rec["hidden"], rec["ffn"], rec["mlp"], rec["tokens"])}
    limit = rec["max_tp_overlapped"]
    nxt = min((tp for tp in by_tp if tp > limit), default=None)
    shape = f"{hw.name}, D={rec['hidden']} F={rec['ffn']} ({rec['mlp']}), {rec['tokens']} tokens"
    bound = f"; TP={nxt} is communication-bound (comm/compute {by_tp[nxt]['comm_over_compute']:.2f})" if nxt else \
        "" if limit == max(rl.TP_DEGREES) else f"; TP={2 * limit} does not divide the sizes"
    if limit == 1:
        return f"{shape}: stay at TP=1{bound}."
    return (f"{shape}: TP <= {limit} keeps the MLP's communication at or below its compute (comm/compute "
            f"{by_tp[limit]['comm_over_compute']:.2f}){bound}. At TP={limit} overlapped runs at the compute roofline; "
            f"serialised spends {1 - by_tp[limit]['efficiency_serial']:.0%} of the step communicating.")


def headline_of(recs):
    """The shape recommendation.json and the plot lead with: the largest GELU layer (else SwiGLU) at the most tokens."""
    return max(recs, key=lambda r: (r["mlp"] == "gelu", r["hidden"], r["ffn"], r["tokens"]))


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


def write_outputs(out, hw, args, measured, recs, tps, gemms):
    from .intensity_plot import plot

    os.makedirs(out, exist_ok=True)
    write_csv(os.path.join(out, "gemms.csv"), gemms)
    write_csv(os.path.join(out, "tp.csv"), tps)
    if measured and measured["collectives"]:
        write_csv(os.path.join(out, "collectives.csv"), collective_rows(measured))
    meta = {"hardware": vars(hw), "model": rl.__doc__, "args": vars(args), "machine": machine()}
    if measured:
        measured = dict(measured, gemms=[dict(zip(("phase", "m", "k", "n"), key), **v)
                                         for key, v in measured["gemms"].items()])
    write_json(os.path.join(out, "intensity.json"),  # the per-GEMM model rows are in gemms.csv
               {"meta": meta, "measured": measured, "recommendations": recs, "tp": tps})
    headline = headline_of(recs)
    write_json(os.path.join(out, "recommendation.json"), {
        "hardware": hw.name, "max_tp_overlapped": headline["max_tp_overlapped"],
        "max_tp_serial": headline["max_tp_serial"],
        "shape": {k: headline[k] for k in ("hidden", "ffn", "mlp", "tokens")},
        "criterion": "largest TP (every smaller degree too) with MLP-forward T_comm <= T_math; overlapped: the "
                     "collectives hide behind the matmuls; serialised: they take at most half the step "
                     "(the same inequality, so the same degree). Model: bench/roofline.py",
        "all_shapes": recs,
    })
    plot(os.path.join(out, "intensity.png"), hw, headline, tps, gemms, measured)


# ---- main -----------------------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hardware", choices=[*rl.HARDWARE, "cpu-measured"], default="h100-nvlink")
    p.add_argument("--hidden", type=int, help="one layer: hidden size (default: 1024 2048 4096 8192)")
    p.add_argument("--ffn", type=int, help="FFN size with --hidden (default 4x, SwiGLU 8/3x rounded to 256)")
    p.add_argument("--mlp", nargs="+", choices=("gelu", "swiglu"), help="default: both, or gelu with --hidden")
    p.add_argument("--tokens", type=int, nargs="+", help=f"tokens per micro-batch (default {DEFAULT_TOKENS})")
    p.add_argument("--out", help="directory for CSV, JSON, recommendation.json and intensity.png")
    p.add_argument("--no-measure", action="store_true", help="model only")
    p.add_argument("--quick", action="store_true", help="small measured sweep (about a minute on 2 CPU cores)")
    p.add_argument("--measure-tp", type=int, nargs="+", help="ranks for the timed collectives (default 2 4; "
                                                             "under torchrun: powers of two up to the world size)")
    p.add_argument("--max-gflop", type=float, help="largest GEMM timed (default: 2 on CPU, no limit on CUDA)")
    p.add_argument("--max-message-mb", type=float, help="largest collective timed (default: 64 on CPU, 1024 on CUDA)")
    p.add_argument("--peak-size", type=int, help="square GEMM for the measured peak (default 2048 CPU, 8192 CUDA)")
    p.add_argument("--bandwidth-mb", type=int, help="copy size for the bandwidth (default 256)")
    p.add_argument("--min-seconds", type=float, help="time each measurement at least this long (default 0.05)")
    args = p.parse_args(argv)
    if args.no_measure and args.quick:
        p.error("--quick is a small measured sweep; --no-measure measures nothing")
    cuda = torch.cuda.is_available()
    world = dist.get_world_size() if dist.is_initialized() else 1
    defaults = dict(hidden=DEFAULT_HIDDEN, tokens=DEFAULT_TOKENS, max_gflop=None if cuda else 2,
                    max_message_mb=1024 if cuda else 64, peak_size=8192 if cuda else 2048, bandwidth_mb=256,
                    min_seconds=0.05)
    defaults.update(QUICK if args.quick else {})
    args.hiddens = defaults.pop("hidden")
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.mlp = args.mlp or (["gelu"] if args.hidden else ["gelu", "swiglu"])
    args.measure_tp = args.measure_tp or ([2**i for i in range(1, world.bit_length())] if world > 1 else [2, 4])
    for name, values in (("hidden", [args.hidden]), ("ffn", [args.ffn]), ("tokens", args.tokens)):
        bad = [v for v in values if v is not None and v < 1]
        if bad:
            raise ValueError(f"--{name} {bad[0]} must be >= 1")
    if any(p < 2 for p in args.measure_tp):
        raise ValueError(f"--measure-tp needs degrees >= 2, got {args.measure_tp}")
    if not args.no_measure:  # the timed collectives move tokens x hidden elements split over each degree
        for hidden in [args.hidden] if args.hidden else args.hiddens:
            for t in args.tokens:
                p = next((p for p in args.measure_tp if t * hidden % p), None)
                if p:
                    raise ValueError(f"--measure-tp {p} does not divide the message of {t} tokens x hidden {hidden}")
    return args


def main(argv=None):
    launched = int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized()  # by torchrun
    if launched:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        return _run(parse_args(argv))
    finally:
        if launched:
            dist.destroy_process_group()


def _run(args):
    shapes = shapes_from(args)
    measured = None if args.no_measure else measure(
        shapes, degrees=args.measure_tp, max_gflop=args.max_gflop, max_message_mb=args.max_message_mb,
        peak_size=args.peak_size, bandwidth_mb=args.bandwidth_mb, min_seconds=args.min_seconds)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    hw = measured_profile(measured) if args.hardware == "cpu-measured" else rl.HARDWARE[args.hardware]
    recs = [rl.recommendation(group[-1], hw) for group in shapes]
    tps, gemms = tp_rows(shapes, hw, measured), gemm_rows(shapes, hw, measured)
    shown = tps if len(shapes) == 1 else [r for r in tps if r["tokens"] == max(args.tokens)]  # one layer: every T
    print(f"\nModel: {hw.name} ({hw.dtype}; C = {hw.flops:.3g} FLOP/s, HBM = {hw.hbm:.3g} B/s, W = {hw.link:.3g} B/s "
          f"per direction; ridge {hw.ridge:.0f} FLOP/B, C/W = {hw.flops_per_link_byte:.0f}). MLP forward per rank; "
          f"comm = all-gather + reduce-scatter of e*T*D bytes each at W (scaling book)"
          + (f"; TP > {hw.gpus_per_node} crosses the node boundary: IB at {hw.inter_node:.3g} B/s per device."
             if hw.gpus_per_node else "."))
    if measured:
        print(f"Measured on {measured['device']} ({measured['dtype']}): peak {measured['peak_flops'] / 1e9:.1f} "
              f"GFLOP/s, copy {measured['bandwidth'] / 1e9:.1f} GB/s, kernels.linear {measured['kernels']}, "
              f"collectives at TP {sorted(measured['collectives'])} ({measured['seconds']:.0f} s of measuring)")
    print_table([_display(r) for r in shown], TABLE if measured else TABLE[:-3])
    print(f"Compute-bound {hw.dtype} two-matrix MLP: communication-bound once F/TP < "
          f"{hw.element_size / 2 * hw.flops_per_link_byte:.0f} (scaling book: F/TP > C/W; SwiGLU: 2/3 of that)")
    for rec in recs:
        print(recommendation_line(rec, tps, hw))
    if args.out:
        write_outputs(args.out, hw, args, measured, recs, tps, gemms)
    return {"hardware": hw, "measured": measured, "recommendations": recs, "tp": tps, "gemms": gemms}


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # a bad argument: one line, not a traceback
        raise SystemExit(f"error: {e}") from None
