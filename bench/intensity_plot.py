"""intensity.png for bench.intensity: three panels.

1. Arithmetic intensity of the MLP's per-rank GEMMs vs shard size F/TP, one line per token count, with the modelled
   hardware's ridge: below it a GEMM is memory-bound and the GPU's FLOPs go unused.
2. Achieved FLOP/s of every measured local GEMM vs its intensity (in the measured dtype), under this machine's
   measured roofline min(peak, intensity x copy bandwidth).
3. MLP-forward compute vs communication time per TP degree on the modelled hardware, for the headline shape.
"""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PHASE_COLORS = {"fwd": "tab:blue", "dgrad": "tab:orange", "wgrad": "tab:green"}


def _same_layer(row, headline):
    return (row["hidden"], row["ffn"], row["mlp"]) == (headline["hidden"], headline["ffn"], headline["mlp"])


def _intensity(ax, hw, headline, tps):
    rows = [r for r in tps if _same_layer(r, headline)]
    for tokens in sorted({r["tokens"] for r in rows}):
        line = sorted((r for r in rows if r["tokens"] == tokens), key=lambda r: r["tp"])
        ax.plot([r["ffn_shard"] for r in line], [r["mlp_min_intensity"] for r in line], "o-", ms=3, label=f"T={tokens}")
    for r in (r for r in rows if r["tokens"] == headline["tokens"]):
        ax.annotate(f"TP{r['tp']}", (r["ffn_shard"], r["mlp_min_intensity"]), fontsize=7, xytext=(2, 4),
                    textcoords="offset points")
    ax.axhline(hw.ridge, color="red", ls="--", label=f"{hw.name} ridge {hw.ridge:.0f}: memory-bound below")
    ax.set(xscale="log", yscale="log", xlabel="shard size F/TP", ylabel=f"FLOP/byte ({hw.dtype})",
           title=f"MLP GEMM intensity\nD={headline['hidden']} F={headline['ffn']} ({headline['mlp']})")
    ax.set_ylim(bottom=min(r["mlp_min_intensity"] for r in rows) / 20)  # room for the legend
    ax.invert_xaxis()  # more TP to the right: the shard shrinks
    ax.legend(fontsize=7, loc="lower center", ncol=3)


def _roofline(ax, gemms, measured):
    if not measured or not measured["gemms"]:
        ax.text(0.5, 0.5, "not measured (--no-measure)", ha="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    seen = {}
    for r in gemms:
        if r["measured_flops"] is not None:
            seen[(r["phase"], r["M"], r["K"], r["N"])] = r
    for phase, color in PHASE_COLORS.items():
        pts = [r for r in seen.values() if r["phase"] == phase]
        ax.scatter([r["measured_intensity"] for r in pts], [r["measured_flops"] / 1e9 for r in pts], s=8,
                   color=color, label=f"torch {phase}")
        kern = [r for r in pts if r["kernels_flops"] is not None]
        if kern:
            ax.scatter([r["measured_intensity"] for r in kern], [r["kernels_flops"] / 1e9 for r in kern], s=12,
                       marker="x", color=color, label=f"kernels.linear {phase}")
    xs = sorted(r["measured_intensity"] for r in seen.values())
    peak, bandwidth = measured["peak_flops"], measured["bandwidth"]
    grid = [xs[0] * (xs[-1] / xs[0]) ** (i / 100) for i in range(101)] if xs[-1] > xs[0] else xs
    ax.plot(grid, [min(peak, x * bandwidth) / 1e9 for x in grid], "k-", label="roofline (measured)")
    ax.axvline(peak / bandwidth, color="red", ls="--", label=f"ridge {peak / bandwidth:.0f}")
    cache = "\n(CPU: warm caches can beat the copy-bandwidth roofline)" if "CPU" in measured["device"] else ""
    ax.set(xscale="log", yscale="log", xlabel=f"FLOP/byte ({measured['dtype']})", ylabel="GFLOP/s",
           title=f"measured local GEMMs, {measured['device'].split(' (')[0]}{cache}")
    ax.legend(fontsize=7, loc="lower right")


def _times(ax, hw, headline, tps):
    line = sorted((r for r in tps if _same_layer(r, headline) and r["tokens"] == headline["tokens"]),
                  key=lambda r: r["tp"])
    tp = [r["tp"] for r in line]
    us = lambda key: [1e6 * r[key] for r in line]  # noqa: E731
    ax.plot(tp, us("mlp_fwd_compute_s"), "o-", label="compute (roofline)")
    ax.plot(tp[1:], us("mlp_fwd_comm_s")[1:], "s-", label="comm: AG+RS at W (scaling book)")  # TP=1: none
    ax.plot(tp[1:], us("pair_fwd_comm_ring_s")[1:], "s--", label="comm: ring, (TP-1)/TP")
    ax.plot(tp, [c + m for c, m in zip(us("mlp_fwd_compute_s"), us("mlp_fwd_comm_s"))], ":", color="gray",
            label="serialised step")
    if hw.name == "cpu-measured":
        measured = [(r["tp"], 1e6 * r["measured_all_reduce_s"]) for r in line if r["measured_all_reduce_s"]]
        if measured:
            ax.plot(*zip(*measured), "k^", label="comm: measured all-reduce")
    ax.axvline(headline["max_tp_overlapped"], color="red", ls="--", label=f"max TP {headline['max_tp_overlapped']}")
    ax.set(xscale="log", yscale="log", xlabel="TP degree", ylabel="microseconds",
           title=f"MLP forward per rank\n{hw.name}, T={headline['tokens']}")
    ax.set_xticks(tp, [str(t) for t in tp])
    ax.legend(fontsize=7)


def plot(path, hw, headline, tps, gemms, measured):
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    _intensity(axes[0], hw, headline, tps)
    _roofline(axes[1], gemms, measured)
    _times(axes[2], hw, headline, tps)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")
