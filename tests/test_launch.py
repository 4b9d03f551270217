"""Launching `python -m models.train` as the seeds describe it: two torchrun agents form one job (static and c10d
rendezvous) with the single-agent curve, the layout printed once, tp groups inside a node; --dp inferred under
torchrun; path flags refused before any process; errors printed once; the lone-process tp.init_mesh error; progress
lines a file can hold. The issue's examples first."""
import io
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from models.training import launch, progress
from models.training.cli import main, parser, validate

from .helpers import TINY_JOB

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = TINY_JOB


def env():
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    return clean | {"OMP_NUM_THREADS": "1"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(path):
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f]


def two_agents(rendezvous, *flags, nproc=2):
    """Two torchrun agents on 127.0.0.1 forming one job of 2·nproc ranks; their (stdout, stderr) pairs."""
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                                str(nproc), *rendezvous(node), "-m", "models.train", *flags],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
              for node in (0, 1)]
    try:
        outputs = [a.communicate(timeout=300) for a in agents]
    finally:
        for a in agents:
            a.kill()
    for a, (_out, err) in zip(agents, outputs):
        assert a.returncode == 0, err[-3000:]
    return outputs


def test_the_issues_save_to_dev_null_is_one_line_before_any_process():
    """`python -m models.train --save /dev/null/x --steps 2` used to train, then print 1,371 lines."""
    result = subprocess.run([sys.executable, "-m", "models.train", "--save", "/dev/null/x", "--steps", "2"],
                            capture_output=True, text=True, timeout=120, env=env())
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == ["error: --save /dev/null/x: /dev/null is not a directory, so /dev/null/x "
                                          "cannot be created"]


@pytest.mark.parametrize("flags,message", [
    (["--export-hf", "/dev/null/hf"], r"^--export-hf /dev/null/hf: /dev/null is not a directory"),
    (["--save", "{file}"], r"^--save .*afile exists and is not a directory$"),
    (["--log-jsonl", "{dir}"], r"^--log-jsonl .*adir is a directory, not a file$"),
    (["--log-jsonl", "{file}/run.jsonl"], r"^--log-jsonl .*afile/run.jsonl: .*afile is not a directory"),
    (["--log-dir", "/dev/null/logs"], r"^--log-dir /dev/null/logs: /dev/null is not a directory"),
    (["--load", "{dir}/nothing"], r"^--load .*adir/nothing: no such directory$"),
    (["--load", "{file}"], r"^--load .*afile is not a directory$"),
    (["--log-interval", "0"], r"^--log-interval=0 must be >= 1$"),
    (["--distributed-timeout-minutes", "0"], r"^--distributed-timeout-minutes=0.0 must be > 0$"),
    (["--max-restarts", "-1"], r"^--max-restarts=-1 must be >= 0$"),
])
def test_path_flags_are_checked_before_any_process(flags, message, tmp_path):
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir").mkdir()
    args = parser().parse_args([f.format(file=tmp_path / "afile", dir=tmp_path / "adir") for f in flags])
    with pytest.raises(ValueError, match=message):
        validate(args)


def test_writable_paths_that_do_not_exist_yet_are_fine(tmp_path):
    run = str(tmp_path / "new" / "run")
    args = parser().parse_args(["--save", run, "--load", run, "--log-jsonl", str(tmp_path / "logs" / "a.jsonl"),
                                "--export-hf", str(tmp_path / "hf"), "--log-dir", str(tmp_path / "ranks")])
    validate(args)  # --save and --load the same directory, not there yet: a fresh start
    assert not os.path.exists(tmp_path / "new")  # checked, not created
    assert os.listdir(tmp_path) == []  # (the probes removed)


def _inputs(tmp_path):
    """A user's text, a directory of texts, a tokenizer directory, a TOML config and foreign files, by name."""
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x\n" * 200)
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("hello\n" * 100)
    (tmp_path / "tok").mkdir()
    (tmp_path / "job.toml").write_text("[training]\nsteps = 2\n")
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "pictures").mkdir()
    (tmp_path / "pictures" / "run.png").write_bytes(b"\x89PNG\r\n\x1a\n not ours")
    return {name.split(".")[0]: str(tmp_path / name) for name in ("corpus.txt", "texts", "tok", "job.toml",
                                                                   "notes.txt", "pictures")}


