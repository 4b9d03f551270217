"""A rank's side of a failed job: its full traceback in its own log file, one line for the user.

Each rank of `models.train` under torchrun writes DIR/rank-N.log (ranks other than 0 send all their output there;
rank 0 keeps the terminal for the progress bar). A rank that raises writes its traceback to that file and a record
to torchrun's error file (TORCHELASTIC_ERROR_FILE): the summary line, which torchrun's own failure report shows,
and the facts our launcher picks the first failing rank from. Four kinds of failure:

- "stopped": the job stopped on purpose (JobStopped, raised the same on every rank: a non-finite loss, a full
  device): its message is the line, no traceback to read;
- "error": the rank's own exception (for torch's CheckpointException, the error of its first failing rank);
- "peer": a collective failed because another rank is gone (connection closed or reset): this rank waits a moment
  before exiting, so that the agent sees the rank that failed first, and reports that rank's line when the first
  rank to fail on its own put it in torchrun's store (an agent on another node sees only its own ranks);
- "timeout": a collective timed out (--distributed-timeout-minutes): the ranks that timed out register in torchrun's
  store, and those that never do are named as hung.
"""
import datetime
import faulthandler
import json
import os
import re
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

Job = TypeVar("Job")  # what run_rank hands its function (the JobConfig)
PEER_GRACE_S = 2.0  # a "peer" failure waits this long before exiting: the first failure is reported, not its echo
_PEER = re.compile(r"Connection (closed|reset) by peer|Broken pipe|ECONNRESET|EPIPE|Socket closed|"
                   r"Connection refused|NCCL communicator was aborted")
_TIMEOUT = re.compile(r"[Tt]imed out|Timeout waiting|timeout of \d+|wait timeout after")  # (the last: the store)


class JobStopped(Exception):
    """The job stops on purpose, decided the same on every rank (a non-finite loss, a full device): the message, one
    line naming the step or the path and the rank, is what the user reads, exit code 1."""


_places = None  # (node, local rank, host) of every global rank, once gathered
_step = None  # the step this rank is running (for messages)


def place() -> tuple[int, int, str]:
    """This process's (node, local rank, host) from torchrun's environment."""
    return (int(os.environ.get("GROUP_RANK", 0)), int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0))),
            socket.gethostname())


def set_places(places: list[tuple[int, int, str]]) -> None:
    global _places
    _places = list(places)


def note_step(step: int) -> None:
    global _step
    _step = step


def where(rank: int) -> str:
    """`node N, local rank L` of global `rank` (from the gathered places, or this process's environment)."""
    if _places and rank < len(_places):
        node, local_rank, _ = _places[rank]
        return f"node {node}, local rank {local_rank}"
    if str(rank) == os.environ.get("RANK"):
        node, local_rank, _ = place()
        return f"node {node}, local rank {local_rank}"
    return "node ?, local rank ?"  # (failed before the places were gathered)


def _one_line(exc):
    text = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    return text if len(text) <= 600 else text[:600] + " ..."


def _unwrap(exc):
    """(the exception that explains `exc`, a note): for DCP's CheckpointException, its first failing rank's error."""
    failures = getattr(exc, "failures", None)
    if type(exc).__name__ == "CheckpointException" and isinstance(failures, dict) and failures:
        first = min(failures)
        inner = failures[first][0] if isinstance(failures[first], tuple) else failures[first]
        if isinstance(inner, BaseException):
            ranks = sorted(failures)
            return inner, (f" (torch.distributed.checkpoint failed on rank{'s' * (len(ranks) > 1)} "
                           f"{', '.join(map(str, ranks))}; rank {first}'s error)")
    return exc, ""


def describe(exc: BaseException) -> str:
    """`Type: message` on one line (for a CheckpointException, the underlying error of its first failing rank)."""
    inner, note = _unwrap(exc)
    return f"{type(inner).__name__}: {_one_line(inner)}{note}"


def origin(exc: BaseException, rank: int) -> int:
    """The rank whose error `exc` is: this `rank`, or a CheckpointException's first failing rank."""
    failures = getattr(exc, "failures", None)
    if type(exc).__name__ == "CheckpointException" and isinstance(failures, dict) and failures:
        return min(failures)
    return rank


