"""SLURM. The torchrun variables of srun's tasks from SLURM's (tp/slurm.py): compact node lists and task counts,
only for a task of a step of several (not the sbatch script's own shell, not under torchrun), one line naming the
variable when they do not agree. Then the docs' sbatch scripts on two simulated nodes of this machine (stand-ins for
srun and scontrol that set, for each task, what SLURM sets): one torchrun per node, its c10d rendezvous from the
job's node list and id, and one task per rank, the job reading SLURM_*; both train the single-agent curve. A script
written for torchrun runs under srun (tp.init_mesh)."""
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tp.slurm import expand_nodelist, expand_tasks_per_node, launched_by_srun, srun_environment

from .helpers import TINY_JOB

ROOT = Path(__file__).resolve().parent.parent
JOB = [*TINY_JOB, "--tp", "2", "--pp", "1"]
NODES = "127.0.0.[1-2]"  # two nodes, the first one this machine's loopback address
GPUS_PER_NODE = 2  # what a simulated node has (the scripts' --ntasks-per-node is capped to it)

SRUN = """#!{python}
# srun in an allocation: SLURM_NTASKS_PER_NODE tasks on each node of SLURM_JOB_NODELIST, each with what slurmstepd
# sets; waits for them and exits with the largest exit code
import os, subprocess, sys
from tp.slurm import expand_nodelist
command = sys.argv[1:]
while command[0].startswith("-"):  # srun's own options
    if "=" not in command.pop(0):
        command.pop(0)
nodes, per_node = expand_nodelist(os.environ["SLURM_JOB_NODELIST"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
layout = f"{{per_node}}(x{{len(nodes)}})"
step = dict(SLURM_STEP_ID="0", SLURM_NTASKS=str(per_node * len(nodes)), SLURM_STEP_NODELIST=os.environ[
    "SLURM_JOB_NODELIST"], SLURM_TASKS_PER_NODE=layout, SLURM_STEP_TASKS_PER_NODE=layout)
tasks = [subprocess.Popen(command, env=os.environ | step | dict(
    SLURM_PROCID=str(node * per_node + local), SLURM_LOCALID=str(local), SLURM_NODEID=str(node),
    SLURMD_NODENAME=host)) for node, host in enumerate(nodes) for local in range(per_node)]
sys.exit(max(task.wait() for task in tasks))
"""
SCONTROL = """#!{python}
import sys
from tp.slurm import expand_nodelist
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\\n".join(expand_nodelist(sys.argv[3])))
"""


def _srun_task(rank=3, **changes):
    """What srun sets for task `rank` of 2 nodes x 2 tasks (the step's variables), with `changes` (None: unset)."""
    env = dict(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_NTASKS="4", SLURM_PROCID=str(rank),
               SLURM_LOCALID=str(rank % 2), SLURM_NODEID=str(rank // 2), SLURM_JOB_NODELIST="gpu[07-08]",
               SLURM_STEP_NODELIST="gpu[07-08]", SLURM_TASKS_PER_NODE="2(x2)", SLURM_STEP_TASKS_PER_NODE="2(x2)",
               SLURM_NNODES="2")
    env.update(changes)
    return {k: v for k, v in env.items() if v is not None}


@pytest.mark.parametrize("nodelist,hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07],gpu7", ["node01", "node02", "node03", "node04", "node07", "gpu7"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("rack[1-2]-gpu[1,3]", ["rack1-gpu1", "rack1-gpu3", "rack2-gpu1", "rack2-gpu3"]),
    ("a-1,b[2-3].cluster", ["a-1", "b2.cluster", "b3.cluster"]),
])
def test_compact_node_lists_expand_as_scontrol_show_hostnames(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist,why", [
    ("node[01-04", "unbalanced brackets"), ("node]1", "unbalanced brackets"), ("n[1-[2]]", "unbalanced brackets"),
    ("a,,b", "an empty host name"), ("node[a-b]", "bad range 'a-b' in [a-b]"),
    ("node[4-1]", "bad range '4-1' in [4-1]"), ("n[]", "bad range '' in []"),
])
def test_a_node_list_that_does_not_parse_is_one_line_naming_the_variable(nodelist, why):
    with pytest.raises(ValueError) as error:
        expand_nodelist(nodelist, "SLURM_STEP_NODELIST")
    assert str(error.value) == f"SLURM_STEP_NODELIST={nodelist!r} is not a SLURM node list: {why}"


def test_tasks_per_node_expand_their_repeat_counts():
    assert expand_tasks_per_node("4(x2),2") == [4, 4, 2]
    assert expand_tasks_per_node("8") == [8]
    with pytest.raises(ValueError, match=r"^SLURM_TASKS_PER_NODE='4\(2\)' is not a SLURM task count per node"):
        expand_tasks_per_node("4(2)")


