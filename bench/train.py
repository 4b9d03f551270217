"""The training job's throughput per tp x (cp x) pp x dp split, and the pipeline bubble of every schedule, measured
beside the simulator's prediction.

    python -m bench.train [--steps 8] [--out PATH] [--plot PNG]   (default: a temporary folder)

Throughput: the training job on tp*cp*pp*dp gloo CPU ranks (one thread each) for 1x1x1, 2x1x1, 1x2x1, 1x1x2,
2x2x2 (tp x pp x dp) and, with context parallelism, 1x2x1x1 and 1x2x2x2 (tp x cp x pp x dp), the same model, global
batch and micro-batch size in every split, for each --dp-mode (ddp; zero1: the distributed optimizer, left out at
dp = 1 beside ddp) and --precision (fp32; bf16); tokens/s is the median over the steps after
the first of rank 0's per-step figure (global tokens / step wall time). Memory per rank: the first log row's
param/grad/optimizer bytes (tp.optim.memory_bytes, the largest over ranks), and their sum per parameter of the
largest pipeline stage beside the mixed-precision table of the ZeRO paper (bench.plan.memory.bytes_per_parameter).
CPU bf16 matmuls are slower than fp32 ones: the bf16 rows show memory and the loss curve, not a GPU's speed-up.

Bubble: tp.pipeline.PipelineRunner alone on pp = 2 and 4 ranks (tp = dp = 1), m = 1, 2, 4, 8 micro-batches,
GPipe, 1F1B, interleaved (V = 2 chunks per rank, where m is a multiple of p) and ZB-H1: idle time over p x the
schedule's span (bubble_rank), the median of --reps runs after one warm-up, beside tp.pipeline.schedules' simulation of
the same action lists with the F, B, W (or fused BW) times measured in those runs (per micro-batch through a whole
stage, the mean over stages), and (p-1)/(m+p-1). Every layer does the same work and the micro-batches are large, so
the stages are nearly balanced and compute outweighs the point-to-point transfers. The simulator assumes each action
takes the same time throughout; with more processes than cores (p = 4 on a 2-core CPU), or other load, stages that
compute at once share the cores, so an action's time depends on how many stages are busy, and the measured bubble
drifts from the prediction.
"""
import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist

import models
import tp
from models.stages import build_chunks
from models.training.cli import parser as train_parser
from models.training.cli import train, validate
from models.training.config import DP_MODES
from tp import testing
from tp.pipeline import PipelineRunner, schedules
from tp.pipeline.schedules import build, simulate

from .common import at_least, check_out, machine, median, print_table, scratch_path, write_json
from .plan.memory import bytes_per_parameter, stage_numel

SPLITS = [(1, 1, 1, 1), (2, 1, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2), (1, 2, 1, 1), (2, 1, 2, 2),
          (1, 2, 2, 2)]  # tp, cp, pp, dp


def split(text):
    """'TxPxD' (cp = 1) or 'TxCxPxD' -> (tp, cp, pp, dp)."""
    try:
        sizes = tuple(map(int, text.split("x")))
        if len(sizes) not in (3, 4):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"split {text!r} must be TxPxD or TxCxPxD (tp x cp x pp x dp), e.g. 2x1x2 "
                                         "or 1x2x1x2") from None
    return sizes if len(sizes) == 4 else (sizes[0], 1, *sizes[1:])


def label(t, c, p, d):
    """A split's name: TxPxD without context parallelism (as earlier results name them), else TxCxPxD."""
    return f"{t}x{p}x{d}" if c == 1 else f"{t}x{c}x{p}x{d}"


SCHEDULES = tuple(schedules.SCHEDULES)
VIRTUAL_STAGES = 2  # model chunks per rank of the schedules that interleave
NAMES = {name: kind.title + (f" V={VIRTUAL_STAGES}" if kind.interleaves else "")
         for name, kind in schedules.SCHEDULES.items()}


def theory(p, m):
    return (p - 1) / (m + p - 1)


def chunks(schedule):
    """Model chunks per rank the bubble part runs `schedule` with."""
    return VIRTUAL_STAGES if schedules.SCHEDULES[schedule].interleaves else 1


