"""A parallelism planner: every feasible tp × cp × pp (× virtual stages) × dp split, micro-batch, recompute, SP and dp
mode for a model on N GPUs, ranked by modelled tokens/s, with per-GPU memory from bench.plan.memory and step time from
bench/plan/step_time.py (the same hardware profiles as bench.intensity, bench/roofline.py).

    python -m bench.plan --hardware h100-sxm --gpus 1024 --model llama3-70b --seq-len 8192 --global-batch-size 1024
    python -m bench.plan --hardware a100-80g --gpus 64 --hidden 12288 --layers 96 --heads 96 --activation gelu \\
        --vocab 51200 --seq-len 2048 --global-batch-size 64 --fix tp=8,pp=8 --top 5 [--json] [--out DIR]
    python -m bench.plan --validate        # predicted vs published MFU/HFU, and vs bench.train's CPU runs

Feasible: the sizes divide (heads, kv heads, FFN and the padded vocabulary by tp; the sequence by 2·cp, and by tp
under SP; the layers by pp·vp for interleaving, Megatron's micro-batches by pp), the global batch splits into
dp × micro-batch, tp stays within a node (unless --fix tp=...), and the estimated memory of the largest stage fits
the GPU's (less its `reserved` allowance). No feasible plan: one line saying what does not fit and by how much
(exit 1). --fix pins any of tp, cp, pp, vp, dp, mbs, recompute (none|selective|full), sp (on|off),
dp_mode (ddp|zero1|fsdp). --out DIR writes plans.json and plan.png (the time breakdown of the top 12 or --top).
"""
import argparse
import json
import os
import sys

import models
from models.config import PRESETS

from .. import roofline as rl
from . import memory
from . import step_time as pm

HARDWARE = ("h100-sxm", "a100-80g", "cpu-measured")
# Named shapes: the package's presets and published models (Llama 3 paper, Table 3; GPT-3 paper, Table 2.1).
MODELS = {
    **dict(PRESETS.items()),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                      ffn_hidden_size=14336, max_seq_len=131072, rope_theta=500000.0),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                       ffn_hidden_size=28672, max_seq_len=131072, rope_theta=500000.0),
    "llama3-405b": dict(vocab_size=128256, hidden_size=16384, num_layers=126, num_heads=128, num_kv_heads=8,
                        ffn_hidden_size=53248, max_seq_len=131072, rope_theta=500000.0),
    "gpt3-175b": dict(vocab_size=50257, hidden_size=12288, num_layers=96, num_heads=96, activation="gelu",
                      norm="layernorm", bias=True, position="learned", max_seq_len=2048),
}
PLOTTED = 12  # bars in plan.png at most
FIXABLE = {"tp": int, "cp": int, "pp": int, "vp": int, "dp": int, "mbs": int, "recompute": str, "sp": str,
           "dp_mode": str}
COLUMNS = [("tp", "tp", "{}"), ("cp", "cp", "{}"), ("pp", "pp", "{}"), ("vp", "vp", "{}"), ("dp", "dp", "{}"),
           ("mbs", "mbs", "{}"), ("recompute", "recompute", "{}"), ("sp", "sp", "{}"), ("dp_mode", "dp_mode", "{}"),
           ("memory_per_gpu_gb", "memory/GPU GB", "{:.1f}"), ("step_s", "step s", "{:.3g}"),
           ("tokens_per_s", "tokens/s", "{:,.0f}"), ("mfu", "MFU", "{:.1%}")]


def cluster_of(name):
    if name == "cpu-measured":  # bench.intensity's measurements, the per-op overhead fitted to bench.train's 1x1x1
        from .validation import cpu_op_overhead

        return rl.cpu_cluster(op_overhead=cpu_op_overhead())
    return rl.CLUSTERS[name]


def software_of(cluster):
    return pm.OURS_CPU if cluster.cores else pm.OURS


# ---- enumeration --------------------------------------------------------------------------------------------------


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _fits_config(config, tp):
    try:
        config.check_tp(tp)
    except ValueError:
        return False
    return True


