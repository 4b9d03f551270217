"""How `python -m models.train` starts a job and what a user reads when it cannot: path checks before any process,
dp inferred from torchrun's WORLD_SIZE, the rank layout over nodes, the launcher on this machine and its one-line
failure summary. (The ranks' side of failures is models/training/failures.py.)"""
import logging
import os
import signal
import socket
import sys
import tempfile

from . import failures

# ---- path flags, checked before any process ---------------------------------------------------------------------

def _nearest_existing(path):
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_writable_dir(flag, path):
    """A directory the job will create or write into: one line (ValueError) naming the flag and why not."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"{flag} {path} exists and is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path}: the directory is not writable")
        return
    _check_creatable(flag, path)


def check_writable_file(flag, path):
    """A file the job will write (its missing parent directories are created)."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory, not a file")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise ValueError(f"{flag} {path}: the file is not writable")
        return
    _check_creatable(flag, path)


def _check_creatable(flag, path):
    parent = _nearest_existing(path)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: {parent} is not a directory, so {path} cannot be created")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot be created, {parent} is not writable")


def check_readable(flag, path, kind="any"):
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


def check_paths(args):
    """Every path flag of models.train (--from-hf: validate; --data and --tokenizer: models/training/data.py's
    check_source, which may call these helpers too)."""
    for flag in ("save", "export_hf", "log_dir"):
        if getattr(args, flag, None):
            check_writable_dir(f"--{flag.replace('_', '-')}", getattr(args, flag))
    if args.log_jsonl:
        check_writable_file("--log-jsonl", args.log_jsonl)
    if args.load and not (args.save and os.path.realpath(args.save) == os.path.realpath(args.load)):
        check_readable("--load", args.load, "dir")  # (the same directory as --save may not exist yet)


# ---- sizes -------------------------------------------------------------------------------------------------------

def resolve_dp(args, world_size):
    """--dp when given; else WORLD_SIZE / (tp·cp·pp) under torchrun (as Megatron), 2 on our own launcher."""
    if args.dp is not None:
        return args.dp
    if world_size is None:
        return 2
    model_parallel = args.tp * args.cp * args.pp
    if model_parallel < 1 or world_size % model_parallel:
        raise ValueError(f"WORLD_SIZE={world_size} is not divisible by --tp*--cp*--pp = {args.tp}*{args.cp}*{args.pp}"
                         f" = {model_parallel}: no data-parallel size fits")
    return world_size // model_parallel


def world_of(args):
    return args.tp * args.cp * args.pp * args.dp


# ---- layout ------------------------------------------------------------------------------------------------------

def this_machine(world_size):
    """(node, local rank, host) of every rank of a one-node job on this machine."""
    return [(0, r, socket.gethostname()) for r in range(world_size)]


def gather_places():
    """(node, local rank, host) of every global rank, from torchrun's GROUP_RANK/LOCAL_RANK (one all_gather_object
    over the default group); remembered for the failure messages."""
    import torch.distributed as dist

    places = [None] * dist.get_world_size()
    dist.all_gather_object(places, failures.place())
    failures.set_places(places)
    return places


def split_groups(groups, places):
    """The groups (lists of global ranks) whose members sit on more than one node."""
    return [g for g in groups if len({places[r][0] for r in g}) > 1]


def layout_lines(sizes, order, places):
    """The layout as printed: which global ranks sit on which node, each rank's local rank and coordinates."""
    import tp

    world = len(places)
    groups = tp.layout(world, **sizes, order=order)
    coords = [{} for _ in range(world)]
    for axis in ("tp", "cp", "pp", "dp"):
        for group in groups[axis]:
            for i, r in enumerate(group):
                coords[r][axis] = i
    nodes = sorted({p[0] for p in places})
    lines = [f"layout: {world} ranks on {len(nodes)} node{'s' * (len(nodes) > 1)}, "
             + " ".join(f"{a}={sizes[a]}" for a in ("tp", "cp", "pp", "dp")) + f" (order {order})"]
    for node in nodes:
        ranks = [r for r in range(world) if places[r][0] == node]
        lines.append(f"  node {node} ({places[ranks[0]][2]}): ranks {_spans(ranks)}")
        lines += [f"    rank {r:>{len(str(world - 1))}}  local_rank {places[r][1]}  "
                  + " ".join(f"{a} {coords[r][a]}" for a in ("tp", "cp", "pp", "dp")) for r in ranks]
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


def sizes_of(args):
    return dict(tp=args.tp, cp=args.cp, pp=args.pp, dp=args.dp)


def announce_layout(mesh):
    """Rank 0 prints the layout of the running job (collective: gathers every rank's node)."""
    places = gather_places()
    if mesh.rank == 0:
        print("\n".join(layout_lines(dict(mesh.sizes), "-".join(mesh.order), places)), flush=True)


def print_layout_under_torchrun(args, timeout):
    """--print-layout on torchrun's ranks: the default group only, the layout printed by rank 0, no training."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timeout)
    places = gather_places()
    if dist.get_rank() == 0:
        from tp.mesh import DEFAULT_ORDER

        print("\n".join(layout_lines(sizes_of(args), DEFAULT_ORDER, places)), flush=True)
    dist.barrier()
    return 0


# ---- our own launcher --------------------------------------------------------------------------------------------

def log_dir(args):
    """Where each rank's log goes: --log-dir, else DIR/logs of --save, else a directory per torchrun run id."""
    if args.log_dir:
        return args.log_dir
    if args.save:
        return os.path.join(args.save, "logs")
    run = "-".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_PORT")).strip("-") or "local"
    return os.path.join(tempfile.gettempdir(), f"models.train-{run}")


def _quiet_torchelastic():
    """torchrun's agent logs every stop and exit code; our summary line says what matters."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def launch(args, argv):
    """Start tp·cp·pp·dp CPU processes on this machine through torchrun's launcher; on failure print one line naming
    the first failing rank (see models/training/failures.py) and return 1."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    world = world_of(args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's socket warnings: rank 0 keeps the terminal
    logs = args.log_dir or (os.path.join(args.save, "logs") if args.save else tempfile.mkdtemp(prefix="models.train-"))
    ranks = list(argv) if args.log_dir else [*argv, "--log-dir", logs]  # (the ranks infer the same --dp)
    launcher = get_args_parser().parse_args([f"--nproc-per-node={world}", "--standalone",
                                             f"--max-restarts={args.max_restarts}", "-m", "models.train", *ranks])
    _quiet_torchelastic()
    try:
        run(launcher)
    except ChildFailedError as e:
        print(f"error: {failures.summary(e.failures, world, logs)}", file=sys.stderr, flush=True)
        return 1
    except (KeyboardInterrupt, SignalException) as e:  # Ctrl-C (every rank got it too), or a signal to this process
        number = getattr(e, "sigval", signal.SIGINT)
        print(f"interrupted by {signal.Signals(number).name}: every rank stopped (their logs: {logs})",
              file=sys.stderr, flush=True)
        return 128 + number
    return 0
