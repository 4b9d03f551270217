"""A parallelism planner: every feasible tp × cp × pp (× virtual stages) × dp split, micro-batch, recompute, SP and dp
mode for a model on N GPUs, ranked by modelled tokens/s, with per-GPU memory from bench.plan.memory and step time from
bench/plan/step_time.py (the same hardware profiles as bench.intensity, bench/roofline.py).

    python -m bench.plan --hardware h100-sxm --gpus 1024 --model llama3-70b --seq-len 8192 --global-batch-size 1024
    python -m bench.plan --hardware a100-80g --gpus 64 --hidden 12288 --layers 96 --heads 96 --activation gelu \\
        --vocab 51200 --seq-len 2048 --global-batch-size 64 --fix tp=8,pp=8 --top 5 [--json] [--out DIR]
    python -m bench.plan --validate        # predicted vs published MFU/HFU, and vs bench.train's CPU runs
    python -m bench.plan --check-mfu mfu.json   # predicted vs bench.mfu's measured one-device steps

Feasible: the sizes divide (heads, kv heads, FFN and the padded vocabulary by tp; the sequence by 2·cp, and by tp
under SP; the layers by pp·vp for interleaving, Megatron's micro-batches by pp), the global batch splits into
dp × micro-batch, tp stays within a node (unless --fix tp=...), and the estimated memory of the largest stage fits
the GPU's (less its `reserved` allowance). No feasible plan: one line saying what does not fit and by how much
(exit 1). --fix pins any of tp, cp, pp, vp, dp, mbs, recompute (none|selective|full, or Megatron's recompute modules
joined by "+": layernorm+moe_act), sp (on|off), dp_mode (ddp|zero1|fsdp), ep, etp, dispatcher
(alltoall|allgather|deepep), an uneven pipeline split (first_layers, last_layers: Megatron's
--decoder-first/last-pipeline-num-layers; account=embedding|loss|embedding+loss: --account-for-*-in-pipeline-split)
and grad_reduce (fp32|bf16); a --fix no split can satisfy names the constraint that fails. --software prices another
implementation (its kernels, overlaps and optimizer: bench.plan.software). Searches longer than 5 s report progress
on stderr. --out DIR writes plans.json and plan.png (the time breakdown of the top 12 or --top).
"""
import argparse
import json
import os
import sys
from dataclasses import replace

from models.config import GPTConfig
from models.hf import config_from_hf
from models.presets import MODELS

from ..common import check_out, print_table
from .feasibility import fix_conflict
from .hardware import CLUSTERS, CPU_MEASURED, PROFILES, cpu_cluster
from .measured import check_mfu
from .memory import DP_MODES
from .moe_time import CHOICES as DISPATCHERS
from .recompute import parse as parse_recompute
from .search import search
from .software import OURS_CPU, SOFTWARE
from .validation import cpu_op_overhead, validate

PLOTTED = 12  # bars in plan.png at most
USAGE = """python -m bench.plan --gpus N --seq-len S --global-batch-size B
           (--model NAME | --hf-config PATH | --hidden H --layers L --heads A [--kv-heads K] [--ffn F])
           [--hardware PROFILE] [--software NAME] [--fix KEY=VALUE,...] [--top N] [--json] [--out DIR]
       python -m bench.plan --validate
       python -m bench.plan --check-mfu PATH"""
# --fix's keys (the table's and the JSON's names) and their types
FIXABLE = {"tp": int, "cp": int, "pp": int, "vp": int, "dp": int, "mbs": int, "recompute": str, "sp": str,
           "dp_mode": str, "ep": int, "etp": int, "dispatcher": str, "first_layers": int, "last_layers": int,
           "account": str, "grad_reduce": str}
