"""Where the job writes, checked before any process starts (models/training/preflight.py): a run never truncates,
replaces or writes beside a file it did not create.

The destinations: --save, --log-dir, --tensorboard-dir, --profile-dir and --export-hf (directories), --log-jsonl and
its plot PATH.png (files). Each is refused, in one line naming the flag, when it
- is one of the run's inputs (--data and a prefix's .bin/.idx/.json, --tokenizer, --config, --from-hf, --load unless
  it is --save too: a job that restarts itself) or lies inside an input directory;
- exists and is not a directory (directory destinations) or not a regular file (a device node, a FIFO: a run as
  root would replace /dev/full with a file);
- is an existing file that is not the job's own: --log-jsonl must be a log of models.train (a resume appends to it,
  a fresh run starts it again), its plot a picture models.train drew (plot.py marks it); --export-hf, a directory
  holding files, must hold an earlier export of models.train (EXPORT_MARK beside it);
- cannot be written: a probe file is created, written and removed there (or in the nearest existing parent, without
  creating the directory): permission bits say little as root, and /proc or /sys refuse what they seem to allow.
"""
import json
import os
import stat

from . import launch, plot
from .config import JobConfig

PROBE = ".models.train-probe"  # (its name in a destination while it is checked, with the checking process's pid)
EXPORT_MARK = ".models.train-export"  # (written into --export-hf beside an export: a later one may replace it)


def destinations(job: JobConfig) -> list[tuple[str, str, str]]:
    """(flag, path, "dir" or "file") of every destination the job names."""
    found = [(flag, path, "dir") for flag, path in (
        ("--save", job.checkpoint.save), ("--log-dir", job.logging.log_dir),
        ("--tensorboard-dir", job.logging.tensorboard_dir), ("--profile-dir", job.profiling.profile_dir),
        ("--export-hf", job.checkpoint.export_hf)) if path]
    log = job.logging.log_jsonl
    if log:
        if os.path.realpath(plot.plot_path(log)) == os.path.realpath(log):
            raise ValueError(f"--log-jsonl {log}: its plot would be the same file: give the log another suffix "
                             "(.jsonl)")
        found += [("--log-jsonl", log, "file"), ("--log-jsonl's plot", plot.plot_path(log), "file")]
    return found


def inputs(job: JobConfig, config_file: str | None = None) -> list[tuple[str, str]]:
    """(flag, path) of every file or directory the job reads that exists: the data (a prefix's files too), the
    tokenizer, the --config file, the Hugging Face model, the checkpoint of another directory than --save."""
    found = []
    for _, path in job.data.blend():
        if path:
            found += [("--data", p) for p in (path, path + ".bin", path + ".idx", path + ".json")]
    save, load = job.checkpoint.save, job.checkpoint.load
    if load and not (save and os.path.realpath(save) == os.path.realpath(load)):
        found.append(("--load", load))
    found += [(flag, path) for flag, path in (("--tokenizer", job.data.tokenizer), ("--from-hf", job.model.from_hf),
                                              ("--config", config_file)) if path]
    return [(flag, path) for flag, path in found if os.path.exists(path)]


def check(job: JobConfig, *, config_file: str | None = None) -> None:
    """Every destination of the job (and --load's directory) as this module says; raises ValueError (one line)."""
    launch.check_paths(job)  # (the one-line refusals of paths that cannot be directories or files at all)
    sources, targets = inputs(job, config_file), destinations(job)
    for flag, path, kind in targets:
        check_not_an_input(flag, path, sources)
        check_kind(flag, path, kind)
        if kind == "file" and os.path.exists(path):
            check_own_file(flag, path)
        if flag == "--export-hf" and os.path.isdir(path):
            check_own_export(path)
    for flag, path, _ in targets:  # (once every destination is known to be the job's: the probes touch nothing else)
        probe(flag, path)


def check_own_export(path: str) -> None:
    """Refuse an --export-hf directory holding files unless an earlier export of models.train wrote them (its
    mark): the export removes stale weight files and writes config.json and the weights over whatever is there."""
    entries = sorted(e for e in os.listdir(path) if not e.startswith(PROBE))  # (another rank's probe, for a moment)
    if entries and EXPORT_MARK not in entries:
        shown = ", ".join(entries[:3]) + (f", ... ({len(entries)} entries)" if len(entries) > 3 else "")
        raise ValueError(f"--export-hf {path} holds files models.train did not export ({shown}): the export would "
                         "replace them or sit beside them; give a new or empty directory")


def check_not_an_input(flag: str, path: str, sources: list[tuple[str, str]]) -> None:
    """Refuse `path` when it is one of `sources` ((flag, path) pairs) or lies inside one that is a directory."""
    real = os.path.realpath(path)
    for source_flag, source in sources:
        other = os.path.realpath(source)
        if real == other:
            raise ValueError(f"{flag} {path} is {source_flag} {source}, an input of this run: writing there would "
                             "replace it; give another path")
        if os.path.isdir(other) and real.startswith(other.rstrip(os.sep) + os.sep):
            raise ValueError(f"{flag} {path} lies inside {source_flag} {source}, an input of this run: give a path "
                             "outside it")


def check_kind(flag: str, path: str, kind: str) -> None:
    """An existing destination is a directory ("dir") or a regular file ("file"): never a device, FIFO or socket."""
    if not os.path.exists(path):
        return
    mode = os.stat(path).st_mode
    if kind == "dir" and not stat.S_ISDIR(mode):
        raise ValueError(f"{flag} {path} exists and is not a directory")
    if kind == "file" and not stat.S_ISREG(mode):
        what = "a directory" if stat.S_ISDIR(mode) else "a device, FIFO or socket"
        raise ValueError(f"{flag} {path} is {what}, not a regular file: give a file path")


def check_own_file(flag: str, path: str) -> None:
    """An existing file destination is the job's own: a JSONL log of models.train (or empty), a plot it drew."""
    log = flag == "--log-jsonl"
    if not (is_training_log(path) if log else plot.drawn_by_models_train(path)):
        what = "a JSONL log of models.train" if log else "a plot models.train drew"
        raise ValueError(f"{flag} {path} exists and is not {what}: the run would replace it; give another path "
                         "(or remove the file)")


def is_training_log(path: str) -> bool:
    """Whether the file at `path` is empty or opens with a row of models.train's JSONL log (an object with a
    "step"): its first line alone is read, so a large file of anything else is not read through."""
    with open(path, "rb") as f:
        first = f.readline(1 << 16)
    if not first.strip():
        return not first or os.path.getsize(path) == len(first)
    try:
        row = json.loads(first)
    except ValueError:
        return False
    return isinstance(row, dict) and isinstance(row.get("step"), int)


def probe(flag: str, path: str) -> None:
    """Create, write and remove a file where `path` is or will be (the directory itself, or the nearest existing
    parent: nothing is created for good); an existing file is opened for appending, which leaves it unchanged."""
    where = path if os.path.isdir(path) else launch.nearest_existing(os.path.dirname(os.path.abspath(path)))
    name = os.path.join(where, f"{PROBE}-{os.getpid()}")
    try:
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
            os.unlink(name)
        if os.path.isfile(path):
            open(path, "ab").close()
    except OSError as e:
        place = path if os.path.isfile(path) else where
        raise ValueError(f"{flag} {path}: cannot write in {place} ({e.strerror or e})") from None
