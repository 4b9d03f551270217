"""How `python -m models.train` starts a job and what a user reads when it cannot: path checks before any process,
the rank layout over nodes, the ranks' log directory and the resolved configuration written there, the launcher on
this machine and its one-line failure summary. (The ranks' side of failures is models/training/failures.py.)"""
import ctypes
import dataclasses
import datetime
import logging
import os
import shutil
import signal
import socket
import sys
import time

from tp.mesh import Mesh, launched_by_torchrun
from tp.slurm import use_srun_environment

from . import failures
from .config import JobConfig

CONFIG_FILE = "config.toml"  # the resolved configuration, in the ranks' log directory

# ---- path flags, checked before any process ---------------------------------------------------------------------

def nearest_existing(path: str) -> str:
    """`path` (absolute) if it exists, else its nearest existing parent."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_writable_dir(flag: str, path: str) -> None:
    """A directory the job will create or write into: one line (ValueError) naming the flag and why not."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"{flag} {path} exists and is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path}: the directory is not writable")
        return
    _check_creatable(flag, path)


def check_writable_file(flag: str, path: str) -> None:
    """A file the job will write (its missing parent directories are created)."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory, not a file")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise ValueError(f"{flag} {path}: the file is not writable")
        return
    _check_creatable(flag, path)


def _check_creatable(flag, path):
    parent = nearest_existing(path)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: {parent} is not a directory, so {path} cannot be created")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot be created, {parent} is not writable")


def check_readable(flag: str, path: str, kind: str = "any") -> None:
    """A file ("file"), directory ("dir") or either ("any") the job will read."""
    if not os.path.exists(path):
        what = {"any": "file or directory", "dir": "directory"}.get(kind, kind)
        raise ValueError(f"{flag} {path}: no such {what}")
    if kind == "file" and not os.path.isfile(path):
        raise ValueError(f"{flag} {path} is not a file")
    if kind == "dir" and not os.path.isdir(path):
        raise ValueError(f"{flag} {path} is not a directory")
    if not os.access(path, os.R_OK | (os.X_OK if os.path.isdir(path) else 0)):
        raise ValueError(f"{flag} {path} is not readable")


def check_paths(job: JobConfig) -> None:
    """Every path flag of models.train (--from-hf, --data and --tokenizer: models/training/preflight.py and the data
    plan's check, which may call these helpers too)."""
    for flag, path in (("--save", job.checkpoint.save), ("--export-hf", job.checkpoint.export_hf),
                       ("--log-dir", job.logging.log_dir), ("--tensorboard-dir", job.logging.tensorboard_dir),
                       ("--profile-dir", job.profiling.profile_dir)):
        if path:
            check_writable_dir(flag, path)
    if job.logging.log_jsonl:
        check_writable_file("--log-jsonl", job.logging.log_jsonl)
    save, load = job.checkpoint.save, job.checkpoint.load
    if load and not (save and os.path.realpath(save) == os.path.realpath(load)):
        check_readable("--load", load, "dir")  # (the same directory as --save may not exist yet)


# ---- srun's tasks ------------------------------------------------------------------------------------------------

def use_srun_tasks() -> None:
    """`srun python -m models.train`, one task per GPU: torchrun's variables from SLURM's (tp/slurm.py) before the
    job reads them. SLURM variables that do not agree: one line naming one (from the first task), exit code 2."""
    try:
        use_srun_environment()
    except ValueError as e:
        task = os.environ.get("SLURM_PROCID", "0")
        if not task.isdigit() or int(task) == 0:  # (every task refuses; the first says why)
            print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


# ---- layout ------------------------------------------------------------------------------------------------------

def this_machine(world_size: int) -> list[tuple[int, int, str]]:
    """(node, local rank, host) of every rank of a one-node job on this machine."""
    return [(0, r, socket.gethostname()) for r in range(world_size)]


def gather_places() -> list[tuple[int, int, str]]:
    """(node, local rank, host) of every global rank, from torchrun's GROUP_RANK/LOCAL_RANK (one all_gather_object
    over the default group); remembered for the failure messages."""
    import torch.distributed as dist

    places = [None] * dist.get_world_size()
    dist.all_gather_object(places, failures.place())
    failures.set_places(places)
    return places


def split_groups(groups: list[list[int]], places: list[tuple[int, int, str]]) -> list[list[int]]:
    """The groups (lists of global ranks) whose members sit on more than one node."""
    return [g for g in groups if len({places[r][0] for r in g}) > 1]


def layout_lines(sizes: dict[str, int], order: str, places: list[tuple[int, int, str]]) -> list[str]:
    """The layout as printed: which global ranks sit on which node, each rank's local rank and coordinates (with
    `ep` / `etp` in `sizes` and experts split, the expert coordinates ep, etp, edp too)."""
    import tp

    world = len(places)
    groups = tp.layout(world, **sizes, order=order)
    axes = ["tp", "cp", "pp", "dp"]
    if sizes.get("ep", 1) > 1 or sizes.get("etp") not in (None, sizes.get("tp", 1)):
        axes += ["ep", "etp", "edp"]
    coords = [{} for _ in range(world)]
    for axis in axes:
        for group in groups[axis]:
            for i, r in enumerate(group):
                coords[r][axis] = i
    nodes = sorted({p[0] for p in places})
    shown = {a: sizes[a] if a in sizes else len(groups[a][0]) for a in axes}
    lines = [f"layout: {world} ranks on {len(nodes)} node{'s' * (len(nodes) > 1)}, "
             + " ".join(f"{a}={shown[a]}" for a in axes) + f" (order {order})"]
    for node in nodes:
        ranks = [r for r in range(world) if places[r][0] == node]
        lines.append(f"  node {node} ({places[ranks[0]][2]}): ranks {_spans(ranks)}")
        lines += [f"    rank {r:>{len(str(world - 1))}}  local_rank {places[r][1]}  "
                  + " ".join(f"{a} {coords[r][a]}" for a in axes) for r in ranks]
    for group in split_groups(groups["tp"], places):
        lines.append(f"warning: tp group {group} spans nodes {sorted({places[r][0] for r in group})}: its "
                     "all-reduces cross the node boundary (InfiniBand, not NVLink); use a --nproc-per-node that "
                     "--tp divides")
    return lines


def _spans(ranks):
    spans, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            spans.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(spans)


def announce_layout(mesh: Mesh) -> None:
    """Rank 0 prints the layout of the running job (collective: gathers every rank's node); once: not again when
    torchrun restarts the group (the trainer says so in one line)."""
    places = gather_places()
    if mesh.rank == 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        sizes = dict(mesh.sizes, ep=mesh.ep_size, etp=mesh.etp_size)
        print("\n".join(layout_lines(sizes, "-".join(mesh.order), places)), flush=True)


def print_layout_under_torchrun(sizes: dict[str, int], timeout: datetime.timedelta) -> int:
    """--print-layout on torchrun's ranks: the default group only, the layout printed by rank 0, no training."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timeout)
    places = gather_places()
    if dist.get_rank() == 0:
        from tp.mesh import DEFAULT_ORDER

        print("\n".join(layout_lines(sizes, DEFAULT_ORDER, places)), flush=True)
    dist.barrier()
    return 0


# ---- our own launcher --------------------------------------------------------------------------------------------

PR_SET_PDEATHSIG = 1  # (linux/prctl.h)


def die_with_launcher() -> None:
    """(Linux) This rank gets SIGTERM when the process that started it dies: a launcher killed with SIGKILL cannot
    stop its ranks, which would otherwise train on alone, unwatched (under plain torchrun too)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()  # (may be PID 1 itself: a launcher that is a container's command)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # (no prctl in this libc: the ranks outlive a killed launcher, as before)
        return
    if os.getppid() != parent:  # it died between the two: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def runs_dir() -> str:
    """Where a run's logs go without --log-dir or --save: $XDG_STATE_HOME/tp-layers/runs, else
    ~/.local/state/tp-layers/runs (not the temporary directory: a run leaves nothing in /tmp)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(state, "tp-layers", "runs")


def log_dir(job: JobConfig) -> str:
    """Where each rank's log goes: --log-dir, else DIR/logs of --save, else RUNS/NAME (RUNS: runs_dir(); NAME: the
    same on every rank of the run, another for each run: run_name())."""
    if job.logging.log_dir:
        return job.logging.log_dir
    if job.checkpoint.save:
        return os.path.join(job.checkpoint.save, "logs")
    return os.path.join(runs_dir(), run_name())


def run_name() -> str:
    """torchrun-RUNID-PORT under a torchrun rendezvous with a run id (--standalone's, c10d's); torchrun-DATE-TIME-HEX
    under its static rendezvous (every run there is "none" on the same port), agreed through torchrun's store;
    slurm-JOB.STEP in an srun step; torchrun-PORT under another launcher; DATE-TIME-PID outside any."""
    env = os.environ
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id == "none" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        import torch.distributed as dist

        mine = f"torchrun-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"
        try:
            store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                                  timeout=datetime.timedelta(seconds=60))
            return store.compare_set("tp-layers/run-name", "", mine).decode()  # (the first rank's)
        except (RuntimeError, ValueError) as e:  # (DistNetworkError, DistStoreError: RuntimeErrors)
            print(f"warning: torchrun's store did not answer ({type(e).__name__}): logs in torchrun-none-"
                  f"{env['MASTER_PORT']}, which another run on this port also uses", file=sys.stderr, flush=True)
    if run_id:
        return f"torchrun-{run_id}-{env.get('MASTER_PORT', '')}".rstrip("-")
    if "RANK" in env and "SLURM_JOB_ID" in env and "SLURM_STEP_ID" in env:
        return f"slurm-{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"
    if "MASTER_PORT" in env and "RANK" in env:
        return f"torchrun-{env['MASTER_PORT']}"
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def remove_stale_rank_logs(logs: str, world: int) -> None:
    """Remove LOGS/rank-N.log of ranks this run does not have (an earlier, larger run's in the same directory)."""
    if not os.path.isdir(logs):
        return
    for name in os.listdir(logs):
        number = name[5:-4] if name.startswith("rank-") and name.endswith(".log") else ""
        if number.isdigit() and int(number) >= world:
            os.remove(os.path.join(logs, name))


def keep_caches_out_of_tmp() -> None:
    """torch's compile cache (which importing torch._dynamo creates) in $XDG_CACHE_HOME/tp-layers/torchinductor,
    else ~/.cache/tp-layers/torchinductor, unless TORCHINDUCTOR_CACHE_DIR says where: not /tmp/torchinductor_USER."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache, "tp-layers", "torchinductor"))


def write_config(job: JobConfig, logs: str) -> str:
    """LOGS/config.toml: the job as resolved (dp, the log directory), loadable with --config; returns its path."""
    resolved = dataclasses.replace(job, logging=dataclasses.replace(job.logging, log_dir=logs))
    os.makedirs(logs, exist_ok=True)
    path = os.path.join(logs, CONFIG_FILE)
    with open(path, "w") as f:
        f.write(resolved.to_toml())
    return path


def exit_process(code: int) -> None:
    """Exit with `code`; one of torchrun's ranks without tearing its process groups down: a gloo group destroyed
    from Python joins its worker thread with the GIL held, and that thread may need the GIL (a deadlock), and one
    left to the interpreter's exit sometimes aborts the rank ("terminate called without an active exception")."""
    if launched_by_torchrun():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    else:
        sys.exit(code)


def quiet_torchelastic() -> None:
    """torchrun's agent logs every stop and exit code; our summary line says what matters."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def launch(job: JobConfig) -> int:
    """Start tp·cp·pp·dp CPU processes on this machine through torchrun's launcher, each reading the resolved
    configuration this writes beside their logs (write_config); on failure print one line naming the first failing
    rank (see models/training/failures.py) and return 1."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    world = job.parallelism.world_size
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's socket warnings: rank 0 keeps the terminal
    logs = log_dir(job)
    config = write_config(job, logs)
    remove_stale_rank_logs(logs, world)
    agent_logs = os.path.join(logs, "torchrun")  # torchrun's error files (else a /tmp/torchelastic_* left behind)
    launcher = get_args_parser().parse_args([f"--nproc-per-node={world}", "--standalone", "--log-dir", agent_logs,
                                             f"--max-restarts={job.launch.max_restarts}", "-m", "models.train",
                                             "--config", config])
    quiet_torchelastic()
    try:
        run(launcher)
    except ChildFailedError as e:
        if failures.stdout_closed(e.failures):  # `| head` has what it wanted: nothing to report
            return 128 + signal.SIGPIPE
        print(f"error: {failures.summary(e.failures, world, logs)}", file=sys.stderr, flush=True)
        return 1
    except (KeyboardInterrupt, SignalException) as e:  # Ctrl-C (every rank got it too), or a signal to this process
        number = getattr(e, "sigval", signal.SIGINT)
        print(f"interrupted by {signal.Signals(number).name}: every rank stopped (their logs: {logs})",
              file=sys.stderr, flush=True)
        return 128 + number
    finally:
        shutil.rmtree(agent_logs, ignore_errors=True)  # (what it said is in the ranks' logs and our summary)
    return 0