def candidate_plans(config, *, gpus, seq_len, global_batch_size, cluster, fixed):
    """Every plan whose sizes divide (module docstring), before memory."""
    fixed = dict(fixed)
    for tp in _divisors(gpus):
        if fixed.get("tp", tp) != tp or (tp > cluster.device.gpus_per_node and "tp" not in fixed) or \
                not _fits_config(config, tp):
            continue
        for cp in _divisors(gpus // tp):
            if fixed.get("cp", cp) != cp or (cp > 1 and seq_len % (2 * cp)):
                continue
            for pp in _divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if fixed.get("pp", pp) != pp or fixed.get("dp", dp) != dp or pp > config.num_layers or \
                        global_batch_size % dp:
                    continue
                yield from _inner_plans(config, tp, cp, pp, dp, seq_len, global_batch_size, fixed)


def _inner_plans(config, tp, cp, pp, dp, seq_len, global_batch_size, fixed):
    for mbs in (fixed["mbs"],) if "mbs" in fixed else (1, 2, 4, 8, 16):  # (--fix may pin any value)
        if (global_batch_size // dp) % mbs:
            continue
        m = global_batch_size // (dp * mbs)
        vps = [1] + ([v for v in ((fixed["vp"],) if fixed.get("vp", 1) > 1 else (2, 3, 4, 6, 8))
                      if config.num_layers % (pp * v) == 0 and m % pp == 0] if pp > 1 else [])
        for vp in vps:
            if fixed.get("vp", vp) != vp:
                continue
            for recompute in memory.RECOMPUTE:
                if fixed.get("recompute", recompute) != recompute:
                    continue
                for sp in (False, True) if tp > 1 else (False,):
                    split = 2 * cp * (tp if sp else 1) if cp > 1 else (tp if sp else 1)
                    if fixed.get("sp", "on" if sp else "off") != ("on" if sp else "off") or seq_len % split:
                        continue
                    for dp_mode in memory.DP_MODES if dp * cp > 1 else ("ddp",):
                        if fixed.get("dp_mode", dp_mode) == dp_mode:
                            yield pm.Plan(tp, cp, pp, vp, dp, mbs, recompute, sp, dp_mode)


def plan_memory(config, plan, *, seq_len, global_batch_size, software):
    precision = "bf16" if software.precision in ("bf16", "fp16") else "fp32"
    return memory.estimate(config, tp=plan.tp, cp=plan.cp, pp=plan.pp, dp=plan.dp, micro_batch_size=plan.mbs,
                           seq_len=seq_len, sequence_parallel=plan.sp, recompute=plan.recompute,
                           dp_mode=plan.dp_mode, precision=precision, virtual_stages=plan.vp,
                           schedule=plan.schedule, micro_batches=global_batch_size // (plan.dp * plan.mbs),
                           backend=software.backend)


def evaluate(config, plan, *, seq_len, global_batch_size, cluster, software, with_time=True):
    """One row: the plan, its memory, and (if it fits, or with_time) its modelled step."""
    est = plan_memory(config, plan, seq_len=seq_len, global_batch_size=global_batch_size, software=software)
    usable = cluster.memory - cluster.reserved
    row = {"tp": plan.tp, "cp": plan.cp, "pp": plan.pp, "vp": plan.vp, "dp": plan.dp, "mbs": plan.mbs,
           "recompute": plan.recompute, "sp": "on" if plan.sp else "off", "dp_mode": plan.dp_mode,
           "memory_per_gpu_gb": est.total / 1e9, "fits": est.total <= usable, "memory": est.as_dict()}
    if row["fits"] or with_time:
        row.update(pm.step_time(config, plan, seq_len=seq_len, global_batch_size=global_batch_size,
                                cluster=cluster, software=software))
    return row


def search(config, *, gpus, seq_len, global_batch_size, cluster, fixed=(), software=None):
    """(feasible rows best first, the smallest-memory infeasible row or None, number of candidate plans)."""
    software = software or software_of(cluster)
    rows, smallest, count = [], None, 0
    for plan in candidate_plans(config, gpus=gpus, seq_len=seq_len, global_batch_size=global_batch_size,
                                cluster=cluster, fixed=dict(fixed)):
        count += 1
        row = evaluate(config, plan, seq_len=seq_len, global_batch_size=global_batch_size, cluster=cluster,
                       software=software, with_time=False)
        if row["fits"]:
            rows.append(row)
        elif smallest is None or row["memory_per_gpu_gb"] < smallest["memory_per_gpu_gb"]:
            smallest = row
    rows.sort(key=rank_key)
    return rows, smallest, count


def rank_key(row):
    """Fastest first; plans the model times alike (to 9 digits: e.g. recompute hidden behind an exposed reduce, or
    cp·mbs constant) rank the simpler first — without cp, with less recompute, without interleaving, less memory."""
    return (-float(f"{row['tokens_per_s']:.9g}"), row["cp"], memory.RECOMPUTE.index(row["recompute"]), row["vp"],
            row["memory_per_gpu_gb"])


# ---- command line ---------------------------------------------------------------------------------------------------


def parse_fix(text):
    fixed = {}
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        if key not in FIXABLE or not value:
            raise ValueError(f"--fix {item!r}: expected KEY=VALUE with KEY one of {', '.join(FIXABLE)}")
        if key in fixed:
            raise ValueError(f"--fix {item!r}: {key} is given twice")
        try:
            fixed[key] = FIXABLE[key](value)
        except ValueError:
            raise ValueError(f"--fix {item!r}: {key} must be an integer") from None
        allowed = {"recompute": memory.RECOMPUTE, "sp": ("on", "off"), "dp_mode": memory.DP_MODES}.get(key)
        if allowed and value not in allowed:
            raise ValueError(f"--fix {item!r}: {key} must be one of {', '.join(allowed)}")
        if FIXABLE[key] is int and fixed[key] < 1:
            raise ValueError(f"--fix {item!r}: {key} must be >= 1")
    return fixed


def model_config(args):
    if args.hf_config:
        import transformers

        from models.hf import config_from_hf

        path = args.hf_config
        if os.path.isdir(path):
            hf = transformers.AutoConfig.from_pretrained(path)
        else:
            with open(path) as f:
                fields = json.load(f)
            hf = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        config = config_from_hf(hf)
        if config.position == "learned" and args.seq_len > config.max_seq_len:  # (RoPE may plan a longer context)
            raise ValueError(f"--seq-len {args.seq_len} exceeds the model's {config.max_seq_len} learned positions "
                             "(max_seq_len)")
        return config.replace(max_seq_len=max(args.seq_len, config.max_seq_len))
    if args.model:
        return models.GPTConfig(**(MODELS[args.model] | {"max_seq_len": max(args.seq_len,
                                                                          MODELS[args.model].get("max_seq_len", 0))}))
    return models.GPTConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                            num_heads=args.heads, num_kv_heads=args.kv_heads, ffn_hidden_size=args.ffn,
                            activation=args.activation, max_seq_len=args.seq_len)


def parser():
    p = argparse.ArgumentParser(prog="python -m bench.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hardware", choices=HARDWARE, default="h100-sxm")
    p.add_argument("--gpus", type=int, help="GPUs (CPU ranks on cpu-measured)")
    p.add_argument("--gpus-per-node", type=int, help="default: the profile's (8 for GPUs)")
    p.add_argument("--model", choices=sorted(MODELS), help="a named shape")
    p.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its directory)")
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--ffn", type=int)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--activation", choices=("gelu", "swiglu"), default="swiglu")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--global-batch-size", type=int, help="sequences per optimizer step")
    p.add_argument("--fix", help="pin plan fields: tp=8,pp=16,recompute=selective,sp=on,dp_mode=zero1,...")
    p.add_argument("--top", type=int, default=10, help="plans shown (and in --json); 0: all")
    p.add_argument("--json", action="store_true", help="print {'plans': [...]} best first instead of the table")
    p.add_argument("--out", metavar="DIR", help="write plans.json and plan.png (time breakdown of the top plans)")
    p.add_argument("--validate", action="store_true", help="predicted vs published runs and bench.train's CPU runs")
    return p


