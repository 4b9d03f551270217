"""The picture of a run: at the end of a run with --log-jsonl, PATH.png beside the log (loss and val_loss over the
optimizer steps, the learning rate under them), so a run can be looked at without TensorBoard. Needs matplotlib."""
import json
import os

SOFTWARE = "models.train (tp-layers)"  # the PNG's Software entry: how a later run knows the picture is its own



def plot_path(log: str) -> str:
    return os.path.splitext(log)[0] + ".png"


def drawn_by_models_train(path: str) -> bool:
    """Whether the file at `path` is a PNG that plot_log drew (its Software text entry, before the image data)."""
    with open(path, "rb") as f:
        head = f.read(4096)
    return head.startswith(b"\x89PNG") and b"Software\x00" + SOFTWARE.encode() in head


def plot_log(log: str) -> str:
    """Draw the JSONL log `log` into plot_path(log); returns that path."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    with open(log) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 1))
    for key, style in (("loss", "-"), ("val_loss", "o-")):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            top.plot(*zip(*points), style, label=key, markersize=4)
    top.set_ylabel("loss")
    top.legend()
    top.grid(alpha=0.3)
    lr = [(r["step"], r["lr"]) for r in rows if r.get("lr") is not None]
    if lr:
        bottom.plot(*zip(*lr), color="tab:green")
    bottom.set_ylabel("lr")
    bottom.set_xlabel("optimizer step")
    bottom.grid(alpha=0.3)
    top.set_title(os.path.basename(log))
    fig.tight_layout()
    path = plot_path(log)
    fig.savefig(path, dpi=100, metadata={"Software": SOFTWARE})
    plt.close(fig)
    return path
