"""Faults, for real under torchrun: a worker SIGKILLed after a step or in the middle of a save, torchrun restarts the
group (--max-restarts), the job resumes from the newest complete checkpoint with the curve of an uninterrupted run,
the JSONL log appended; a hung rank ends the job within the collective timeout, named; a failure inside the ranks is
one line naming the first failing rank; a non-finite loss, or steps skipped for a non-finite gradient norm, stop the
job in one line; a full device during a save is one line, `latest` kept. Plus the checkpoint-directory rules those
rely on."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import tp.testing
from models.training import checkpoint_dirs, failures, progress

JOB = ["--model", "tiny", "--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--seed", "7",
       "--tp", "2", "--pp", "1", "--dp", "1", "--steps", "8", "--log-interval", "1"]


def env():
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    return clean | {"OMP_NUM_THREADS": "1"}


def rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def torchrun(*flags, nproc=2, restarts=0):
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(nproc), f"--max-restarts={restarts}", "-m", "models.train", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())


def worker(agent, rank):
    """The pid of torchrun's worker process of global rank `rank` (a child of the agent, RANK in its environment)."""
    for _ in range(600):
        for child in open(f"/proc/{agent.pid}/task/{agent.pid}/children").read().split():
            try:
                environ = open(f"/proc/{child}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return int(child)
        time.sleep(0.05)
    raise AssertionError(f"no worker of rank {rank}")


def wait_for(condition, agent, what, timeout=180):
    deadline = time.monotonic() + timeout
    while not condition():
        assert agent.poll() is None, f"the job ended before {what}: {agent.communicate()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _train(flags, log):
    """(On each rank:) the job, as a rank of `python -m models.train` runs it."""
    from models.training.cli import parser, train

    train(parser().parse_args([*flags, "--log-jsonl", log]))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The curve of the job run straight through (the same split), on the harness's warm ranks: a launch of its own
    cost a new interpreter per rank, and the launchers train one curve bit for bit (test_launch, test_slurm)."""
    log = tmp_path_factory.mktemp("reference") / "log.jsonl"
    tp.testing.run(_train, 2, flags=JOB, log=str(log), timeout=300)
    return [r["loss"] for r in rows(log)]


def _resumed_job(tmp_path, kill_when, *extra):
    """Run JOB under torchrun --max-restarts 1 with --save D --load D --save-every 2; SIGKILL rank 1's worker when
    `kill_when(ckpt, log)` holds. Returns (stdout, stderr, the log's rows before the kill, its rows at the end)."""
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "log.jsonl")
    agent = torchrun(*JOB, "--save", ckpt, "--load", ckpt, "--save-every", "2", "--log-jsonl", log, *extra,
                     restarts=1)
    try:
        wait_for(lambda: kill_when(ckpt, log), agent, "the moment to kill")
        before = open(log).read().splitlines()
        os.kill(worker(agent, 1), signal.SIGKILL)
        out, err = agent.communicate(timeout=300)
    finally:
        agent.kill()
    assert agent.returncode == 0, err[-3000:]
    return out, err, before, open(log).read().splitlines()


def _logged_steps(log):
    try:
        return len(rows(log))
    except (OSError, ValueError):
        return 0


def test_a_worker_killed_after_a_step_restarts_and_trains_the_uninterrupted_curve(tmp_path, uninterrupted):
    import importlib.util

    wandb = ["--wandb-project", "faults"] if importlib.util.find_spec("wandb") else []
    out, err, before, after = _resumed_job(tmp_path, lambda ckpt, log: _logged_steps(log) >= 3, "--tensorboard-dir",
                                           str(tmp_path / "tb"), *wandb)
    resumed = re.search(r"the group restarted after a failure \(attempt 2\); resuming from \S+step-0*(\d+) \(step "
                        r"(\d+)\)", out)  # the newest complete checkpoint, in one line
    assert resumed and resumed[1] == resumed[2] and int(resumed[1]) in (2, 4, 6), out
    assert out.count("layout:") == 1, out  # (not a second layout block)
    final = [json.loads(line) for line in after]
    assert [r["step"] for r in final] == list(range(1, 9))  # one row per step: the redone ones replaced
    assert [r["loss"] for r in final] == uninterrupted  # data order, RNG and optimizer state restored: bit for bit
    pytest.importorskip("tensorboard")
    from .test_watch import assert_same_rows, tensorboard_rows

    assert_same_rows(tensorboard_rows(tmp_path / "tb"), final)  # the redone steps once, with the new values
    if wandb:  # (offline: one run directory per attempt) the resumed attempt continues the checkpoint's W&B run
        runs = sorted(os.listdir(tmp_path / "ckpt" / "logs" / "wandb"))
        ids = {name.rsplit("-", 1)[1] for name in runs if name.startswith("offline-run-")}
        assert len([n for n in runs if n.startswith("offline-run-")]) == 2 and len(ids) == 1, runs
    # (row 3 was logged, so step 2's checkpoint was committed: it started only after `latest` moved)
    assert after[:2] == before[:2]  # the rows up to the checkpoint kept as first written (their timings too)
    assert checkpoint_dirs.latest(str(tmp_path / "ckpt")).endswith("step-000008")


def test_a_worker_killed_mid_save_resumes_from_the_previous_checkpoint(tmp_path, uninterrupted):
    """The first attempt pauses after writing step-000004's shards and before moving `latest` (a test hook); the
    kill lands there. step-000004 is not read (latest still names step-000002) and is removed at the next save."""
    def mid_save(ckpt, log):
        latest = os.path.join(ckpt, "latest")
        return checkpoint_dirs.is_complete(os.path.join(ckpt, "step-000004")) and open(latest).read() == "step-000002"

    out, err, before, after = _resumed_job(tmp_path, mid_save, "--slow-save-at-step", "4")
    assert "resuming from" in out and "step-000002 (step 2)" in out, out
    assert "removed unfinished checkpoint step-000004" in err, err[-3000:]
    final = [json.loads(line) for line in after]
    assert [r["step"] for r in final] == list(range(1, 9)) and [r["loss"] for r in final] == uninterrupted
    assert after[:2] == before[:2] and len(before) == 3  # (a step's row follows its save) rows 3 and 4 were redone
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "logs", "step-000002", "step-000004",
                                                     "step-000006", "step-000008"]