@pytest.mark.parametrize("flags,message", [
    (["--data", "{corpus}", "--log-jsonl", "{corpus}"],
     r"^--log-jsonl \S+corpus.txt is --data \S+corpus.txt, an input of this run: writing there would replace it"),
    (["--data", "{texts}", "--tensorboard-dir", "{texts}/tb"], r"^--tensorboard-dir \S+texts/tb lies inside --data "),
    (["--data", "{texts}", "--save", "{texts}"], r"^--save \S+texts is --data "),
    (["--tokenizer", "{tok}", "--log-dir", "{tok}"], r"^--log-dir \S+tok is --tokenizer "),
    (["--from-hf", "{tok}", "--export-hf", "{tok}"], r"^--export-hf \S+tok is --from-hf "),
    (["--config", "{job}", "--log-jsonl", "{job}"], r"^--log-jsonl \S+job.toml is --config "),
    (["--log-jsonl", "/dev/full"], r"^--log-jsonl /dev/full is a device, FIFO or socket, not a regular file"),
    (["--log-jsonl", "{notes}"], r"^--log-jsonl \S+notes.txt exists and is not a JSONL log of models.train"),
    (["--log-jsonl", "{pictures}/run.jsonl"],
     r"^--log-jsonl's plot \S+pictures/run.png exists and is not a plot models.train drew"),
    (["--log-jsonl", "{pictures}/run.png"], r"^--log-jsonl \S+run.png: its plot would be the same file"),
    (["--export-hf", "{pictures}"], r"^--export-hf \S+pictures holds files models.train did not export \(run.png\): "
                                    r"the export would replace them or sit beside them; give a new or empty directory"),
])
def test_outputs_never_replace_inputs_or_foreign_files(flags, message, tmp_path):
    """Issue 35: `--log-jsonl PATH` replaced whatever was at PATH (the --data file, emptied; /dev/full as root, a
    regular file then, with /dev/full.png beside it). Every destination is checked before any process."""
    names = _inputs(tmp_path)
    args = parser().parse_args([f.format(**names) for f in flags])
    before = {name: os.stat(path).st_mtime_ns for name, path in names.items()}
    with pytest.raises(ValueError, match=message):
        validate(args)
    assert {name: os.stat(path).st_mtime_ns for name, path in names.items()} == before


def test_an_earlier_export_of_models_train_may_be_replaced(tmp_path):
    """--export-hf into a directory models.train exported to before (its mark) is accepted: the new export replaces
    that one's files (tests/test_hf_save.py); an empty directory too."""
    from models.training.destinations import EXPORT_MARK

    (tmp_path / "empty").mkdir()
    validate(parser().parse_args(["--export-hf", str(tmp_path / "empty")]))
    (tmp_path / "empty" / ".models.train-probe-123").write_text("")  # (another rank's probe, for a moment)
    validate(parser().parse_args(["--export-hf", str(tmp_path / "empty")]))
    (tmp_path / "earlier").mkdir()
    for name in ("config.json", "model.safetensors", EXPORT_MARK):
        (tmp_path / "earlier" / name).write_text("{}")
    validate(parser().parse_args(["--export-hf", str(tmp_path / "earlier")]))


def test_the_issues_log_over_the_data_is_one_line_and_leaves_the_data_whole(tmp_path, capsys):
    from .helpers import train_refusal

    names = _inputs(tmp_path)
    size = os.path.getsize(names["corpus"])
    code, out, err = train_refusal([*JOB, "--steps", "1", "--tp", "1", "--pp", "1", "--dp", "1", "--no-sample",
                                    "--data", names["corpus"], "--log-jsonl", names["corpus"]], capsys)
    assert code == 2 and len(err) == 1 and "an input of this run" in err[0], err
    assert os.path.getsize(names["corpus"]) == size
    assert not os.path.exists(names["corpus"].replace(".txt", ".png"))