def check_args(p, args):
    if args.validate:
        return
    shape = [f for f in ("hidden", "layers", "heads") if getattr(args, f) is not None]
    sources = [bool(args.model), bool(args.hf_config), bool(shape)]
    if sum(sources) != 1:
        p.error("give one model: --model NAME, --hf-config PATH, or --hidden H --layers L --heads A")
    if shape and len(shape) < 3:
        p.error("--hidden, --layers and --heads go together")
    for name in ("gpus", "seq_len", "global_batch_size"):
        if getattr(args, name) is None:
            p.error(f"--{name.replace('_', '-')} is required")
    for name in ("gpus", "gpus_per_node", "seq_len", "global_batch_size", "hidden", "layers", "heads", "kv_heads",
                 "ffn", "vocab", "top"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "top" else 1):
            p.error(f"--{name.replace('_', '-')} {value} must be >= {0 if name == 'top' else 1}")


def no_plan_line(config, args, count, smallest, cluster):
    where = f"{args.gpus} GPUs of {cluster.name}"
    if count == 0:
        return (f"error: no split of {where} divides the model (heads {config.num_heads}, kv heads "
                f"{config.num_kv_heads}, ffn {config.ffn_hidden_size}), seq-len {args.seq_len} and global batch "
                f"{args.global_batch_size}" + (f" with --fix {args.fix}" if args.fix else ""))
    usable = (cluster.memory - cluster.reserved) / 1e9
    s = smallest
    return (f"error: no plan fits {where}: the least memory any of {count} splits needs is "
            f"{s['memory_per_gpu_gb']:.1f} GB per GPU (tp={s['tp']} cp={s['cp']} pp={s['pp']} vp={s['vp']} "
            f"dp={s['dp']} mbs={s['mbs']} recompute={s['recompute']} sp={s['sp']} dp_mode={s['dp_mode']}), "
            f"{s['memory_per_gpu_gb'] - usable:.1f} GB over the {usable:.1f} GB usable")


