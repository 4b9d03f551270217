"""A run you can watch, through the real job on CPU processes: TensorBoard scalars (read back with EventAccumulator)
and a W&B offline run equal the JSONL rows; a profile trace per rank is valid JSON naming the stages' F/B actions
and the collectives; a rank made slow on purpose is named (slowest_rank, a warning); the log's plot and the greedy
sample at the end, which `python -m models.generate --load` continues alike through its KV cache; Megatron's
learning-rate schedules. Bad input is one line before any process."""
import glob
import json
import os
import struct
import subprocess
import sys

import pytest

from models.training import sinks
from models.training.cli import main
from models.training.config import OptimizerConfig
from tp.testing import run

from .helpers import GREEDY_MARGIN, greedy_margin

JOB = ["--model", "tiny", "--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--seed", "7",
       "--log-interval", "1"]


def env():
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT", "TORCHELASTIC_RUN_ID", "WANDB_API_KEY",
                                                               "WANDB_MODE")}
    return clean | {"OMP_NUM_THREADS": "1", "HOME": os.environ.get("HOME", "/tmp")}


def rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def tensorboard_rows(path):
    """{step: {tag: value}} of a TensorBoard log directory (what TensorBoard shows: purged steps hidden)."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(path), size_guidance={accumulator.SCALARS: 0})
    events.Reload()
    out = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            assert tag not in out.setdefault(event.step, {}), f"step {event.step} of {tag} twice"
            out[event.step][tag] = event.value
    return out


def assert_same_rows(board, logged):
    """TensorBoard holds every number of every JSONL row, at its step, under its name (float32)."""
    import numpy as np

    expected = {r["step"]: {k: float(np.float32(v)) for k, v in sinks.scalars(r).items()} for r in logged}
    assert sorted(board) == sorted(expected)
    for step, values in expected.items():
        assert board[step] == pytest.approx(values, rel=1e-6), step


def wandb_rows(directory):
    """{step: {key: value}} of the history records in an offline W&B run directory's .wandb file (a LevelDB-style log
    of protobuf Records in 32 KiB blocks after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data = open(glob.glob(os.path.join(directory, "run-*.wandb"))[0], "rb").read()
    assert data[:4] == b":W&B"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # a whole record, or its last piece
            records.append(pending)
    out = {}
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in
                     record.history.item}
            out[items.pop("_step")] = {k: v for k, v in items.items() if not k.startswith("_")}
    return out


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    """One job watched every way: tp 2 x pp 2, rank 2 made slow (busy 0.4 s more per step), steps 2..3 profiled,
    TensorBoard, W&B (if installed), a JSONL log and its plot, a checkpoint, the sample at the end."""
    tmp = tmp_path_factory.mktemp("watched")
    wandb = ["--wandb-project", "watch-test", "--wandb-run-name", "t"] if _has("wandb") else []
    result = subprocess.run([sys.executable, "-m", "models.train", *JOB, "--tp", "2", "--pp", "2", "--dp", "1",
                             "--steps", "4", "--slow-step-s", "0.4", "--fail-rank", "2", "--profile-steps", "2:3",
                             "--profile-dir", str(tmp / "profile"), "--tensorboard-dir", str(tmp / "tb"),
                             "--log-jsonl", str(tmp / "run.jsonl"), "--save", str(tmp / "ckpt"),
                             "--lr-decay-style", "linear", "--min-lr", "0", "--warmup-steps", "1",
                             "--eval-every", "2", *wandb],
                            capture_output=True, text=True, timeout=600, env=env())
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp, result


def _has(package):
    import importlib.util

    return importlib.util.find_spec(package) is not None


def test_tensorboard_holds_the_jsonl_rows_and_the_config(watched):
    tmp, _ = watched
    logged = rows(tmp / "run.jsonl")
    assert [r["step"] for r in logged] == [1, 2, 3, 4] and "val_loss" in logged[1] and "save_blocking_s" in logged[3]
    assert_same_rows(tensorboard_rows(tmp / "tb"), logged)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp / "tb"))
    events.Reload()
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "[parallelism]" in text and "tp = 2" in text