def test_a_run_keeps_its_own_log_and_plot(tmp_path):
    """The job's own log (a JSONL of steps, or an empty file) and its own plot are destinations a rerun may take."""
    from models.training import plot

    log = tmp_path / "run.jsonl"
    log.write_text(json.dumps({"step": 1, "loss": 5.0, "lr": 0.001}) + "\n")
    plot.plot_log(str(log))
    validate(parser().parse_args(["--log-jsonl", str(log)]))
    log.write_text("")
    validate(parser().parse_args(["--log-jsonl", str(log)]))


def test_a_resumed_log_is_cut_in_place_never_replaced(tmp_path):
    """The log is truncated where it is (the same file, nothing written beside it), not os.replace'd by a new one."""
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)))
    inode = os.stat(path).st_ino
    seen = []
    real_replace = os.replace
    try:
        os.replace = lambda *a: seen.append(a) or real_replace(*a)
        with progress.open_log(str(path), 3):
            pass
    finally:
        os.replace = real_replace
    assert seen == [] and os.stat(path).st_ino == inode and os.listdir(tmp_path) == ["log.jsonl"]
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


@pytest.mark.parametrize("flags,message", [
    (["--log-dir", "/proc/nope"], r"^--log-dir /proc/nope: cannot write in /proc \("),
    (["--save", "/proc/ckpt"], r"^--save /proc/ckpt: cannot write in /proc \("),
    (["--export-hf", "/sys/out"], r"^--export-hf /sys/out: cannot write in /sys \("),
    (["--log-jsonl", "/proc/run.jsonl"], r"^--log-jsonl /proc/run.jsonl: cannot write in /proc \("),
])
def test_unwritable_destinations_are_proven_by_a_probe_before_any_process(flags, message):
    """Issue 35: as root the permission bits allow /proc and /sys, which refuse any new file: `--log-dir /proc/nope`
    and `--save /proc/ckpt` ended in raw tracebacks, `--export-hf /sys/out` failed after training."""
    with pytest.raises(ValueError, match=message):
        validate(parser().parse_args(flags))


@pytest.mark.parametrize("flags,world,dp", [
    (["--tp", "2", "--pp", "2"], 4, 1),
    (["--tp", "2", "--pp", "1"], 8, 4),
    (["--tp", "2", "--cp", "2", "--pp", "1"], 8, 2),
    (["--tp", "1", "--pp", "2", "--dp", "4"], 8, 4),
    (["--tp", "2", "--pp", "2"], None, 2),  # our own launcher: 2 unless given
])
def test_dp_defaults_to_the_world_over_tp_cp_pp_under_torchrun(flags, world, dp):
    args = parser().parse_args([*flags, "--global-batch-size", "16"])
    validate(args, world)
    assert args.dp == dp


@pytest.mark.parametrize("flags,world,message", [
    (["--tp", "4", "--pp", "1"], 6, r"WORLD_SIZE=6 is not divisible by --tp\*--cp\*--pp = 4\*1\*1 = 4"),
    (["--tp", "2", "--pp", "2", "--dp", "2"], 4, r"WORLD_SIZE=4 but --tp\*--cp\*--pp\*--dp = 2\*1\*2\*2 = 8"),
])
def test_a_dp_that_does_not_fit_is_an_error(flags, world, message):
    with pytest.raises(ValueError, match=message):
        validate(parser().parse_args(flags), world)


def test_validation_errors_are_printed_once_under_torchrun():
    """`torchrun --nproc-per-node 2 -m models.train --tp 2 --pp 1 --dp 2`: rank 0 alone prints the error."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "models.train", "--tp", "2", "--pp", "1", "--dp", "2"],
                            capture_output=True, text=True, timeout=120, env=env())
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert ours == ["error: WORLD_SIZE=2 but --tp*--cp*--pp*--dp = 2*1*1*2 = 4"], result.stderr[-3000:]
    root_cause = result.stderr.split("Root Cause")[1]
    assert "rank      : 0" in root_cause and "traceback : error: WORLD_SIZE=2" in root_cause  # torchrun's report


def test_init_mesh_in_a_lone_process_names_the_torchrun_command(tmp_path):
    """The README's tp=2 snippet run as `python mlp.py`: a short traceback ending in the command to run."""
    text = open(os.path.join(ROOT, "README.md")).read()
    snippet = re.search(r"```python\n(.*?)```", text[text.index("## Using the layers"):], re.S).group(1)
    (tmp_path / "mlp.py").write_text(snippet)
    result = subprocess.run([sys.executable, "mlp.py"], capture_output=True, text=True, timeout=120, env=env(),
                            cwd=tmp_path)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == ("RuntimeError: tp.init_mesh(tp=2) needs 2 processes, but this is one process started "
                         "without torchrun (RANK and WORLD_SIZE are not set): launch it with `torchrun "
                         "--nproc-per-node 2 mlp.py`, or use tp=1 in one process")
    assert len(lines) <= 8, result.stderr  # (was 14 lines ending in "world_size=1 is not divisible by tp*pp=2*1=2")