def test_each_srun_task_gets_torchruns_variables():
    assert [srun_environment(_srun_task(rank)) for rank in range(4)] == [
        dict(RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2),
             GROUP_WORLD_SIZE="2", MASTER_ADDR="gpu07", MASTER_PORT=str(15000 + 4242)) for rank in range(4)]
    given = srun_environment(_srun_task(MASTER_ADDR="10.0.0.1", MASTER_PORT="29500"))
    assert "MASTER_ADDR" not in given and "MASTER_PORT" not in given  # a user's own, kept
    uneven = _srun_task(2, SLURM_NTASKS="3", SLURM_TASKS_PER_NODE="2,1", SLURM_STEP_TASKS_PER_NODE=None,
                        SLURM_LOCALID="0")
    assert srun_environment(uneven)["LOCAL_WORLD_SIZE"] == "1"
    assert srun_environment(_srun_task(SLURM_TASKS_PER_NODE=None, SLURM_STEP_TASKS_PER_NODE=None,
                                       SLURM_NTASKS_PER_NODE="2"))["LOCAL_WORLD_SIZE"] == "2"


@pytest.mark.parametrize("changes", [
    dict(SLURM_STEP_ID=None),  # the sbatch script's own shell: its one task's variables, not a step's
    dict(SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0"),  # srun of one task
    dict(RANK="0", WORLD_SIZE="8"),  # torchrun under srun: torchrun's variables win
])
def test_only_a_task_of_a_step_of_several_without_torchruns_variables_is_read(changes):
    assert not launched_by_srun(_srun_task(**changes)) and srun_environment(_srun_task(**changes)) == {}


@pytest.mark.parametrize("changes,line", [
    (dict(SLURM_STEP_NODELIST="gpu[07-08"), "SLURM_STEP_NODELIST='gpu[07-08' is not a SLURM node list: unbalanced "
                                            "brackets"),
    (dict(SLURM_NTASKS="6"), "SLURM_NTASKS=6 but SLURM_STEP_TASKS_PER_NODE='2(x2)' places 4 tasks on the 2 nodes "
                             "of SLURM_STEP_NODELIST"),
    (dict(SLURM_STEP_TASKS_PER_NODE="4"), "SLURM_STEP_TASKS_PER_NODE='4' counts tasks on 1 nodes, but the node list "
                                          "has 2"),
    (dict(SLURM_PROCID="x"), "SLURM_PROCID='x' must be an integer >= 0"),
    (dict(SLURM_PROCID="4"), "SLURM_PROCID=4 must be below SLURM_NTASKS=4"),
    (dict(SLURM_NODEID="2"), "SLURM_NODEID=2 must be below the 2 nodes of SLURM_STEP_NODELIST"),
    (dict(SLURM_LOCALID="2"), "SLURM_LOCALID=2 must be below the 2 tasks of node 1 (SLURM_STEP_TASKS_PER_NODE)"),
    (dict(SLURM_JOB_ID="abc"), "SLURM_JOB_ID='abc' must be an integer >= 0"),
    (dict(SLURM_STEP_NODELIST=None, SLURM_JOB_NODELIST=None), "SLURM_JOB_NODELIST is not set: srun sets it for every "
                                                              "task"),
])
def test_slurm_variables_that_do_not_agree_are_one_line_naming_one(changes, line):
    with pytest.raises(ValueError) as error:
        srun_environment(_srun_task(**changes))
    assert str(error.value) == line


def _env(tmp_path, **slurm):
    """A user's environment in an sbatch script (no torchrun variables, this repository on the path), the stand-ins
    for srun and scontrol first on PATH, and `slurm`: what sbatch sets."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL),
                       ("torchrun", "#!{python}\nfrom torch.distributed.run import main\nmain()\n")):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    if not (bin_dir / "python").exists():
        (bin_dir / "python").symlink_to(sys.executable)
    return env | slurm | {"PATH": f"{bin_dir}:{env['PATH']}", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _job_id_with_a_free_port():
    """A job id whose port, 15000 + id % 10000, is free here (an sbatch job's id is the cluster's choice)."""
    for port in range(15000 + os.getpid() % 5000, 25000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return 4_000_000 + port - 15000
    raise RuntimeError("no free port in 15000-24999")


def _batch_environment(tmp_path, script):
    """What sbatch sets in the script's shell on the first of two nodes, for the script's #SBATCH options (tasks per
    node capped to a simulated node's GPUS_PER_NODE)."""
    per_node = min(int(re.search(r"#SBATCH --ntasks-per-node=(\d+)", script)[1]), GPUS_PER_NODE)
    return _env(tmp_path, SLURM_JOB_ID=str(_job_id_with_a_free_port()), SLURM_JOB_NODELIST=NODES, SLURM_NODELIST=NODES,
                SLURM_NNODES="2", SLURM_JOB_NUM_NODES="2", SLURM_NTASKS_PER_NODE=str(per_node),
                SLURM_NTASKS=str(2 * per_node), SLURM_TASKS_PER_NODE=f"{per_node}(x2)",
                SLURM_GPUS_ON_NODE=str(GPUS_PER_NODE), SLURM_CPUS_PER_TASK="1", SLURM_PROCID="0",
                SLURM_LOCALID="0", SLURM_NODEID="0")


def _sbatch_scripts():
    text = (ROOT / "docs" / "launching.md").read_text()
    return re.findall(r"<!-- test: sbatch -->\n```bash\n(.*?)```", text, re.S)


def _losses(path):
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.mark.parametrize("launcher", ["torchrun per node", "srun task per rank"])
def test_the_docs_sbatch_scripts_train_the_single_agent_curve_on_two_nodes(launcher, single_agent_run, tmp_path):
    scripts = _sbatch_scripts()
    assert len(scripts) == 2 and "srun torchrun" in scripts[0] and "srun python -m models.train" in scripts[1]
    script = scripts[launcher == "srun task per rank"]
    (tmp_path / "train.sbatch").write_text(script)
    log = tmp_path / "run.jsonl"
    flags = [*JOB, "--log-jsonl", str(log), "--log-dir", str(tmp_path / "logs")]
    result = subprocess.run(["bash", "train.sbatch", *flags], cwd=tmp_path, env=_batch_environment(tmp_path, script),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert _losses(log) == _losses(single_agent_run[1])  # bit for bit, written once
    out = result.stdout
    assert out.count("layout: 4 ranks on 2 nodes, tp=2 cp=1 pp=1 dp=2") == 1 and "  node 1 (" in out
    assert "warning: tp group" not in out and out.count("done:") == 1
    assert sorted(os.listdir(tmp_path / "logs")) == ["config.toml", "data.txt", *(f"rank-{r}.log" for r in range(4))]


def test_a_script_written_for_torchrun_runs_under_srun(tmp_path):
    """The README's tp=2 snippet (`tp.init_mesh(tp=2)`) as `srun python mlp.py`, 2 tasks on one node."""
    text = (ROOT / "README.md").read_text()
    (tmp_path / "mlp.py").write_text(re.search(r"```python\n(.*?)```", text, re.S)[1])
    env = _env(tmp_path, SLURM_JOB_ID=str(_job_id_with_a_free_port()), SLURM_JOB_NODELIST="127.0.0.1",
               SLURM_NTASKS_PER_NODE="2")
    result = subprocess.run(["srun", "python", "mlp.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(16, 2, 1024) (2048, 1024)" in result.stdout and result.stdout.count("(16, 2, 1024)") == 1


def test_bad_slurm_variables_stop_the_job_in_one_line(tmp_path):
    """`srun python -m models.train` with SLURM_NTASKS unequal to the tasks per node: the first task names it, every
    task exits 2, before any process group."""
    env = _env(tmp_path, **_srun_task(0, SLURM_NTASKS="6"))
    first = subprocess.run([sys.executable, "-m", "models.train"], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 2 and first.stdout == ""
    assert first.stderr.splitlines() == ["error: SLURM_NTASKS=6 but SLURM_STEP_TASKS_PER_NODE='2(x2)' places 4 tasks "
                                         "on the 2 nodes of SLURM_STEP_NODELIST"]
    other = subprocess.run([sys.executable, "-m", "models.train"], env=env | {"SLURM_PROCID": "1"},
                           capture_output=True, text=True, timeout=120)
    assert other.returncode == 2 and other.stdout == other.stderr == ""


def test_a_split_that_does_not_match_srun_tasks_names_slurm_ntasks(monkeypatch):
    """Under srun the world's size is SLURM_NTASKS (made WORLD_SIZE by tp/slurm.py): the refusal names the variable
    the user set, not one srun's tasks never saw."""
    from models.training.config import JobConfig

    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    job = JobConfig()
    job.parallelism.tp, job.parallelism.pp, job.parallelism.dp = 2, 1, 1
    job.launch.device = "cpu"
    with pytest.raises(ValueError, match=r"^SLURM_NTASKS=4 but --tp\*--cp\*--pp\*--dp = 2\*1\*1\*1 = 2$"):
        job.validate(world_size=4)
    monkeypatch.delenv("SLURM_STEP_ID")
    with pytest.raises(ValueError, match=r"^WORLD_SIZE=4 but"):
        job.validate(world_size=4)