@pytest.mark.slow  # (the synchronous save's kill mid-write is the fast run's: test_a_worker_killed_mid_save_...)
def test_an_async_save_killed_during_its_background_write_never_leaves_latest_on_it(tmp_path, uninterrupted):
    """--async-save: step 4's shards are written in the background (a first attempt's writes pause there, a test
    hook) while training goes on; the kill lands then. `latest` still names step-000002, the job resumes from it
    bit for bit, and the half-written step-000004 is removed at the next save."""
    def during_write(ckpt, log):
        step4 = os.path.join(ckpt, "step-000004")
        return os.path.isdir(step4) and not checkpoint_dirs.is_complete(step4) and _logged_steps(log) >= 5 \
            and open(os.path.join(ckpt, "latest")).read() == "step-000002"

    out, err, before, after = _resumed_job(tmp_path, during_write, "--async-save", "--slow-save-at-step", "4")
    assert "resuming from" in out and "step-000002 (step 2)" in out, out
    assert "removed unfinished checkpoint step-000004" in err, err[-3000:]
    final = [json.loads(line) for line in after]
    assert [r["step"] for r in final] == list(range(1, 9)) and [r["loss"] for r in final] == uninterrupted
    assert len(before) >= 5 and before[4].startswith('{"step": 5')  # training went on during the write
    assert all(r["save_blocking_s"] > 0 for r in final if r["step"] % 2 == 0)
    assert checkpoint_dirs.latest(str(tmp_path / "ckpt")).endswith("step-000008")
    assert all(checkpoint_dirs.is_complete(str(tmp_path / "ckpt" / f"step-00000{s}")) for s in (2, 4, 6, 8))


def test_a_hung_rank_ends_the_job_within_the_timeout_and_is_named(tmp_path):
    """Rank 3 (second stage, tp rank 1) sleeps at step 2: its tp peer waits in an all-reduce, the first stage in a
    p2p receive; each times out after --distributed-timeout-minutes (6 s, on the mesh's sub-groups too)."""
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "models.train", *JOB, "--pp", "2", "--steps", "4",
                             "--hang-at-step", "2", "--fail-rank", "3", "--distributed-timeout-minutes", "0.1",
                             "--log-dir", str(tmp_path / "logs")],
                            capture_output=True, text=True, timeout=300, env=env())
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 3 of 4 (node 0, local rank 3) hung at step 2: the "
                                                   "other ranks timed out after 6 s"), result.stderr[-3000:]
    assert str(tmp_path / "logs") in lines[0]
    for rank in (0, 1, 2):  # every waiting rank's own traceback is in its file
        assert "Timed out" in (tmp_path / "logs" / f"rank-{rank}.log").read_text()
    assert elapsed < 100, elapsed  # (startup of 5 processes on a loaded machine + 6 s + the 2 s grace)