ACCOUNT = ("none", "embedding", "loss", "embedding+loss")  # account=: Megatron's --account-for-*-in-pipeline-split
GRAD_REDUCE = ("fp32", "bf16")
COLUMNS = [("tp", "tp", "{}"), ("cp", "cp", "{}"), ("pp", "pp", "{}"), ("vp", "vp", "{}"), ("dp", "dp", "{}"),
           ("mbs", "mbs", "{}"), ("recompute", "recompute", "{}"), ("sp", "sp", "{}"), ("dp_mode", "dp_mode", "{}"),
           ("memory_per_gpu_gb", "memory/GPU GB", "{:.1f}"), ("step_s", "step s", "{:.3g}"),
           ("tokens_per_s", "tokens/s", "{:,.0f}"), ("mfu", "MFU", "{:.1%}")]


def cluster_of(name, gpus_per_node=None):
    """The node profile `--hardware` names; cpu-measured: bench.intensity's measurements with the per-op overhead
    fitted to bench.train's 1x1x1 run. `gpus_per_node` moves the node boundary."""
    cluster = cpu_cluster(op_overhead=cpu_op_overhead()) if name == CPU_MEASURED else CLUSTERS[name]
    if gpus_per_node:
        cluster = replace(cluster, device=replace(cluster.device, gpus_per_node=gpus_per_node))
    return cluster


def chosen_software(name, cluster, fixed):
    """The Software --software names (this package in fp32 on the CPU profile), with --fix's gradient reduction;
    ValueError when it cannot run what --fix asks (a dispatcher or dp mode it lacks, bf16 reduction it does not do)."""
    software = OURS_CPU if name == "ours" and cluster.cores else SOFTWARE[name]
    if fixed.get("dispatcher", software.dispatchers[0]) not in software.dispatchers:
        raise ValueError(f"--fix dispatcher={fixed['dispatcher']}: --software {name} implements "
                         f"{', '.join(software.dispatchers)}")
    if fixed.get("dp_mode") in software.lacks_dp_modes:
        runs = [mode for mode in DP_MODES if mode not in software.lacks_dp_modes]
        raise ValueError(f"--fix dp_mode={fixed['dp_mode']}: --software {name} does not run it (it runs "
                         f"{', '.join(runs)})")
    if fixed.get("grad_reduce") == "bf16":
        if not software.bf16_grad_reduce:
            raise ValueError(f"--fix grad_reduce=bf16: --software {name} reduces gradients in fp32 "
                             f"({software.optimizer})")
        software = replace(software, grad_bytes=2)
    return software


def report_progress(done, total, feasible, seconds):
    """A long search's progress line on stderr."""
    print(f"bench.plan: {done:,} of {total:,} plans evaluated, {feasible:,} fit ({seconds:.0f} s)", file=sys.stderr,
          flush=True)


def parse_fix(text):
    """--fix KEY=VALUE,... as {key: value}; a ValueError naming the item for an unknown key, a repeated one or a value
    out of range."""
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
        if key == "recompute":
            try:
                fixed[key] = parse_recompute(value)
            except ValueError as e:
                raise ValueError(f"--fix {item!r}: {e}") from None
        allowed = {"sp": ("on", "off"), "dp_mode": DP_MODES, "dispatcher": DISPATCHERS, "account": ACCOUNT,
                   "grad_reduce": GRAD_REDUCE}.get(key)
        if allowed and value not in allowed:
            raise ValueError(f"--fix {item!r}: {key} must be one of {', '.join(allowed)}")
        if FIXABLE[key] is int and fixed[key] < (0 if key.endswith("_layers") else 1):
            raise ValueError(f"--fix {item!r}: {key} must be >= {0 if key.endswith('_layers') else 1}")
    return fixed


