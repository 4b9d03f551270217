"""The default process group: whether torchrun started this process, the backend and device of its collectives,
and its creation (from torchrun's environment, or a one-rank group for a lone process)."""
import datetime
import os
import shlex
import sys

import torch
import torch.distributed as dist


def launched_by_torchrun() -> bool:
    """Whether torchrun (or a launcher that sets its RANK and WORLD_SIZE) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_backend() -> str:
    """The default group's backend when none is given: with CUDA, NCCL for CUDA tensors and gloo for CPU tensors in
    the same group (so CPU tensors, such as a loader's indices or an optimizer's scalars, still reduce), else gloo."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def collective_device() -> torch.device:
    """Where the default group's collectives take their tensors: this rank's GPU under NCCL, else the CPU (also
    before any process group exists)."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_group_timeout() -> datetime.timedelta | None:
    """The default group's collective timeout (None where torch does not expose it: new_group's default then)."""
    try:
        return dist.group.WORLD._get_backend(collective_device()).options._timeout
    except (AttributeError, RuntimeError):
        return None


def lone_process_error(tp: int, cp: int, pp: int, dp: int | None) -> RuntimeError:
    """The error of a mesh that needs several processes asked for in one process started without torchrun."""
    world = tp * cp * pp * (dp or 1)
    given = {k: v for k, v in dict(tp=tp, cp=cp, pp=pp, dp=dp).items() if v not in (1, None)}
    call = ", ".join(f"{k}={v}" for k, v in given.items())
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        target = ["-m", spec.name.removesuffix(".__main__")]
    elif sys.argv and sys.argv[0] and sys.argv[0] != "-c":
        target = [sys.argv[0]]
    else:
        target = ["your_script.py"]
    command = shlex.join(["torchrun", "--nproc-per-node", str(world), *target, *sys.argv[1:]])
    return RuntimeError(f"tp.init_mesh({call}) needs {world} processes, but this is one process started without "
                        f"torchrun (RANK and WORLD_SIZE are not set): launch it with `{command}`, or use "
                        + ", ".join(f"{k}=1" for k in given) + " in one process")


def init_default_group(backend: str | None, timeout: datetime.timedelta) -> None:
    backend = backend or default_backend()
    if launched_by_torchrun():
        if "nccl" in backend:  # one rank per GPU: this rank's (NCCL refuses two ranks on one device)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # torchrun's agent keeps one TCPStore across restarts of the worker group (--max-restarts): keys under a
        # per-attempt prefix, or a restarted rank can read the previous attempt's addresses (pytorch#135712)
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        store = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:  # a single process outside any launcher
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