def runnable(schedule, p, m, layers, virtual_stages=VIRTUAL_STAGES):
    """Whether the schedule can run these sizes (interleaved: m a multiple of p, layers a multiple of p*V)."""
    if not schedules.SCHEDULES[schedule].interleaves:
        return True
    return m >= p and m % p == 0 and layers % (p * virtual_stages) == 0


def train_rank(flags):
    """models.train on these ranks; rank 0 returns its per-step log records."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        train(train_parser().parse_args([*flags, "--log-jsonl", log]))
        if dist.get_rank() != 0:
            return None
        with open(log) as f:
            return [json.loads(line) for line in f]


def bubble_rank(config, micro_batches, micro_batch_size, seq_len, reps):
    """On pp ranks: {(schedule, m): (pipeline bubble, a stage's own idle fraction (mean), (F, B, W) seconds per
    micro-batch through a whole stage)}, medians of `reps` runs (the times: means over the stages of each run's
    per-kind compute time / m; a fused backward counts as B, W = 0).

    The pipeline bubble (ScheduleStats.bubble) is the theory's quantity: idle time over p x the schedule's span (the
    stages start together; the span is the longest stage's wall time; waiting for an input counts as idle). A
    stage's own clock stops at its last operation, so the later stages, which finish first, miss the drain (kept in
    the JSON as `<schedule>_stages`, to show the difference).
    """
    torch.set_num_threads(1)
    mesh = tp.init_mesh(pp=dist.get_world_size())
    torch.manual_seed(0)
    runners = {1: PipelineRunner(build_chunks(config, mesh, 1)[0], mesh, micro_batch_size=micro_batch_size,
                                 seq_len=seq_len)}
    if config.num_layers % (mesh.pp_size * VIRTUAL_STAGES) == 0:  # (the chunks of an interleaved schedule)
        runners[VIRTUAL_STAGES] = PipelineRunner(build_chunks(config, mesh, VIRTUAL_STAGES), mesh,
                                                 micro_batch_size=micro_batch_size, seq_len=seq_len)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, max(micro_batches), micro_batch_size, seq_len), generator=g)
    result = {}
    for schedule in SCHEDULES:
        for m in micro_batches:
            if not runnable(schedule, mesh.pp_size, m, config.num_layers):
                continue
            runner = runners[chunks(schedule)]
            batches = list(zip(tokens[0, :m], tokens[1, :m]))
            bubbles, stages, costs = [], [], []
            for rep in range(reps + 1):  # the first is a warm-up
                dist.barrier()
                stats = runner.run(batches, schedule)
                t = stats.times
                own = torch.tensor([t["F"] / m, (t["B"] + t["BW"]) / m, t["W"] / m, 1 - stats.busy_s / stats.total_s],
                                   dtype=torch.float64)
                dist.all_reduce(own)  # summed over the stages
                if rep:
                    bubbles.append(stats.bubble)
                    stages.append(own[3].item() / mesh.pp_size)
                    costs.append((own[:3] / mesh.pp_size).tolist())
            for stage in runner.stages:
                stage.zero_grad(set_to_none=True)
            result[schedule, m] = median(bubbles), median(stages), [median(c[i] for c in costs) for i in range(3)]
    return result


def _train_flags(a, t, c, p, d):
    return ["--tp", str(t), "--cp", str(c), "--pp", str(p), "--dp", str(d), "--model", a.model, "--steps", str(a.steps),
            "--global-batch-size", str(a.global_batch_size), "--micro-batch-size", str(a.micro_batch_size),
            "--seq-len", str(a.seq_len)]


def bench_throughput(a):
    rows = []
    for t, c, p, d in a.splits:
        config = validate(train_parser().parse_args(_train_flags(a, t, c, p, d)))
        numel = max(stage_numel(config, t, p, stage) for stage in range(p))  # the largest stage's parameters
        for dp_mode in a.dp_mode:
            if dp_mode != "ddp" and d == 1 and "ddp" in a.dp_mode:  # (the same job)
                continue
            for precision in a.precision:
                flags = _train_flags(a, t, c, p, d) + ["--dp-mode", dp_mode, "--precision", precision]
                log = testing.run(train_rank, world_size=t * c * p * d, timeout=3600, flags=flags)[0]
                after_first = log[1:] or log
                memory = {k: log[0][k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")}
                rows.append({"split": label(t, c, p, d), "dp_mode": dp_mode, "precision": precision,
                             "ranks": t * c * p * d,
                             "micro_batches": a.global_batch_size // (d * a.micro_batch_size),
                             "tokens_per_s": median([r["tokens_per_s"] for r in after_first]),
                             "step_ms": 1e3 * median([r["step_s"] for r in after_first]),
                             "bubble": median([r["bubble"] for r in after_first]) if p > 1 else None,
                             "loss": log[-1]["loss"], **memory, "params_per_rank": numel,
                             **{k.replace("_bytes", "_kb"): v / 1e3 for k, v in memory.items()},
                             "bytes_per_param": sum(memory.values()) / numel,
                             "table_bytes_per_param": sum(bytes_per_parameter(precision, dp_mode, d))})
    for row in rows:  # vs 1x1x1 at the same precision (ddp), when run
        base = next((r for r in rows if r["split"] == "1x1x1" and r["precision"] == row["precision"]), rows[0])
        row["speedup"], row["baseline"] = row["tokens_per_s"] / base["tokens_per_s"], base["split"]
    return rows


def bench_bubble(a):
    config = models.GPTConfig(vocab_size=256, hidden_size=a.bubble_hidden, num_layers=a.bubble_layers, num_heads=4,
                              max_seq_len=a.bubble_seq)
    rows = []
    for p in a.pp:
        measured = testing.run(bubble_rank, world_size=p, timeout=3600, config=config, micro_batches=a.micro_batches,
                               micro_batch_size=a.bubble_micro_batch, seq_len=a.bubble_seq, reps=a.reps)[0]
        for m in a.micro_batches:
            row = {"p": p, "m": m, "theory": theory(p, m)}
            for schedule in SCHEDULES:
                if (schedule, m) not in measured:
                    continue
                bubble, row[f"{schedule}_stages"], (f, b, w) = measured[schedule, m]
                plan = build(schedule, p, m, chunks(schedule))
                row[schedule], row[f"{schedule}_sim"] = bubble, simulate(plan, (f, b, w)).bubble_fraction
                row[f"{schedule}_ms"] = [1e3 * f, 1e3 * b, 1e3 * w]
            rows.append(row)
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = sorted({r["p"] for r in rows})
    fig, axes = plt.subplots(1, len(ps), figsize=(5.5 * len(ps), 4), squeeze=False)
    colors = dict(zip(SCHEDULES, ("tab:blue", "tab:red", "tab:green", "tab:purple")))
    for ax, p in zip(axes[0], ps):
        mine = [r for r in rows if r["p"] == p]
        ms = [r["m"] for r in mine]
        ax.plot(ms, [r["theory"] for r in mine], color="grey", lw=3, alpha=0.4, label="(p-1)/(m+p-1)")
        for schedule in SCHEDULES:
            points = [r for r in mine if schedule in r]
            if points:
                ax.plot([r["m"] for r in points], [r[schedule] for r in points], "o-", color=colors[schedule],
                        label=f"{NAMES[schedule]}, measured")
                ax.plot([r["m"] for r in points], [r[f"{schedule}_sim"] for r in points], "x:", color=colors[schedule],
                        label=f"{NAMES[schedule]}, simulated (measured F/B/W)")
        ax.set(xscale="log", xticks=ms, xticklabels=ms, xlabel="micro-batches m", ylabel="bubble fraction",
               ylim=(0, 1), title=f"p = {p}: idle / (p x span)")
        ax.minorticks_off()
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Pipeline bubble per schedule ({machine().split(' (')[0]})", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="models.train preset (the demo's default: tiny)")
    p.add_argument("--splits", nargs="+", type=split, default=SPLITS, metavar="TxPxD|TxCxPxD",
                   help="tp x pp x dp (or tp x cp x pp x dp) splits to train")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dp-mode", nargs="+", choices=DP_MODES, default=["ddp"],
                   help="data-parallel modes of the throughput part (RESULTS.md: ddp zero1)")
    p.add_argument("--precision", nargs="+", choices=("fp32", "bf16"), default=["fp32"],
                   help="precisions of the throughput part (RESULTS.md: fp32 bf16)")
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes of the bubble part")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8], help="m of the bubble part")
    p.add_argument("--bubble-hidden", type=int, default=256, help="hidden size of the bubble's model")
    p.add_argument("--bubble-layers", type=int, default=8, help="layers of the bubble's model (interleaved runs "
                                                                "where they divide by 2p)")
    p.add_argument("--bubble-micro-batch", type=int, default=8)
    p.add_argument("--bubble-seq", type=int, default=128)
    p.add_argument("--reps", type=at_least(1), default=3, help="schedule runs per bubble point (after one warm-up)")
    p.add_argument("--skip", choices=("throughput", "bubble"), help="leave one part out")
    p.add_argument("--out", default=scratch_path("train.json"), help="JSON (bench/results/train.json: committed)")
    p.add_argument("--plot", default=None, help="bubble plot PNG (default: --out with .png)")
    a = p.parse_args(argv)
    check_out(p, "--out", a.out)
    if a.plot:
        check_out(p, "--plot", a.plot)
    for t, c, pp, d in a.splits if a.skip != "throughput" else []:  # a bad split: one usage error before any rank
        try:
            validate(train_parser().parse_args(_train_flags(a, t, c, pp, d)))
        except ValueError as e:
            p.error(f"split {label(t, c, pp, d)}: {e}")
    payload = {"machine": machine(), "load_average": os.getloadavg(), "args": vars(a)}
    if a.skip != "throughput":
        rows = payload["throughput"] = bench_throughput(a)
        print(f"\nmodels.train, model {a.model}, global batch {a.global_batch_size} x {a.seq_len} tokens, micro-batch "
              f"{a.micro_batch_size}, median of steps 2..{a.steps}, on {machine()}, gloo, one thread per rank")
        payload["throughput_table"] = print_table(rows, [
            ("split", "tp x (cp x) pp x dp", "{}"), ("dp_mode", "dp", "{}"), ("precision", "precision", "{}"),
            ("ranks", "ranks", "{}"), ("micro_batches", "micro-batches", "{}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
            ("speedup", f"vs {rows[0]['baseline']}", "{:.2f}"), ("step_ms", "step ms", "{:.1f}"),
            ("bubble", "bubble (idle / (p x span))", "{:.2f}"), ("loss", "last loss", "{:.3f}"),
            ("param_kb", "param KB/rank", "{:.0f}"), ("grad_kb", "grad KB/rank", "{:.0f}"),
            ("optimizer_kb", "optimizer KB/rank", "{:.0f}"),
            ("bytes_per_param", "bytes/param", "{:.2f}"), ("table_bytes_per_param", "ZeRO table", "{:.2f}")])
    if a.skip != "bubble":
        rows = payload["bubble"] = bench_bubble(a)
        print(f"\nPipeline bubble, idle / (p x span): measured | simulated with the measured F, B, W; "
              f"{a.bubble_layers} layers hidden {a.bubble_hidden}, micro-batch {a.bubble_micro_batch} x "
              f"{a.bubble_seq} tokens, median of {a.reps} runs")
        columns = [("p", "p", "{}"), ("m", "m", "{}"), ("theory", "(p-1)/(m+p-1)", "{:.3f}")]
        for schedule in SCHEDULES:
            columns += [(schedule, NAMES[schedule], "{:.3f}"), (f"{schedule}_sim", "sim", "{:.3f}")]
        for row in rows:
            row["zb_fbw"] = "/".join(f"{t:.0f}" for t in row["zb_ms"]) if "zb_ms" in row else None
        payload["bubble_table"] = print_table(rows, columns + [("zb_fbw", "ZB F/B/W ms", "{}")])
        plot(rows, a.plot or os.path.splitext(a.out)[0] + ".png")
    write_json(a.out, payload)


if __name__ == "__main__":
    main()