def test_wandb_offline_run_holds_the_rows(watched):
    pytest.importorskip("wandb")
    tmp, _ = watched
    runs = glob.glob(str(tmp / "ckpt" / "logs" / "wandb" / "offline-run-*"))
    assert len(runs) == 1, runs  # offline: no credentials in the environment
    logged = rows(tmp / "run.jsonl")
    assert wandb_rows(runs[0]) == {r["step"]: sinks.scalars(r) for r in logged}


def test_profile_traces_name_the_pipeline_actions_and_collectives(watched):
    tmp, result = watched
    traces = sorted(os.listdir(tmp / "profile"))
    assert traces == [f"rank-{r}.json" for r in range(4)]
    names = {rank: {e.get("name") for e in json.load(open(tmp / "profile" / f"rank-{rank}.json"))["traceEvents"]}
             for rank in (0, 2)}
    for rank, stage in ((0, 0), (2, 1)):  # global rank 2 is the second stage's tp rank 0
        assert {f"F stage={stage} chunk=0 micro=0", f"BW stage={stage} chunk=0 micro=3", "step 2", "step 3",
                "clip_grad_norm", "optimizer.step"} <= names[rank], sorted(n for n in names[rank] if n)[:50]
        assert "step 1" not in names[rank] and "step 4" not in names[rank]
        assert any(n and n.startswith("gloo:all_reduce") for n in names[rank])
    assert any(n and n.startswith("gloo:send") for n in names[0]) and "recv for BW stage=0 chunk=0 micro=0" in names[0]
    assert "profile of steps 2..3" in result.stdout


def test_the_slow_rank_is_named(watched):
    tmp, result = watched
    logged = rows(tmp / "run.jsonl")
    assert all(r["slowest_rank"] == 2 for r in logged), [r["slowest_rank"] for r in logged]
    assert all(r["rank_step_s_max"] > 3 * r["rank_step_s_min"] for r in logged)  # (CPU time: 0.4 s more on rank 2)
    warnings = [line for line in result.stderr.splitlines() if "straggler" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: rank 2 is a straggler"), result.stderr[-2000:]


def test_at_two_ranks_a_straggler_is_measured_against_the_other(capsys):
    """The median of two step times is their mean, never below half the slower one: at --straggler-factor >= 2 a
    rank 35x slower than its peer was never named. Each rank is measured against the median of the others."""
    from models.training.stragglers import PERSISTENT, Stragglers

    watch = Stragglers(interval=1, factor=2.0, rank0=True)
    for step in range(1, PERSISTENT + 1):
        watch._watch(step, [0.029, 1.02])
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: rank 1 is a straggler: its steps took 1.02 s at step {PERSISTENT}, 35.2x the "
                           "median 0.029 s of the other ranks"), line
    watch._watch(1, [0.5])  # (one rank: nobody to compare with)


def test_the_run_ends_with_its_plot_and_a_sample_that_generate_continues(watched):
    tmp, result = watched
    png = tmp / "run.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"(plot: {png})" in result.stdout
    lines = result.stdout.splitlines()
    at = lines.index("sample (greedy, after 'def '; --no-sample skips it):")
    sample = "\n".join(lines[at + 1:-1])
    assert sample.startswith("def ") and len(sample) > 10 and lines[-1].startswith("done: 4 steps")
    generated = subprocess.run([sys.executable, "-m", "models.generate", "--load", str(tmp / "ckpt"), "--prompt",
                                "def ", "--max-new-tokens", "8"], capture_output=True, text=True, timeout=300,
                               env=env())
    assert generated.returncode == 0, generated.stderr[-3000:]
    # each choice far from a tie (tests/helpers.py): the pipeline and the KV cache choose alike on any machine
    assert run(_greedy_margin, 1, path=str(tmp / "ckpt"), text=sample[:12])[0] >= GREEDY_MARGIN
    assert generated.stdout == sample[:12] + "\n"  # the KV cache's greedy tokens are the pipeline's


