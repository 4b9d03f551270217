"""The pipeline schedule simulator: bubble fraction, peak activations and the timeline picture of a schedule.

    python -m bench.schedule --pp 4 --micro-batches 8 --schedule zb [--virtual-stages V] [--costs F,B,W] [--json]
                             [--out DIR]

Runs tp.pipeline.schedules' action lists for p ranks and m micro-batches (V model chunks per rank for 'interleaved')
against unit costs or the given F,B,W (of one micro-batch through a whole rank's layers; a fused backward costs B+W,
a chunk 1/V), every action starting as soon as its rank is free and its input has arrived. Prints the bubble
fraction (idle / (stages x span)), the peak activations (the most forward chunks awaiting their B on any rank, in
micro-batches through a whole stage) and, for unit costs, the closed form; `--json` prints one JSON object instead
(keys bubble_fraction, peak_activations, ...); `--out DIR` writes DIR/<schedule>_p<P>_m<M>[_v<V>].png, one row per
stage, F/B/W coloured, micro-batch numbers in the boxes.
"""
import argparse
import json
import os
import sys

from tp.pipeline.schedules import SCHEDULES, ScheduleError, build, simulate

COLOURS = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452", "BW": "#2e7d4f"}


def closed_form(name, p, m, virtual_stages):
    """The unit-cost bubble fraction the literature gives (an upper bound for some: SCHEDULES[name].bubble_bound)."""
    return SCHEDULES[name].bubble(p, m, virtual_stages)


def costs(text):
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or any(not v > 0 or v == float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} must be three finite positive numbers F,B,W, e.g. 1,2,1")
    return values


def draw(timeline, path):
    """The timeline as the papers draw it: one row per stage (rank), a box per action, its micro-batch inside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    schedule = timeline.schedule
    p, virtual_stages = schedule.pp, schedule.virtual_stages
    boxes = sum(len(order) for order in schedule.actions) / p  # actions per row
    fig, ax = plt.subplots(figsize=(min(16.0, 3 + 0.3 * boxes), 0.5 * p + 1.3))
    for rank, intervals in enumerate(timeline.intervals):
        for start, end, action in intervals:
            light = virtual_stages > 1 and action.chunk % 2 == 1  # odd chunks lighter, to tell the chunks apart
            ax.barh(rank, end - start, left=start, height=0.8, color=COLOURS[action.kind], alpha=0.5 if light else 1,
                    edgecolor="black", linewidth=0.5)
            ax.text((start + end) / 2, rank, str(action.micro), ha="center", va="center",
                    fontsize=7 if virtual_stages == 1 else 6, color="black" if light or action.kind == "W" else "white")
    kinds = sorted({a.kind for order in schedule.actions for a in order}, key=["F", "B", "BW", "W"].index)
    names = {"F": "F (forward)", "B": "B (input grad)", "W": "W (weight grad)", "BW": "BW (fused backward)"}
    ax.legend(handles=[Patch(facecolor=COLOURS[k], label=names[k]) for k in kinds],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(kinds), fontsize=8, frameon=False)
    ax.set(yticks=range(p), yticklabels=[f"stage {r}" for r in range(p)], xlim=(0, timeline.span),
           xlabel="time (F = {:g}, B = {:g}, W = {:g} per micro-batch and stage)".format(*timeline.costs))
    ax.invert_yaxis()
    chunks = f", V={virtual_stages} (odd chunks lighter)" if virtual_stages > 1 else ""
    ax.set_title(f"{schedule.name}: p={p}, m={schedule.micro_batches}{chunks}; bubble "
                 f"{timeline.bubble_fraction:.3f}, peak activations {timeline.peak_activations:.2f}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.schedule", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, required=True, help="pipeline stages (ranks)")
    p.add_argument("--micro-batches", type=int, required=True, help="micro-batches per step")
    p.add_argument("--schedule", choices=tuple(SCHEDULES), required=True)
    p.add_argument("--virtual-stages", type=int, default=1, help="model chunks per rank (interleaved)")
    p.add_argument("--costs", type=costs, default=(1.0, 1.0, 1.0), metavar="F,B,W",
                   help="time of a forward, an input-grad backward and a weight-grad backward of one micro-batch "
                        "through a whole stage")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--out", metavar="DIR", help="write the timeline PNG into DIR")
    a = p.parse_args(argv)
    try:
        schedule = build(a.schedule, a.pp, a.micro_batches, a.virtual_stages)
    except ScheduleError as e:
        p.error(str(e))
    timeline = simulate(schedule, a.costs)
    unit = a.costs == (1.0, 1.0, 1.0)
    result = {"schedule": a.schedule, "pp": a.pp, "micro_batches": a.micro_batches,
              "virtual_stages": a.virtual_stages, "costs": list(a.costs),
              "bubble_fraction": timeline.bubble_fraction, "peak_activations": timeline.peak_activations,
              "span": timeline.span, "closed_form": closed_form(a.schedule, a.pp, a.micro_batches, a.virtual_stages)
              if unit else None}
    if a.out:
        suffix = f"_v{a.virtual_stages}" if a.virtual_stages > 1 else ""
        try:
            result["png"] = draw(timeline, os.path.join(a.out, f"{a.schedule}_p{a.pp}_m{a.micro_batches}{suffix}.png"))
        except OSError as e:
            p.error(f"--out {a.out}: {e.strerror or e}")
    if a.json:
        print(json.dumps(result))
        return 0
    print(f"{a.schedule}: p={a.pp}, m={a.micro_batches}, V={a.virtual_stages}, costs F,B,W = "
          f"{','.join(f'{c:g}' for c in a.costs)}")
    print(f"  bubble fraction  {timeline.bubble_fraction:.4f}" + (
        f"   (closed form {result['closed_form']:.4f}{' upper bound' if SCHEDULES[a.schedule].bubble_bound else ''})"
        if result["closed_form"] is not None else ""))
    print(f"  peak activations {timeline.peak_activations:.3f} micro-batches   (per stage: "
          f"{', '.join(f'{x:g}' for x in timeline.peaks)})")
    print(f"  span             {timeline.span:g}")
    if a.out:
        print(f"wrote {result['png']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