def read_json(path, flag):
    """The JSON object of the file a flag names; an unreadable file is one ValueError line naming both."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {path}: not JSON ({e})") from None


def read_hf_config(path, seq_len):
    """The GPTConfig of a Hugging Face config.json (or the directory holding it), its positions covering `seq_len`:
    RoPE may plan a longer context than the model was trained on, learned positions may not."""
    import transformers  # (only here: it takes seconds to import)

    fields = read_json(os.path.join(path, "config.json") if os.path.isdir(path) else path, "--hf-config")
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ValueError(f"--hf-config {path}: no model_type (a Hugging Face config.json names its family)")
    hf = transformers.AutoConfig.for_model(**fields)
    shape = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"]
    aliases = getattr(hf, "attribute_map", {})  # (GPT-2's n_embd, n_layer, n_head)
    missing = [f"{name} ({aliases[name]})" if name in aliases else name for name in shape
               if hasattr(hf, name) and name not in fields and aliases.get(name) not in fields]
    if missing:
        raise ValueError(f"--hf-config {path}: no {', '.join(missing)} (transformers' defaults would stand in for the "
                         "model's)")
    config = config_from_hf(hf)
    if config.position == "learned" and seq_len > config.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's {config.max_seq_len} learned positions "
                         "(max_seq_len)")
    return config.replace(max_seq_len=max(seq_len, config.max_seq_len))


def config_to_plan(args):
    """The GPTConfig the command line names: --hf-config, a --model shape, or --hidden, --layers, --heads and the
    other size flags; its positions cover --seq-len."""
    if args.hf_config:
        return read_hf_config(args.hf_config, args.seq_len)
    if args.model:
        shape = MODELS[args.model]
        return GPTConfig(**(shape | {"max_seq_len": max(args.seq_len, shape.get("max_seq_len", 0))}))
    experts = dict(num_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                   moe_ffn_hidden_size=args.moe_ffn_hidden_size) if args.num_experts else {}
    return GPTConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                     num_kv_heads=args.kv_heads, ffn_hidden_size=args.ffn, activation=args.activation,
                     max_seq_len=args.seq_len, **experts)


def parser():
    p = argparse.ArgumentParser(prog="python -m bench.plan", description=__doc__, usage=USAGE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hardware", choices=PROFILES, default="h100-sxm")
    p.add_argument("--software", choices=tuple(SOFTWARE), default="ours",
                   help="whose implementation to price: its kernels, overlaps and optimizer (bench.plan.software)")
    p.add_argument("--gpus", type=int,
                   help="GPUs (CPU ranks on cpu-measured); required (but with --validate, --check-mfu)")
    p.add_argument("--gpus-per-node", type=int, help="default: the profile's (8 for GPUs)")
    p.add_argument("--model", choices=tuple(MODELS), help="a named shape (models/presets.py; models.train takes the "
                                                            "same names)")
    p.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its directory)")
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--ffn", type=int)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--activation", choices=("gelu", "swiglu"), default="swiglu")
    p.add_argument("--num-experts", type=int, help="a mixture of experts in every layer's MLP (with --hidden ...)")
    p.add_argument("--moe-router-topk", type=int, default=2, help="experts per token (with --num-experts)")
    p.add_argument("--moe-ffn-hidden-size", type=int, help="each expert's FFN (default --ffn)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence; required (but with --validate, --check-mfu)")
    p.add_argument("--global-batch-size", type=int,
                   help="sequences per optimizer step; required (but with --validate, --check-mfu)")
    p.add_argument("--fix", help="pin plan fields: tp=8,pp=16,recompute=selective,sp=on,dp_mode=zero1,...")
    p.add_argument("--top", type=int, default=10, help="plans shown (and in --json); 0: all")
    p.add_argument("--json", action="store_true", help="print {'plans': [...]} best first instead of the table")
    p.add_argument("--out", metavar="DIR", help="write plans.json and plan.png (time breakdown of the top plans)")
    p.add_argument("--validate", action="store_true", help="predicted vs published runs and bench.train's CPU runs")
    p.add_argument("--check-mfu", metavar="PATH", help="predicted vs measured step time of each row of bench.mfu's "
                                                       "JSON (the one-device plan on the device's profile)")
    return p


def check_args(p, args):
    """One usage error (exit 2) for a missing or contradictory model, size or count."""
    if args.validate or args.check_mfu:
        return
    shape = [f for f in ("hidden", "layers", "heads") if getattr(args, f) is not None]
    sources = [bool(args.model), bool(args.hf_config), bool(shape)]
    if sum(sources) > 1:
        p.error("give one model: --model NAME, --hf-config PATH, or --hidden H --layers L --heads A")
    if shape and len(shape) < 3:
        p.error("--hidden, --layers and --heads go together")
    missing = [f"--{name.replace('_', '-')}" for name in ("gpus", "seq_len", "global_batch_size")
               if getattr(args, name) is None]
    if not any(sources):
        missing.append("a model (--model NAME, --hf-config PATH, or --hidden H --layers L --heads A)")
    if missing:  # all at once, not one per try
        p.error(f"missing {', '.join(missing)} (see the usage above)")
    if (args.num_experts or args.moe_ffn_hidden_size) and not shape:
        p.error("--num-experts and --moe-ffn-hidden-size go with --hidden H --layers L --heads A (--model and "
                "--hf-config name their own experts)")
    if args.num_experts and args.moe_router_topk > args.num_experts:
        p.error(f"--moe-router-topk {args.moe_router_topk} > --num-experts {args.num_experts}")
    for name in ("gpus", "gpus_per_node", "seq_len", "global_batch_size", "hidden", "layers", "heads", "kv_heads",
                 "ffn", "vocab", "top", "num_experts", "moe_router_topk", "moe_ffn_hidden_size"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "top" else 1):
            p.error(f"--{name.replace('_', '-')} {value} must be >= {0 if name == 'top' else 1}")


def no_plan_line(config, args, count, smallest, cluster):
    """The one error line when no plan fits: nothing divides, or the least memory any split needs, and the excess."""
    where = f"{args.gpus} GPUs of {cluster.name}"
    if count == 0:
        return (f"error: no split of {where} divides the model (heads {config.num_heads}, kv heads "
                f"{config.num_kv_heads}, ffn {config.ffn_hidden_size}), seq-len {args.seq_len} and global batch "
                f"{args.global_batch_size}" + (f" with --fix {args.fix}" if args.fix else ""))
    usable = (cluster.memory - cluster.reserved) / 1e9
    s = smallest
    return (f"error: no plan fits {where}: the least memory any of {count} splits needs is "
            f"{s['memory_per_gpu_gb']:.1f} GB per GPU (tp={s['tp']} cp={s['cp']} pp={s['pp']} vp={s['vp']} "
            f"dp={s['dp']} mbs={s['mbs']} recompute={s['recompute']} sp={s['sp']} dp_mode={s['dp_mode']}"
            + (f" split={s['split']}" if s["split"] != "even" else "") + "), "
            f"{s['memory_per_gpu_gb'] - usable:.1f} GB over the {usable:.1f} GB usable")


def table_columns(config, shown):
    """COLUMNS, with ep, etp and the dispatcher for a mixture of experts and the stage split where a shown plan is
    uneven."""
    columns = list(COLUMNS)
    if any(r["split"] != "even" for r in shown):
        columns.insert(4, ("split", "split", "{}"))
    if config.num_experts:
        at = columns.index(("dp_mode", "dp_mode", "{}")) + 1
        columns[at:at] = [("ep", "ep", "{}"), ("etp", "etp", "{}"), ("dispatcher", "dispatcher", "{}")]
    return columns


def print_plans(rows, config, args, cluster, count):
    """The model and cluster line, the table of plans, and the best plan's time and memory breakdown."""
    experts = (f", {config.num_experts} experts top-{config.moe_router_topk} ffn {config.moe_ffn_hidden_size} "
               f"({best_params(rows)})") if config.num_experts else ""
    mtp = f", {config.mtp_num_layers} MTP depth(s)" if config.mtp_num_layers else ""
    print(f"{args.model or args.hf_config or 'model'}: {config.num_layers} layers, hidden {config.hidden_size}, "
          f"{attention_shape(config)}, ffn {config.ffn_hidden_size} ({config.activation}), "
          f"vocab {config.vocab_size}{experts}{mtp}; seq {args.seq_len}, global batch {args.global_batch_size}; "
          f"{args.gpus} x {cluster.name} ({cluster.device.gpus_per_node} per node); {len(rows):,} of {count:,} plans "
          "fit"
          + (f"; priced as {SOFTWARE[args.software].describe()}" if args.software != "ours" else ""))
    shown = rows[:args.top] if args.top else rows
    print_table(shown, table_columns(config, shown))
    best = rows[0]
    parts = ", ".join(f"{k} {v:.3g}" for k, v in best["breakdown"].items() if v > 0)
    print(f"best: {best['step_s']:.3g} s per step = {parts} (seconds per step; HFU {best['hfu']:.1%}, "
          f"{best['micro_batches']} micro-batches, slowest stage {best['slowest_stage']}); memory "
          + ", ".join(f"{k} {best['memory'][k] / 1e9:.2f}" for k in ("params", "grads", "optimizer", "activations",
                                                                       "transient")) + " GB")


