"""Ranks started by SLURM's `srun`, one task per GPU, without torchrun: the torchrun variables every process-group
set-up reads (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT) taken from the
task's SLURM_* variables, as PyTorch Lightning's SLURMEnvironment maps them:

    SLURM_PROCID -> RANK            SLURM_NTASKS -> WORLD_SIZE          SLURM_LOCALID -> LOCAL_RANK
    SLURM_NODEID -> GROUP_RANK      this node's entry of SLURM_STEP_TASKS_PER_NODE (or SLURM_TASKS_PER_NODE, or
                                    SLURM_NTASKS_PER_NODE) -> LOCAL_WORLD_SIZE
    the first host of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST) -> MASTER_ADDR, unless set
    15000 + SLURM_JOB_ID % 10000 -> MASTER_PORT, unless set (the same port on every task of the job)

Only for a process of an srun job step (SLURM_STEP_ID set: an sbatch script's own shell has the SLURM_* variables
of its one task, not a step's) of more than one task, and only where torchrun's RANK and WORLD_SIZE are not set
(torchrun under srun: torchrun's win). `tp.init_mesh` and `python -m models.train` call `use_srun_environment()`
first, so `srun python script.py` runs a script written for torchrun.

Node lists are SLURM's compact form (`scontrol show hostnames` expands the same): `node[01-04,07],gpu7` is node01,
node02, node03, node04, node07, gpu7; task counts per node `4(x2),2` are 4, 4, 2.
"""
import itertools
import os
import re
from collections.abc import Mapping, MutableMapping

PORT_BASE, PORT_SPAN = 15000, 10000  # MASTER_PORT from the job id: below Linux's ephemeral ports (32768-60999)
_BRACKETS = re.compile(r"\[([^\[\]]*)\]")


def _expand_ranges(ranges: str, variable: str, nodelist: str) -> list[str]:
    """`01-04,07` -> ['01', '02', '03', '04', '07'] (zero padding kept, as SLURM writes it)."""
    out = []
    for item in ranges.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not match or (match[2] is not None and int(match[2]) < int(match[1])):
            raise ValueError(f"{variable}={nodelist!r} is not a SLURM node list: bad range {item!r} in [{ranges}]")
        first, last = match[1], match[2] if match[2] is not None else match[1]
        out += [str(n).zfill(len(first)) for n in range(int(first), int(last) + 1)]
    return out


def _entries(nodelist, variable):
    """The comma-separated entries of a node list (commas inside brackets are ranges, not separators)."""
    entries, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):  # (SLURM's brackets do not nest)
            raise ValueError(f"{variable}={nodelist!r} is not a SLURM node list: unbalanced brackets")
        if char == "," and depth == 0:
            entries.append(nodelist[start:i])
            start = i + 1
    entries.append(nodelist[start:])
    if depth:
        raise ValueError(f"{variable}={nodelist!r} is not a SLURM node list: unbalanced brackets")
    if not all(entries):
        raise ValueError(f"{variable}={nodelist!r} is not a SLURM node list: an empty host name")
    return entries


def expand_nodelist(nodelist: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """The host names of a SLURM node list in its compact form (`node[01-04,07],gpu7`), in order; a list that does
    not parse raises ValueError naming `variable`."""
    hosts = []
    for entry in _entries(nodelist, variable):
        parts = _BRACKETS.split(entry)  # text, ranges, text, ranges, ..., text
        choices = [[text] if i % 2 == 0 else _expand_ranges(text, variable, nodelist) for i, text in enumerate(parts)]
        hosts += ["".join(p) for p in itertools.product(*choices)]
    return hosts


def expand_tasks_per_node(value: str, variable: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """SLURM's tasks per node, `4(x2),2` -> [4, 4, 2]; a value that does not parse raises ValueError naming
    `variable`."""
    counts = []
    for item in value.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match or int(match[1]) < 1:
            raise ValueError(f"{variable}={value!r} is not a SLURM task count per node (like 4(x2),2)")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def _integer(environ, variable, low=0):
    value = environ.get(variable)
    if value is None:
        raise ValueError(f"{variable} is not set: srun sets it for every task")
    if not re.fullmatch(r"\d+", value.strip()) or int(value) < low:
        raise ValueError(f"{variable}={value!r} must be an integer >= {low}")
    return int(value)


def launched_by_srun(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is one of several tasks srun started, and torchrun's variables are not set."""
    if "RANK" in environ or "WORLD_SIZE" in environ or "SLURM_STEP_ID" not in environ or \
            "SLURM_NTASKS" not in environ:
        return False
    return _integer(environ, "SLURM_NTASKS", 1) > 1


def _tasks_per_node(environ, nodes):
    """Tasks on each of the step's `nodes` nodes: its SLURM_*TASKS_PER_NODE, named in any error."""
    for variable in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if variable in environ:
            counts = expand_tasks_per_node(environ[variable], variable)
            if len(counts) != nodes:
                raise ValueError(f"{variable}={environ[variable]!r} counts tasks on {len(counts)} nodes, but the "
                                 f"node list has {nodes}")
            return counts, variable
    if "SLURM_NTASKS_PER_NODE" in environ:
        return [_integer(environ, "SLURM_NTASKS_PER_NODE", 1)] * nodes, "SLURM_NTASKS_PER_NODE"
    raise ValueError("SLURM_TASKS_PER_NODE is not set: srun sets it for every task")


def srun_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The torchrun variables of this srun task (see the module's doc); {} unless `launched_by_srun`. Variables
    that do not agree raise ValueError naming one."""
    if not launched_by_srun(environ):
        return {}
    world = _integer(environ, "SLURM_NTASKS", 1)
    rank, local_rank, node = (_integer(environ, v) for v in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"))
    nodelist_variable = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                              if v in environ), "SLURM_JOB_NODELIST")
    if nodelist_variable not in environ:
        raise ValueError("SLURM_JOB_NODELIST is not set: srun sets it for every task")
    hosts = expand_nodelist(environ[nodelist_variable], nodelist_variable)
    per_node, per_node_variable = _tasks_per_node(environ, len(hosts))
    if sum(per_node) != world:
        raise ValueError(f"SLURM_NTASKS={world} but {per_node_variable}={environ[per_node_variable]!r} places "
                         f"{sum(per_node)} tasks on the {len(hosts)} nodes of {nodelist_variable}")
    if rank >= world:
        raise ValueError(f"SLURM_PROCID={rank} must be below SLURM_NTASKS={world}")
    if node >= len(hosts):
        raise ValueError(f"SLURM_NODEID={node} must be below the {len(hosts)} nodes of {nodelist_variable}")
    if local_rank >= per_node[node]:
        raise ValueError(f"SLURM_LOCALID={local_rank} must be below the {per_node[node]} tasks of node {node} "
                         f"({per_node_variable})")
    found = dict(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=local_rank, LOCAL_WORLD_SIZE=per_node[node],
                 GROUP_RANK=node, GROUP_WORLD_SIZE=len(hosts))
    if "MASTER_ADDR" not in environ:
        found["MASTER_ADDR"] = hosts[0]
    if "MASTER_PORT" not in environ:
        found["MASTER_PORT"] = PORT_BASE + _integer(environ, "SLURM_JOB_ID") % PORT_SPAN
    return {name: str(value) for name, value in found.items()}


def use_srun_environment(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set torchrun's variables from SLURM's in `environ` (the process's environment) when srun started this
    process as one of several tasks (see the module's doc); whether it did. ValueError naming the variable when
    SLURM's do not agree."""
    found = srun_environment(environ)
    environ.update(found)
    return bool(found)