def test_a_checkpoint_failure_inside_the_ranks_is_one_line(tmp_path):
    """A file where the step directory goes: DCP fails on both ranks; one line names rank 0's underlying error."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "step-000002").write_text("not a directory")
    result = subprocess.run([sys.executable, "-m", "models.train", *JOB, "--steps", "2", "--save", str(ckpt)],
                            capture_output=True, text=True, timeout=300, env=env())
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: rank 0 of 2 failed (node 0, local rank 0): FileExistsError: ")
    assert "step-000002" in lines[0] and "(torch.distributed.checkpoint failed on ranks 0, 1; rank 0's error)" \
        in lines[0] and f"(traceback: {ckpt / 'logs' / 'rank-0.log'})" in lines[0]
    assert "CheckpointException" in (ckpt / "logs" / "rank-0.log").read_text()  # the whole traceback is there


def test_checkpoint_exception_is_described_by_its_first_failing_rank():
    import torch
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning), pytest.raises(BaseException) as caught:
        dcp.save({"a": torch.ones(2)}, checkpoint_id="/dev/null/x/step-000002", no_dist=True)
    assert type(caught.value).__name__ == "CheckpointException"
    assert failures.describe(caught.value) == ("NotADirectoryError: [Errno 20] Not a directory: '/dev/null/x/"
                                               "step-000002' (torch.distributed.checkpoint failed on rank 0; rank "
                                               "0's error)")
    assert failures.kind(caught.value) == "error"
    assert failures.kind(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1")) == "peer"
    assert failures.kind(RuntimeError("[unbound_buffer.cc:78] Timed out waiting 6000ms for recv")) == "timeout"



def test_a_store_wait_that_times_out_behind_a_hung_rank_is_a_timeout():
    """Under load a rank waiting behind a hung one can time out in gloo's store (connecting a pair lazily) rather
    than in the collective: that too is a timeout, so the hung rank is named, not this one as failed."""
    import torch.distributed as dist

    error = dist.DistStoreError("wait timeout after 6000ms, keys: /attempt-0//0//cpu//0/2")
    assert failures.kind(error) == "timeout"

def _checkpoint(path, step):
    os.makedirs(path / checkpoint_dirs.step_name(step))
    (path / checkpoint_dirs.step_name(step) / ".metadata").write_text("")


def test_half_written_step_directories_are_ignored_and_removed_at_the_next_save(tmp_path):
    _checkpoint(tmp_path, 2)
    checkpoint_dirs.commit(str(tmp_path), "step-000002")
    _checkpoint(tmp_path, 4)  # complete but `latest` never moved: killed between the shards and the commit
    os.makedirs(tmp_path / "step-000006")  # shards only, no .metadata
    os.makedirs(tmp_path / "step-000010")
    assert checkpoint_dirs.latest(str(tmp_path)) == str(tmp_path / "step-000002")
    assert checkpoint_dirs.resume_path(str(tmp_path)) == str(tmp_path / "step-000002")
    assert checkpoint_dirs.remove_unfinished(str(tmp_path), 6) == ["step-000004", "step-000006", "step-000010"]
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-000002"]
    (tmp_path / "latest").unlink()  # no `latest`: the newest step directory with a .metadata
    os.makedirs(tmp_path / "step-000008")
    assert checkpoint_dirs.latest(str(tmp_path)) == str(tmp_path / "step-000002")


def test_save_and_load_the_same_directory_starts_fresh_until_it_holds_a_checkpoint(tmp_path):
    root = str(tmp_path / "run")
    assert checkpoint_dirs.resume_path(root, root) is None  # not there yet
    os.makedirs(os.path.join(root, "logs"))
    os.makedirs(os.path.join(root, "step-000002"))  # half-written only
    assert checkpoint_dirs.resume_path(root, root) is None
    with pytest.raises(ValueError, match=r"--load .*run: holds no checkpoint"):
        checkpoint_dirs.resume_path(root)  # --load alone must name a checkpoint
    with pytest.raises(ValueError, match=r"--load .*nowhere: no such directory"):
        checkpoint_dirs.resume_path(str(tmp_path / "nowhere"))
    _checkpoint(tmp_path / "run", 4)
    assert checkpoint_dirs.resume_path(root, root) == os.path.join(root, "step-000004")
    checkpoint_dirs.commit(root, "step-000009")
    with pytest.raises(ValueError, match=r"latest names step-000009, which holds no complete checkpoint"):
        checkpoint_dirs.resume_path(root, root)
    with open(os.path.join(root, "latest"), "w"):  # (emptied by hand, or by a full device)
        pass
    with pytest.raises(ValueError, match=r"run/latest is empty: it names the step directory to load \(e.g. "
                                         r"step-000004\)$"):
        checkpoint_dirs.resume_path(root, root)


def test_the_jsonl_log_keeps_one_run_across_resumes(tmp_path):
    path = tmp_path / "sub" / "log.jsonl"
    with progress.open_log(str(path), 0) as log:  # a fresh run: an empty file (parents created)
        log.writelines(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6))
    first = path.read_text()
    with progress.open_log(str(path), 5) as log:  # resumed where the log ends: appended as it is
        log.write(json.dumps({"step": 6, "loss": 0.1}) + "\n")
    assert path.read_text().startswith(first)
    with open(path, "a") as f:
        f.write('{"step": 7, "lo')  # a row cut by a kill
    with progress.open_log(str(path), 4) as log:  # resumed from step 4: rows 5.. are redone
        pass
    assert [r["step"] for r in rows(path)] == [1, 2, 3, 4] and path.read_text() == "".join(
        first.splitlines(keepends=True)[:4])


# ---- a run that diverges, a device that fills (issue 35) ----------------------------------------------------------

def _run(*flags):
    return subprocess.run([sys.executable, "-m", "models.train", *flags], capture_output=True, text=True,
                          timeout=300, env=env())


SHORT = [*JOB[:JOB.index("--tp")], "--tp", "1", "--pp", "1", "--dp", "2", "--steps", "3", "--log-interval", "1",
         "--no-sample"]


def test_a_non_finite_loss_stops_the_job_naming_the_step_and_the_rank(tmp_path):
    """Megatron's --check-for-nan-in-loss-and-grad (on by default): a NaN in rank 1's weights before step 2 (a test
    hook) makes that step's loss NaN; the job stops there, one line, exit 1, nothing of step 2 saved or logged."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    result = _run(*SHORT, "--save", str(ckpt), "--save-every", "1", "--log-jsonl", str(log),
                  "--nan-weights-at-step", "2", "--fail-rank", "1")
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "error: stopped at step 2: the loss is nan on rank 1 of 2 (--check-for-nan-in-loss-and-grad); the "
        "checkpoints and latest are as the last save left them"), result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert sorted(os.listdir(ckpt)) == ["latest", "logs", "step-000001"]
    assert (ckpt / "latest").read_text() == "step-000001" and [r["step"] for r in rows(log)] == [1]