def _greedy_margin(path, text):
    """greedy_margin of the checkpoint's model (one rank) over `text` after "def " (its bytes: the tiny preset's
    tokens), from its full forward (the pipeline's sample's)."""
    import torch

    import tp
    from models import GPT
    from models.generate import parser, resolve
    from models.training import checkpoint

    config, step_dir, _ = resolve(parser().parse_args(["--load", path, "--prompt", text]))
    mesh = tp.init_mesh(tp=1)
    model = GPT(config, group=mesh.tp_group)
    checkpoint.load(step_dir, model, None, mesh=mesh)
    ids = torch.tensor([list(text.encode())])
    with torch.no_grad():
        return greedy_margin(model(ids)[:, 3:-1], ids[:, 4:])


def test_learning_rate_schedules():
    lr = OptimizerConfig(lr=1.0, warmup_steps=2, min_lr=0.0, lr_decay_style="linear")
    assert [lr.learning_rate(s, 6) for s in range(7)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    assert [round(OptimizerConfig(lr=1.0, warmup_steps=0, min_lr=0.1).learning_rate(s, 4), 6)
            for s in range(5)] == [1.0, 0.868198, 0.55, 0.231802, 0.1]  # cosine from lr to min_lr
    wsd = OptimizerConfig(lr=1.0, warmup_steps=1, min_lr=0.0, lr_decay_style="wsd", lr_wsd_decay_steps=2)
    assert [wsd.learning_rate(s, 6) for s in range(7)] == [1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0]
    constant = OptimizerConfig(lr=1.0, warmup_steps=1, lr_decay_style="constant")
    assert [constant.learning_rate(s, 4) for s in range(4)] == [1.0] * 4
    decay = OptimizerConfig(lr=1.0, warmup_steps=0, min_lr=0.0, lr_decay_style="linear", lr_decay_steps=2)
    assert [decay.learning_rate(s, 4) for s in range(4)] == [1.0, 0.5, 0.0, 0.0]  # --min-lr after the decay
    default = OptimizerConfig(lr=1.0, warmup_steps=0)  # the job's default: cosine to lr / 10 over --steps
    assert default.learning_rate(0, 10) == 1.0 and default.learning_rate(10, 10) == pytest.approx(0.1)


def test_the_logged_lr_follows_the_flags(watched):
    tmp, _ = watched
    assert [r["lr"] for r in rows(tmp / "run.jsonl")] == pytest.approx([0.003, 0.003, 0.002, 0.001])


def test_wandb_sink_continues_the_checkpoints_run(monkeypatch, tmp_path):
    """With a stand-in wandb module: offline without credentials, the resumed run's id passed back, rows logged at
    their step."""
    import types

    calls = []

    class Run:
        id = "run-from-init"

        def log(self, row, step):
            calls.append(("log", step, row))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or Run(),
                                 Settings=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    from models.training.config import JobConfig

    job = JobConfig().with_flags({"wandb_project": "p", "log_dir": str(tmp_path)})
    sink = sinks.Sinks(job, 4, wandb_run_id="abc")
    sink.write({"step": 5, "loss": 1.5, "bubble": None, "skipped": True, "slowest_rank": 3})
    sink.close()
    (_, init), log, finish = calls
    assert init["id"] == "abc" and init["resume"] == "allow" and init["mode"] == "offline" and init["project"] == "p"
    assert init["dir"] == str(tmp_path) and init["config"]["parallelism"]["tp"] == 2
    assert log == ("log", 5, {"loss": 1.5, "slowest_rank": 3}) and finish == ("finish",)
    assert sink.run_id == "run-from-init"
    monkeypatch.setenv("WANDB_API_KEY", "x")
    assert sinks.wandb_mode() is None  # credentials: W&B decides (online)


@pytest.mark.parametrize("flags,message", [
    (["--profile-steps", "3:9", "--steps", "5"], r"^--profile-steps 3:9: step 9 is outside the run \(--steps=5\)$"),
    (["--profile-steps", "0:2"], r"^--profile-steps '0:2' must be A:B, optimizer steps 1 <= A <= B$"),
    (["--profile-steps", "4:2"], r"^--profile-steps '4:2' must be A:B"),
    (["--profile-ranks", "0"], r"^--profile-ranks goes with --profile-steps A:B$"),
    (["--profile-steps", "1:2", "--profile-ranks", "0,8"], r"^--profile-ranks 0,8: rank 8 is outside the world of 8"),
    (["--tensorboard-dir", "/dev/null/tb"], r"^--tensorboard-dir /dev/null/tb: /dev/null is not a directory"),
    (["--profile-steps", "1:2", "--profile-dir", "/dev/null/p"], r"^--profile-dir /dev/null/p: /dev/null is not a"),
    (["--wandb-run-name", "x"], r"^--wandb-run-name names a W&B run: give --wandb-project too$"),
    (["--lr-decay-style", "wsd", "--lr-wsd-decay-steps", "0"], r"^--lr-wsd-decay-steps=0 must be >= 1$"),
    (["--min-lr", "0.1"], r"^--min-lr=0.1 must be a number in \[0, --lr=0.003\]$"),
    (["--straggler-factor", "1"], r"^--straggler-factor=1.0 must be a number > 1$"),
])
def test_bad_watch_flags_are_one_line_before_any_process(flags, message, capsys):
    import re

    assert main(flags) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and re.search(message, err.strip()[len("error: "):]), err


def test_a_missing_optional_package_is_one_line(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert main(["--tensorboard-dir", "tb"]) == 2
    assert capsys.readouterr().err == ("error: --tensorboard-dir needs the tensorboard package: pip install "
                                       "tensorboard (or tp-layers[tensorboard])\n")


def test_the_progress_line_shows_lr_tokens_throughput_peak_memory_and_elapsed_time():
    """Issue 35: the console line showed loss, grad_norm, tok_s and s/step only."""
    import io
    import re

    from models.training import progress

    stream = io.StringIO()
    bar = progress.progress(True, 0, 2, interval=1, stream=stream)
    record = {"loss": 4.5, "grad_norm": 1.25, "lr": 3e-4, "tokens_per_s": 1234.4, "bubble": 0.25}
    bar.update(1)
    bar.set_postfix(**progress.postfix(record, tokens=131072, peak_bytes=3 * 2**30, bubble=True))
    assert re.fullmatch(r"step 1/2 \| loss 4\.5000 \| grad_norm 1\.250 \| lr 0\.0003 \| tokens 131K \| tok_s 1234 \| "
                        r"bubble 0\.25 \| peak_mem 3\.00 GiB \| elapsed 0:00:00 \| [\d.e-]+ s/step\n",
                        stream.getvalue()), stream.getvalue()
    assert progress.peak_memory_bytes(None) > 2**20  # (this process's resident high-water mark, on the CPU)
    assert progress.postfix({**record, "grad_norm": None, "skipped": True}, tokens=5, peak_bytes=0,
                            bubble=False)["grad_norm"] == "skipped"


def _profile_two_steps(profile_dir):
    import time

    from models.training.config import JobConfig
    from models.training.profiling import StepProfiler

    job = JobConfig().with_flags({"profile_steps": "1:2", "profile_dir": profile_dir})
    profiler = StepProfiler(job)
    taken = []
    for n in (1, 2, 3):
        with profiler.step(n):
            time.sleep(0.01)
        taken.append(profiler.take_export_s())
    return taken, os.listdir(profile_dir)


def test_the_trace_export_is_timed_for_the_progress_line_to_leave_out(tmp_path):
    """Writing the trace after the window's last step is not training: the profiler hands its seconds to the trainer,
    which leaves them out of the progress line's s/step as it does evaluations and saves (it showed 0.63 s/step
    where the JSONL's step_s said 0.21)."""
    [(taken, written)] = run(_profile_two_steps, 1, profile_dir=str(tmp_path / "profile"))
    assert written == ["rank-0.json"]
    assert taken[0] == 0 and taken[1] > 0 and taken[2] == 0