def attention_shape(config):
    """The header's attention: "a/k heads", or multi-head latent attention's heads, widths and latent ranks."""
    c = config
    if not c.multi_latent_attention:
        return f"{c.num_heads}/{c.num_kv_heads} heads"
    return (f"{c.num_heads} MLA heads (q·k {c.qk_head_dim}, v {c.v_head_dim}; latents q {c.q_lora_rank or 'none'}, "
            f"kv {c.kv_lora_rank} + rope {c.qk_rope_head_dim})")


def best_params(rows):
    return f"{rows[0]['active_params'] / 1e9:.3g}B active of {rows[0]['total_params'] / 1e9:.3g}B"


def plot(rows, path):
    """plan.png: each plan's modelled step as stacked bars of its time breakdown."""
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


def write_out(directory, top, cluster, args):
    """--out: plans.json (the shown plans, the profile's name, the arguments) and plan.png (their time breakdown)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "plans.json"), "w") as f:
        json.dump({"plans": top, "hardware": cluster.name, "args": vars(args)}, f, indent=1)
    plot(top[:PLOTTED], os.path.join(directory, "plan.png"))


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    check_args(p, args)
    if args.out:
        check_out(p, "--out", args.out, directory=True)
    try:
        if args.validate:
            return validate(json_out=args.json, out=args.out)
        if args.check_mfu:
            try:
                check_mfu(read_json(args.check_mfu, "--check-mfu"))
            except (KeyError, TypeError) as e:  # (a field missing, or not an object)
                raise ValueError(f"--check-mfu {args.check_mfu}: not bench.mfu's JSON "
                                 f"({f'no {e}' if isinstance(e, KeyError) else e})") from None
            return 0
        fixed = parse_fix(args.fix)
        cluster = cluster_of(args.hardware, args.gpus_per_node)
        per_node = cluster.device.gpus_per_node
        if per_node and args.gpus > per_node and args.gpus % per_node:  # (the groups' placement assumes whole nodes)
            raise ValueError(f"--gpus {args.gpus} is not a whole number of {cluster.name}'s {per_node}-GPU nodes"
                             + ("" if args.gpus_per_node else " (--gpus-per-node sets another node size)"))
        config = config_to_plan(args)
        software = chosen_software(args.software, cluster, fixed)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rows, smallest, count = search(config, gpus=args.gpus, seq_len=args.seq_len,
                                   global_batch_size=args.global_batch_size, cluster=cluster, fixed=fixed,
                                   software=software, progress=report_progress)
    if not rows:
        conflict = fix_conflict(config, gpus=args.gpus, seq_len=args.seq_len,
                                global_batch_size=args.global_batch_size, fixed=fixed) if count == 0 else None
        print(f"error: --fix {args.fix}: {conflict}" if conflict else no_plan_line(config, args, count, smallest,
                                                                                   cluster), file=sys.stderr)
        return 1
    top = rows[:args.top] if args.top else rows
    if args.json:
        print(json.dumps({"plans": top}, indent=1))
    else:
        print_plans(rows, config, args, cluster, count)
    if args.out:
        write_out(args.out, top, cluster, args)
    return 0