@tp.testing.distributed(world_size=2)
def test_consecutive_skipped_steps_stop_the_job_naming_the_first_rank():
    import math

    import torch
    import torch.distributed as dist

    from models.training.failures import JobStopped
    from models.training.nan_check import NanCheck

    layer = torch.nn.Linear(2, 2)
    layer.weight.grad = torch.ones(2, 2)
    check = NanCheck(enabled=True, max_skipped=2)
    for step, norm in ((1, math.nan), (2, 1.0)):  # a finite step ends a run of skipped ones
        check.after_gradients(step, norm, layer)
        check.after_loss(step, 1.0, 1.0)
    if dist.get_rank() == 1:
        layer.weight.grad[0, 1] = math.inf  # rank 1's gradient is where the non-finite norm comes from
    check.after_gradients(3, math.nan, layer)
    check.after_loss(3, 1.0, 1.0)
    check.after_gradients(4, math.nan, layer)
    with pytest.raises(JobStopped, match=r"^stopped at step 4: 2 consecutive steps \(3\.\.4\) skipped for a "
                                         r"non-finite gradient norm, first on rank 1 of 2 \(--max-skipped-steps 2\)"):
        check.after_loss(4, 1.0, 1.0)
    off = NanCheck(enabled=False, max_skipped=1)
    for step in (1, 2, 3):
        off.after_gradients(step, math.nan, layer)
        off.after_loss(step, math.nan, math.nan)  # --no-check-for-nan-in-loss-and-grad: trains on, as before


