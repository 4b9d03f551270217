"""The checkpoint directory convention of the training job: ROOT/step-N directories, ROOT/latest naming the newest
complete one (written last, so a crash mid-save never spoils the previous checkpoint)."""
import os


def saved_step(path):
    """The step of a checkpoint directory named step-N (as --save writes them), else None."""
    name = os.path.basename(os.path.normpath(path))
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


def latest(root):
    """The checkpoint --load reads: ROOT/latest's step directory, else ROOT's newest step-N, else ROOT itself."""
    latest = os.path.join(root, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            return os.path.join(root, f.read().strip())
    steps = [name for name in os.listdir(root) if saved_step(name) is not None
             and os.path.isdir(os.path.join(root, name))]
    return os.path.join(root, max(steps, key=saved_step)) if steps else root