def test_every_run_under_torchruns_static_rendezvous_or_an_srun_step_gets_its_own_log_directory(monkeypatch,
                                                                                                  tmp_path):
    """Plain torchrun (no --standalone) calls every run "none" on the same port, and every srun step of a job has
    the same port: their logs went to one directory, each run overwriting the last one's. The ranks of one torchrun
    run now agree on a new name through torchrun's store (the same on every rank); an srun step is named by the job
    and the step."""
    import torch.distributed as dist

    from models.training.config import JobConfig

    for key in ("TORCHELASTIC_RUN_ID", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_STEP_ID", "RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    runs = []
    for _ in range(2):  # two runs, one after the other, on the same port
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # (torchrun's agent's)
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        runs.append({launch.log_dir(JobConfig()) for _rank in range(3)})
        del store
    assert all(len(names) == 1 for names in runs) and runs[0] != runs[1], runs
    assert all(name.startswith(str(tmp_path / "tp-layers" / "runs" / "torchrun-")) for (name,) in runs)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a1b2")  # a rendezvous id (--standalone, c10d): the run's own name
    assert launch.log_dir(JobConfig()).endswith(f"torchrun-a1b2-{os.environ['MASTER_PORT']}")
    for key in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "3")
    monkeypatch.setenv("RANK", "5")
    assert launch.log_dir(JobConfig()).endswith("/slurm-4242.3")