def test_a_full_device_during_a_save_is_one_line_and_keeps_latest(tmp_path):
    """ENOSPC in the middle of rank 1's shard of step 2 (a test hook: its writes fail past 4 KiB): one line naming
    the step directory and the size a save needs (step 1's checkpoint), exit 1; the partial step directory removed,
    `latest` still on step 1."""
    ckpt = tmp_path / "ckpt"
    result = _run(*SHORT, "--save", str(ckpt), "--save-every", "1", "--no-space-at-step", "2", "--fail-rank", "1")
    assert result.returncode == 1, result.stderr[-3000:]
    size = sum(os.path.getsize(ckpt / "step-000001" / name) for name in os.listdir(ckpt / "step-000001")
               if name != "manifest.json") / 1e9
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: no space left on device at {ckpt}/step-000002 (this save needs about {size:.2g} GB)")
    assert "inline_container" not in result.stderr and "Traceback" not in result.stderr
    assert sorted(os.listdir(ckpt)) == ["latest", "logs", "step-000001"]
    assert (ckpt / "latest").read_text() == "step-000001"


def test_a_rank_stopped_by_a_peers_failure_reports_that_failure(tmp_path, monkeypatch):
    """Under two torchrun agents, node 0's agent sees only its own ranks, which fail with "connection reset by peer"
    when rank 3 on node 1 raises: its report named rank 1's echo. The first rank to fail on its own puts its line in
    torchrun's store (later failures keep it); a rank failing because a peer is gone reports that line."""
    import torch.distributed as dist

    store = dist.HashStore()
    monkeypatch.setattr(failures, "_store", lambda: store)
    monkeypatch.setattr(failures, "PEER_GRACE_S", 0.0)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    failures.publish_first_failure("rank 3 of 4 failed (node 1, local rank 1): ValueError: boom (traceback: x)")
    failures.publish_first_failure("rank 2 of 4 failed (node 1, local rank 0): an echo")  # (the first one stays)

    def echo(job):
        raise RuntimeError("[gloo] Read error [127.0.0.1]:1234: Connection reset by peer")
    assert failures.run_rank(echo, None, str(tmp_path / "logs"), 60.0) == 1
    reported = json.loads((tmp_path / "error.json").read_text())["message"]["message"]
    assert reported.startswith("rank 3 of 4 failed (node 1, local rank 1): ValueError: boom"), reported
    assert "stopped by it: rank 0" in reported


def test_a_full_device_removes_the_step_directory_on_any_rank(tmp_path):
    """A save's ENOSPC reaches every rank (DCP spreads it); each removes the step directory's files (rank 0 alone
    did: when the launcher stopped the job on another rank's line first, an async save's half-written step directory
    stayed, and on nodes without a shared file system only rank 0's node's files would go)."""
    import errno

    from models.training.saves import Saves

    saves = object.__new__(Saves)  # (rank 1 of a job: no groups needed to handle the error)
    saves.root, saves.rank0, saves.size_bytes = str(tmp_path), False, 10**6
    (tmp_path / "step-000004").mkdir()
    (tmp_path / "step-000004" / "__1_0.distcp").write_bytes(b"")
    with pytest.raises(failures.JobStopped, match=r"^no space left on device at .*step-000004"):
        saves.failed(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "step-000004")
    assert os.listdir(tmp_path) == []


def test_torch_saves_full_device_error_is_known_as_one():
    """torch.save into a full device raises `enforce fail at inline_container.cc:672 ... unexpected pos`, the OSError
    only in its context: the save's writer names it (an OSError(ENOSPC) survives DCP's gathering of errors)."""
    import errno
    import io

    import torch

    from models.training import manifest

    class Full(io.RawIOBase):
        written = 0

        def writable(self):
            return True

        def write(self, data):
            self.written += len(data)
            if self.written > 1000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return len(data)

    with pytest.raises(RuntimeError, match="inline_container") as caught:
        torch.save(torch.zeros(10_000), Full())
    assert manifest.no_space(caught.value) and not manifest.no_space(RuntimeError("unexpected pos 704 vs 598"))


def test_keep_last_removes_older_step_directories_never_latest(tmp_path):
    for step in (1, 2, 3, 4):
        _checkpoint(tmp_path, step)
    os.makedirs(tmp_path / "step-000005")  # half-written: not this rule's (the next save removes it)
    checkpoint_dirs.commit(str(tmp_path), "step-000003")  # (step 4: complete, after latest: a kill before its commit)
    assert checkpoint_dirs.keep_last(str(tmp_path), 2) == ["step-000001"]
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-000002", "step-000003", "step-000004", "step-000005"]
    assert checkpoint_dirs.committed(str(tmp_path)) == str(tmp_path / "step-000003")
    assert checkpoint_dirs.committed(str(tmp_path / "nowhere")) is None