def print_plans(rows, config, args, cluster, count):
    from ..common import print_table

    print(f"{args.model or args.hf_config or 'model'}: {config.num_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_heads}/{config.num_kv_heads} heads, ffn {config.ffn_hidden_size} ({config.activation}), "
          f"vocab {config.vocab_size}; seq {args.seq_len}, global batch {args.global_batch_size}; {args.gpus} x "
          f"{cluster.name} ({cluster.device.gpus_per_node} per node); {len(rows)} of {count} plans fit")
    print_table(rows[:args.top] if args.top else rows, COLUMNS)
    best = rows[0]
    parts = ", ".join(f"{k} {v:.3g}" for k, v in best["breakdown"].items() if v > 0)
    print(f"best: {best['step_s']:.3g} s per step = {parts} (seconds per step; HFU {best['hfu']:.1%}, "
          f"{best['micro_batches']} micro-batches, slowest stage {best['slowest_stage']}); memory "
          + ", ".join(f"{k} {best['memory'][k] / 1e9:.2f}" for k in ("params", "grads", "optimizer", "activations",
                                                                       "transient")) + " GB")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [k for k in rows[0]["breakdown"] if any(r["breakdown"][k] > 0 for r in rows)]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.5))
    labels = [f"tp{r['tp']} cp{r['cp']} pp{r['pp']} vp{r['vp']} dp{r['dp']} mbs{r['mbs']} {r['recompute']} "
              f"sp-{r['sp']} {r['dp_mode']}" for r in rows]
    left = [0.0] * len(rows)
    for part in parts:
        widths = [r["breakdown"][part] for r in rows]
        ax.barh(labels, widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step (modelled)")
    ax.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / len(rows)))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    check_args(p, args)
    if args.out:
        from ..common import check_out

        check_out(p, "--out", args.out, directory=True)
    try:
        if args.validate:
            from .plan_validation import main as validate

            return validate(json_out=args.json, out=args.out)
        fixed = parse_fix(args.fix)
        cluster = cluster_of(args.hardware)
        if args.gpus_per_node:
            from dataclasses import replace

            cluster = replace(cluster, device=replace(cluster.device, gpus_per_node=args.gpus_per_node))
        config = model_config(args)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rows, smallest, count = search(config, gpus=args.gpus, seq_len=args.seq_len,
                                   global_batch_size=args.global_batch_size, cluster=cluster, fixed=fixed)
    if not rows:
        print(no_plan_line(config, args, count, smallest, cluster), file=sys.stderr)
        return 1
    top = rows[:args.top] if args.top else rows
    if args.json:
        print(json.dumps({"plans": top}, indent=1))
    else:
        print_plans(rows, config, args, cluster, count)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "plans.json"), "w") as f:
            json.dump({"plans": top, "hardware": cluster.name, "args": vars(args)}, f, indent=1)
        plot(top[:PLOTTED], os.path.join(args.out, "plan.png"))
    return 0