def kind(exc: BaseException) -> str:
    """"timeout", "peer" (another rank is gone) or "error" (this rank's own failure)."""
    inner, _ = _unwrap(exc)
    import torch.distributed as dist

    text = f"{type(inner).__name__}: {inner}"
    if _TIMEOUT.search(text):
        return "timeout"
    if isinstance(inner, getattr(dist, "DistNetworkError", ())) or _PEER.search(text):
        return "peer"
    return "error"


def _store():
    """torchrun's store (the default process group's), which every rank of every node reaches."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def _first_failure_key():
    return f"models.train/first-failure/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def publish_first_failure(line: str) -> None:
    """A rank's own failure: its line in torchrun's store unless an earlier one is there (best effort)."""
    try:
        _store().compare_set(_first_failure_key(), "", line)
    except Exception:  # (no store, or it is gone: the agents' reports stay as they are)
        pass


def first_failure() -> str | None:
    """The line the first rank that failed on its own put in the store, if any."""
    try:
        store, key = _store(), _first_failure_key()
        store.set_timeout(datetime.timedelta(seconds=PEER_GRACE_S + 3))  # (a store gone silent: not the default 30 min)
        return store.get(key).decode() if store.check([key]) else None
    except Exception:
        return None


def _hung_ranks(rank, world, grace):
    """Register this timed-out rank in torchrun's store; the ranks that do not register within `grace` seconds."""
    store = _store()
    prefix = f"models.train/timed-out/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store.set(prefix + str(rank), "1")
    keys = [prefix + str(r) for r in range(world)]
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not store.check(keys):
        time.sleep(0.1)
    return [r for r, key in enumerate(keys) if not store.check([key])]


def summary_of(record: dict) -> str:
    """The one line a record says (printed by our launcher after "error: ", shown by torchrun's report)."""
    if record["kind"] == "timeout" and record.get("hung"):
        hung = record["hung"]
        names = ", ".join(f"rank {r} of {record['world']} ({record['places'][str(r)]})" for r in hung)
        return (f"{names} hung{' at step ' + str(record['step']) if record.get('step') else ''}"
                f": the other ranks timed out after {record['timeout_s']:g} s waiting for "
                f"{'it' if len(hung) == 1 else 'them'} in a collective (--distributed-timeout-minutes); "
                f"each rank's log: {os.path.dirname(record['log'])}")
    if record["kind"] == "stopped":
        return record["error"]
    return (f"rank {record['rank']} of {record['world']} failed ({record['where']}): {record['error']} "
            f"(traceback: {record['log']})")


def _write_error_file(line, record=None):
    """torchrun's error file: its report shows `line`; our launcher reads `record`."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(now)),
                                                       "models_train": record}}}
    with open(path, "w") as f:
        json.dump(data, f)


def refuse(message: str) -> int:
    """A configuration error under torchrun: rank 0 alone prints it and exits at once, so that torchrun's report
    names it as the root cause; the other ranks exit a moment later (usually stopped by the agent before)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(PEER_GRACE_S)
    _write_error_file(f"error: {message}")
    return 2


