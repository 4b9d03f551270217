"""The checkpoint directory convention of the training job: ROOT/step-N directories, ROOT/latest naming the newest
complete one.

A save writes ROOT/step-N (torch.distributed.checkpoint writes its `.metadata` last, after every rank's shards), then
moves ROOT/latest (an atomic rename): `latest` is the commit point. A step directory that `latest` has not reached
(the job died mid-save) or that has no `.metadata` is half-written: never read, and removed by the next save.
"""
import os
import shutil


def saved_step(path: str) -> int | None:
    """The step of a checkpoint directory named step-N (as --save writes them), else None."""
    name = os.path.basename(os.path.normpath(path))
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def is_complete(path: str) -> bool:
    """Whether `path` holds a whole DCP checkpoint (its `.metadata`, written last)."""
    return os.path.isfile(os.path.join(path, ".metadata"))


def _steps(root):
    """{step: name} of ROOT's step-N directories."""
    if not os.path.isdir(root):
        return {}
    return {saved_step(n): n for n in os.listdir(root) if saved_step(n) is not None
            and os.path.isdir(os.path.join(root, n))}


def _pointer(root):
    """The step directory ROOT/latest names, or None without ROOT/latest."""
    path = os.path.join(root, "latest")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return os.path.join(root, f.read().strip())


def latest(root: str) -> str:
    """The checkpoint --load reads: ROOT/latest's step directory, else ROOT's newest complete step-N, else ROOT
    itself (a step directory given directly)."""
    named = _pointer(root)
    if named is not None:
        return named
    complete = [name for step, name in sorted(_steps(root).items()) if is_complete(os.path.join(root, name))]
    return os.path.join(root, complete[-1]) if complete else root


def committed(root: str) -> str | None:
    """The newest checkpoint ROOT holds (what `latest` names, else its newest complete step-N), or None."""
    path = latest(root)
    return path if path != root and is_complete(path) else None


def resume_path(load: str | None, save: str | None = None) -> str | None:
    """The checkpoint a job with --load LOAD (--save SAVE) starts from, or None to start fresh: with --save and
    --load the same directory (Megatron's convention for a job that restarts itself), a directory holding no
    checkpoint yet means a fresh start; --load alone must name a checkpoint. Raises ValueError (one line) else."""
    if load is None:
        return None
    same = save is not None and os.path.realpath(save) == os.path.realpath(load)
    if same and (not os.path.isdir(load) or (_pointer(load) is None and not is_complete(latest(load)))):
        return None  # nothing saved yet
    if not os.path.isdir(load):
        raise ValueError(f"--load {load}: no such directory")
    path = latest(load)
    if not is_complete(path):
        named = _pointer(load)
        if named is not None and not os.path.basename(named):
            complete = [name for _, name in sorted(_steps(load).items()) if is_complete(os.path.join(load, name))]
            raise ValueError(f"--load {load}: {load}/latest is empty: it names the step directory to load (e.g. "
                             f"{complete[-1] if complete else 'step-000100'})")
        raise ValueError(f"--load {load}: " + (f"{load}/latest names {os.path.basename(named)}, which holds no "
                                               "complete checkpoint" if named else
                                               "holds no checkpoint (no step-N directory with a .metadata)"))
    return path


def remove_unfinished(root: str, upto: int) -> list[str]:
    """Before saving step `upto`: remove ROOT's step directories a save did not finish — those without a
    `.metadata`, and those after `latest` up to `upto` (a kill between the shards and `latest`; the directory about
    to be written is one of them when an earlier attempt started it). Returns the removed names."""
    named = _pointer(root)
    committed = saved_step(named) if named else None
    removed = []
    for step, name in sorted(_steps(root).items()):
        path = os.path.join(root, name)
        if path == named:
            continue
        if not is_complete(path) or (committed is not None and committed < step <= upto) \
                or (committed is None and step == upto):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed


def commit(root: str, name: str) -> None:
    """Point ROOT/latest at ROOT/name (an atomic rename: a reader sees the old or the new name, never half)."""
    tmp = os.path.join(root, "latest.tmp")
    with open(tmp, "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, "latest"))


def keep_last(root: str, keep: int) -> list[str]:
    """After a save committed: remove ROOT's complete step directories older than the `keep` newest (never the one
    `latest` names, nor one after it). Returns the removed names."""
    named = _pointer(root)
    newest = saved_step(named) if named else None
    complete = [(step, name) for step, name in sorted(_steps(root).items())
                if is_complete(os.path.join(root, name)) and (newest is None or step <= newest)]
    removed = [name for _, name in complete[:-keep]]
    for name in removed:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return removed