def test_print_layout_without_processes(capsys):
    assert main(["--print-layout", "--tp", "2", "--cp", "2", "--pp", "2", "--dp", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "layout: 8 ranks on 1 node, tp=2 cp=2 pp=2 dp=1 (order tp-cp-dp-pp)"
    assert out[1] == f"  node 0 ({socket.gethostname()}): ranks 0-7"
    assert out[2:] == [f"    rank {r}  local_rank {r}  tp {r % 2} cp {r // 2 % 2} pp {r // 4} dp 0" for r in range(8)]


def test_layout_over_nodes_warns_when_a_tp_group_spans_nodes():
    nodes = [(r // 2, r % 2, f"host{r // 2}") for r in range(8)]  # 4 nodes of 2 ranks
    lines = launch.layout_lines(dict(tp=2, cp=1, pp=2, dp=2), "tp-cp-dp-pp", nodes)
    assert lines[1] == "  node 0 (host0): ranks 0-1" and lines[-1] == "    rank 7  local_rank 1  tp 1 cp 0 pp 1 dp 1"
    assert not any(line.startswith("warning") for line in lines)
    lines = launch.layout_lines(dict(tp=4, cp=1, pp=2, dp=1), "tp-cp-dp-pp", nodes)
    assert [line for line in lines if line.startswith("warning")] == [
        f"warning: tp group {g} spans nodes {n}: its all-reduces cross the node boundary (InfiniBand, not NVLink); "
        "use a --nproc-per-node that --tp divides" for g, n in (([0, 1, 2, 3], [0, 1]), ([4, 5, 6, 7], [2, 3]))]
    interleaved = [(r % 2, r // 2, "h") for r in range(4)]  # a node order other than torchrun's
    assert launch.split_groups([[0, 1], [2, 3]], interleaved) == [[0, 1], [2, 3]]


def test_two_torchrun_agents_train_the_single_agent_curve(tmp_path, single_agent_run):
    """`torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 2 --master-addr 127.0.0.1 --master-port P`, tp=2
    (dp inferred: 2): the loss curve of the same split from one agent; the layout, the log and the checkpoint written
    once; tp groups inside a node. Output to a pipe: plain progress lines, no carriage returns."""
    single, single_log = single_agent_run
    port = free_port()
    (out0, err0), (out1, err1) = two_agents(
        lambda node: ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)],
        *JOB, "--tp", "2", "--pp", "1", "--log-jsonl", str(tmp_path / "two.jsonl"), "--save", str(tmp_path / "ckpt"))
    assert losses(tmp_path / "two.jsonl") == losses(single_log)  # bit for bit, 3 rows: written once
    assert out1 == ""  # every line comes from global rank 0, on node 0
    layout = out0.split("\n4 ranks:")[0].splitlines()
    assert layout == ["layout: 4 ranks on 2 nodes, tp=2 cp=1 pp=1 dp=2 (order tp-cp-dp-pp)",
                      f"  node 0 ({socket.gethostname()}): ranks 0-1",
                      "    rank 0  local_rank 0  tp 0 cp 0 pp 0 dp 0", "    rank 1  local_rank 1  tp 1 cp 0 pp 0 dp 0",
                      f"  node 1 ({socket.gethostname()}): ranks 2-3",
                      "    rank 2  local_rank 0  tp 0 cp 0 pp 0 dp 1", "    rank 3  local_rank 1  tp 1 cp 0 pp 0 dp 1"]
    assert out0.count("layout:") == 1 and out0.count("done:") == 1
    for out in (out0, single.stdout):
        assert "\r" not in out
        line = r"^step 3/3 \| loss \d\.\d{4} \| (.* \| )?tok_s \d+ \| (.* \| )?[\d.]+ s/step$"
        assert re.search(line, out, re.M), out
        assert "bubble" not in out  # pp = 1
    with open(single_log) as f:
        assert [json.loads(line)["bubble"] for line in f] == [None] * 3  # no pipeline: no bubble in the log either
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "logs", "step-000003"]
    assert sorted(os.listdir(tmp_path / "ckpt" / "logs")) == ["config.toml", "data.txt",
                                                              *(f"rank-{r}.log" for r in range(4))]


def test_two_agents_through_c10d_rendezvous_print_the_layout_and_warn_of_a_tp_group_across_nodes():
    port = free_port()
    outputs = two_agents(lambda node: ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                       "--rdzv-id", "launch-test"], "--tp", "4", "--pp", "1", "--print-layout")
    out = "".join(out for out, _ in outputs)  # (either agent may become node 0)
    assert out.startswith("layout: 4 ranks on 2 nodes, tp=4 cp=1 pp=1 dp=1") and out.count("layout:") == 1
    assert "  node 1 (" in out and "    rank 3  local_rank 1  tp 3 cp 0 pp 0 dp 0" in out
    assert "warning: tp group [0, 1, 2, 3] spans nodes [0, 1]" in out
    assert "4 ranks: " not in out  # nothing trained


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_progress_is_tqdm_on_a_terminal_and_plain_lines_otherwise():
    stream = _Stream(tty=False)
    bar = progress.progress(True, 2, 25, interval=10, stream=stream)
    for step in range(3, 26):
        bar.update(1)
        bar.set_postfix(loss=f"{1 / step:.4f}")
    bar.close()
    lines = stream.getvalue().splitlines()
    assert [line.split(" | ")[:2] for line in lines] == [["step 10/25", "loss 0.1000"], ["step 20/25", "loss 0.0500"],
                                                         ["step 25/25", "loss 0.0400"]]
    assert "\r" not in stream.getvalue()
    terminal = _Stream(tty=True)
    bar = progress.progress(True, 0, 5, interval=10, stream=terminal)
    assert type(bar).__name__ == "tqdm"
    bar.update(1)
    bar.set_postfix(loss="1.0")
    bar.close()
    assert "\r" in terminal.getvalue() and "loss=1.0" in terminal.getvalue()
    assert progress.progress(False, 0, 5, interval=1, stream=terminal).set_postfix(loss=1) is None  # other ranks


def test_intensity_and_plan_name_the_node_boundary_the_same_way():
    """A TP group inside a node (<= 8 GPUs) runs over NVLink, a larger one over each GPU's NIC, in bench.intensity's
    model (roofline.group_link) as in bench.plan's (its clusters' gpus_per_node and inter_node)."""
    from bench import roofline as rl
    from bench.plan import comm_time
    from bench.plan.hardware import CLUSTERS

    for profile, cluster in (("h100-nvlink", "h100-sxm"), ("a100-nvlink", "a100-80g")):
        hw, node = rl.HARDWARE[profile], CLUSTERS[cluster]
        for ranks in (2, 8, 16, 64):
            bandwidth, name = rl.group_link(hw, ranks)
            assert name == ("NVLink" if ranks <= 8 else "IB")
            assert bandwidth * node.comm_efficiency == comm_time.group_bandwidth(node, ranks)
    shape = rl.Shape(hidden=4096, ffn=14336, tokens=16384, mlp="gelu")
    rows = {tp: rl.tp_model(shape, tp, rl.HARDWARE["h100-nvlink"]) for tp in (8, 16)}
    assert (rows[8]["link"], rows[16]["link"]) == ("NVLink", "IB")
    assert rows[16]["mlp_fwd_comm_s"] == pytest.approx(9 * rows[8]["mlp_fwd_comm_s"])  # 450 vs 50 GB/s
    assert rl.group_link(rl.HARDWARE["h100-ib"], 64) == (400e9, "link")  # no boundary modelled: one link


def test_ctrl_c_ends_the_job_in_one_line():
    """Ctrl-C at a terminal interrupts the launcher and every rank (one process group): no rank's KeyboardInterrupt
    traceback nor torchrun's SignalException one, a line saying so, exit code 130 (128 + SIGINT)."""
    import signal
    import time

    job = subprocess.Popen([sys.executable, "-m", "models.train", *JOB, "--steps", "100000", "--tp", "1", "--pp",
                            "1", "--dp", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                           start_new_session=True)
    try:
        assert job.stdout.readline().startswith("data: the corpus")  # (what the launcher found, then the ranks')
        while not job.stdout.readline().startswith("step "):  # training
            pass
        os.killpg(job.pid, signal.SIGINT)
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        time.sleep(0.5)
    assert job.returncode == 130 and "Traceback" not in out + err, (out + err)[-3000:]
    assert err.strip().splitlines()[-1].startswith("interrupted"), err[-3000:]


def test_a_rank_dies_with_its_launcher(tmp_path):
    """(Linux) `kill -9` of the launcher (ours or torchrun's agent) left its ranks training on, unwatched, to the end
    of the run: each rank asks the kernel for SIGTERM when the process that started it dies."""
    import signal
    import textwrap

    child = "from models.training.launch import die_with_launcher; import time; die_with_launcher(); time.sleep(60)"
    parent = textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {child!r}])
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True,
                                env=os.environ | {"OMP_NUM_THREADS": "1"})
    rank = int(launcher.stdout.readline())
    time.sleep(3)  # (the child's imports and its prctl)
    assert _alive(rank)
    launcher.kill()
    launcher.wait()
    deadline = time.time() + 10
    while _alive(rank) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(rank)
    if _alive(rank, zombies=True):  # (reparented to a PID 1 that does not reap: not ours to wait for)
        os.kill(rank, signal.SIGKILL)


def _alive(pid, zombies=False):
    """Whether process `pid` runs (a zombie counts only with `zombies`)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return zombies or state != "Z"


def test_a_rank_whose_launcher_is_pid_1_lives(monkeypatch):
    """A launcher that is a container's command runs as PID 1: its ranks' parent is PID 1 from the start, which says
    nothing of its death (every rank killed itself at start); only a parent that changed across the request does."""
    import signal

    from models.training import launch

    killed, parents = [], iter([1, 1])
    monkeypatch.setattr(launch.ctypes, "CDLL", lambda *a, **k: type("Libc", (), {"prctl": lambda *a: 0})())
    monkeypatch.setattr(launch.os, "getppid", lambda: next(parents))
    monkeypatch.setattr(launch.os, "kill", lambda pid, sig: killed.append(sig))
    launch.die_with_launcher()
    assert killed == []
    parents = iter([4242, 1])  # (the launcher died between the two reads: reparented)
    launch.die_with_launcher()
    assert killed == [signal.SIGTERM]