def run_rank(fn: Callable[[Job], int], job: Job, log_dir: str, timeout_s: float) -> int:
    """Run `fn(job)` as one of torchrun's ranks: output of ranks other than 0 to DIR/rank-N.log, a failure
    recorded there and in torchrun's error file. Returns the exit code."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, f"rank-{rank}.log")
    log = open(path, "a" if attempt else "w", buffering=1)
    node, local, host = place()
    log.write(f"== models.train rank {rank} of {world} (node {node}, local rank {local}, {host}, pid {os.getpid()}), "
              f"attempt {attempt}, {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(sys.argv[1:])}\n")
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)  # `kill -USR1 PID`: its stacks, in its log
    if rank != 0:  # everything this rank prints (Python and C++) goes to its file, not the terminal
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        code = fn(job)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank (one process group): the launcher says so, once
        log.write(f"== interrupted at {time.strftime('%H:%M:%S')}, step {_step}\n")
        return 128 + signal.SIGINT
    except BrokenPipeError:  # stdout's reader is gone (`| head`): stop quietly, as a Unix tool does
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)  # (what is still buffered for stdout goes nowhere, instead of raising again at exit)
        log.write(f"== stdout closed by its reader at {time.strftime('%H:%M:%S')}, step {_step}: stopped\n")
        _write_error_file("stdout closed by its reader: stopped", dict(kind="pipe", rank=rank, time=time.time()))
        return 128 + signal.SIGPIPE
    except SystemExit:
        raise
    except BaseException as e:  # noqa: B036 (torch's CheckpointException is a BaseException)
        log.write(f"== failed at {time.strftime('%H:%M:%S')}, step {_step}:\n{''.join(traceback.format_exception(e))}")
        first = origin(e, rank)  # (a CheckpointException: the same on every rank, naming its first failing rank)
        stopped = isinstance(e, JobStopped)
        record = dict(rank=first, world=world, where=where(first), time=time.time(),
                      kind="stopped" if stopped else kind(e), error=str(e) if stopped else describe(e),
                      step=_step, attempt=attempt, log=os.path.join(log_dir, f"rank-{first}.log"))
        if record["kind"] == "timeout":
            try:
                record.update(hung=_hung_ranks(rank, world, min(30.0, max(2.0, timeout_s / 4))), timeout_s=timeout_s,
                              places={str(r): where(r) for r in range(world)})
            except Exception as store_error:  # the store itself is gone: report the timeout as it is
                log.write(f"(could not ask the store which ranks hung: {store_error!r})\n")
        elif record["kind"] == "peer":
            time.sleep(PEER_GRACE_S)
        line = summary_of(record)
        if record["kind"] == "error":
            publish_first_failure(line)
        elif record["kind"] == "peer" and (cause := first_failure()):  # (another node's agent named the cause)
            line = f"{cause}; stopped by it: rank {rank} ({where(rank)})"
        log.write(f"== summary: {line}\n")
        log.flush()
        _write_error_file(line, record)
        return 1
    return code  # (no destroy_process_group: the process ends in os._exit, see models/train.py)


def stdout_closed(process_failures: dict) -> bool:
    """Whether a rank stopped because its stdout's reader went away (`python -m models.train | head`)."""
    for failure in process_failures.values():
        data = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
        record = data.get("extraInfo", {}).get("models_train") if isinstance(data, dict) else None
        if record and record.get("kind") == "pipe":
            return True
    return False


def summary(process_failures: dict, world: int, logs: str) -> str:
    """The line our launcher prints for torchrun's failures {global rank: ProcessFailure}: the first rank's own error
    (earliest), else the hung ranks a timeout found, else a rank killed by a signal, else the first echo."""
    records, killed = [], []
    for rank, failure in process_failures.items():
        data = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
        record = data.get("extraInfo", {}).get("models_train") if isinstance(data, dict) else None
        if record:
            records.append(record)
        elif failure.exitcode < 0 and failure.exitcode != -signal.SIGTERM:  # (SIGTERM: the agent stopped it)
            killed.append((rank, failure))
    for kinds in (("stopped", "error"), ("timeout",)):
        chosen = sorted((r for r in records if r["kind"] in kinds and (r["kind"] != "timeout" or r.get("hung"))),
                        key=lambda r: r["time"])
        if chosen:
            return summary_of(chosen[0])
    if killed:
        rank, failure = min(killed, key=lambda rf: rf[1].timestamp)
        name = signal.Signals(-failure.exitcode).name
        return (f"rank {rank} of {world} failed (node 0, local rank {failure.local_rank}): killed by {name} "
                f"(its output: {os.path.join(logs, f'rank-{rank}.log')})")
    if records:
        return summary_of(min(records, key=lambda r: r["time"]))
    rank, failure = min(process_failures.items(), key=lambda rf: rf[1].timestamp)
    return (f"rank {rank} of {world} failed (node 0, local rank {failure.local_rank}; exit code {failure.exitcode})"
            f": see {os.path.join(logs, f'rank-{rank}.log')}")
