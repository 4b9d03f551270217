"""The training job end to end: any tp x pp x dp split (DDP or FSDP2, 1F1B or GPipe, SP) trains the same loss curve
as one process; runs repeat bit for bit; bad configurations stop before any process starts; a failing rank is named;
a run resumes as a Megatron-LM user resumes one (--use-checkpoint-args, --finetune, --keep-last)."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from models.training import checkpoint, resuming
from models.training.cli import job_config, parser, train
from tp.testing import distributed

from .helpers import train_refusal

SMALL = ["--model", "tiny", "--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2",
         "--steps", "3", "--check-inputs", "--seed", "7"]


def _losses(path):
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f]


def _run(*flags, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.run([sys.executable, "-m", "models.train", *flags], capture_output=True, text=True,
                          timeout=timeout, env=env)


@distributed(world_size=8, timeout=300)
def _train_on_ranks(flags, log):
    train(parser().parse_args([*SMALL, *flags, "--log-jsonl", log]))
    return _losses(log) if os.path.exists(log) and int(os.environ.get("RANK", "0")) == 0 else None


def _curve(tmp, name, *flags, world_size=8):
    """The curve of a job on the harness's warm ranks (world_size 1: the one-process run, without a new
    interpreter; the subprocess form is test_every_split_trains_the_same_curve's)."""
    from tp.testing import run

    log = os.path.join(tmp, f"{name}.jsonl")
    run(_train_on_ranks, world_size, flags=list(flags), log=log, timeout=300)
    return _losses(log)


def _hf_loss(path):
    """The exported model's loss on one batch of the training data, through transformers."""
    import torch
    import transformers

    from models.training import data

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    x, y = data.TokenWindows(data.corpus(), 32)[0]
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(x[None]).logits[0], y).item()


def _serial_curve(tmp_path):
    single = _run(*SMALL, "--tp", "1", "--pp", "1", "--dp", "1", "--log-jsonl", str(tmp_path / "serial.jsonl"))
    assert single.returncode == 0, single.stderr[-3000:]
    assert "done: 3 steps" in single.stdout and "loss" in single.stdout
    serial = _losses(tmp_path / "serial.jsonl")
    assert len(serial) == 3 and serial[-1] < serial[0]
    return serial


def _splits_train(tmp_path, serial, splits):
    curves = {name: _curve(str(tmp_path), name.replace(" ", "_"), *flags) for name, flags in splits.items()}
    for name, curve in curves.items():
        for step, (ours, reference) in enumerate(zip(curve, serial, strict=True)):
            assert abs(ours - reference) <= 1e-5 * reference, f"{name}, step {step + 1}: {ours} vs {reference}"
    return curves


@pytest.mark.slow
def test_more_splits_train_the_same_curve(tmp_path):
    """tp 4 with SP and full recompute, and pp 4 (the fast run: the two 2x2x2 splits below)."""
    _splits_train(tmp_path, _serial_curve(tmp_path), {
        "4x1x2 sp recompute": ["--tp", "4", "--pp", "1", "--dp", "2", "--sequence-parallel", "--recompute", "full"],
        "1x4x2": ["--tp", "1", "--pp", "4", "--dp", "2"],
    })


def test_every_split_trains_the_same_curve(tmp_path, capsys):
    serial = _serial_curve(tmp_path)
    splits = {
        "2x2x2 ddp 1f1b": ["--tp", "2", "--pp", "2", "--dp", "2"],
        "2x2x2 fsdp gpipe sp": ["--tp", "2", "--pp", "2", "--dp", "2", "--dp-mode", "fsdp", "--schedule", "gpipe",
                                "--sequence-parallel", "--export-hf", str(tmp_path / "exported")],
    }
    curves = _splits_train(tmp_path, serial, splits)
    exported = _hf_loss(tmp_path / "exported")  # FSDP2 shards gathered, two pipeline stages' files and an index
    assert abs(exported - curves["2x2x2 fsdp gpipe sp"][-1]) < 0.5 and exported < serial[0]

    # Save at 2x2x2 after 2 steps, resume at 4x1x2 (FSDP2) and at 1x1x1: step 3 as if never interrupted.
    ckpt = str(tmp_path / "ckpt")
    again = _curve(str(tmp_path), "first_two", *splits["2x2x2 ddp 1f1b"], "--steps", "2", "--save", ckpt)
    assert again == curves["2x2x2 ddp 1f1b"][:2]  # the same split again (on the same warm ranks): bit-identical
    assert open(os.path.join(ckpt, "latest")).read() == "step-000002"
    resumed = _curve(str(tmp_path), "resumed", "--tp", "4", "--pp", "1", "--dp", "2", "--dp-mode", "fsdp",
                     "--load", ckpt)
    single = _run(*SMALL, "--tp", "1", "--pp", "1", "--dp", "1", "--load", ckpt,
                  "--log-jsonl", str(tmp_path / "resumed_serial.jsonl"))
    assert single.returncode == 0, single.stderr[-3000:]
    assert "note:" not in single.stderr
    for curve in (resumed, _losses(tmp_path / "resumed_serial.jsonl")):
        assert len(curve) == 1 and abs(curve[0] - serial[2]) <= 1e-5 * serial[2], (curve, serial)
    # a resume at another --seed trains on (on the warm rank: a new interpreter per job is the subprocess form above)
    # and notes that the data order changes: a line of resuming.notes, which the job prints on stderr
    # (test_use_checkpoint_args_resumes_... reads two of them there)
    reseed = ["--tp", "1", "--pp", "1", "--dp", "1", "--load", ckpt, "--seed", "8"]
    assert len(_curve(str(tmp_path), "reseeded", *reseed, world_size=1)) == 1
    reseeded = job_config(parser().parse_args([*SMALL, *reseed]))
    extra = checkpoint.read_meta(os.path.join(ckpt, "step-000002"))["extra"]
    assert resuming.notes(reseeded, extra, 2, None)[0].startswith("note: the checkpoint's run had --seed=7: the data "
                                                                  "order")
    code, _, lines = train_refusal([*SMALL, "--load", ckpt, "--steps", "2"], capsys)
    assert code == 2 and "--steps=2 does not go beyond the checkpoint's step 2" in lines[-1]
    # with --export-hf: the checkpoint's model written as it is, no step taken (it was refused: nothing to train)
    exported_only = tmp_path / "ckpt_hf"
    run = _run(*SMALL, "--tp", "1", "--pp", "1", "--dp", "1", "--load", ckpt, "--steps", "2", "--export-hf",
               str(exported_only))
    assert run.returncode == 0 and "nothing to train" in run.stdout, run.stderr[-3000:]
    from safetensors.torch import load_file

    tensors = {k: v for f in exported_only.glob("*.safetensors") for k, v in load_file(f).items()}
    stored = {f"model.{k}": torch.empty_like(v) for k, v in tensors.items()}
    with pytest.warns(UserWarning, match="load in a single process"):  # (this process has no process group)
        dcp.load(stored, checkpoint_id=os.path.join(ckpt, "step-000002"), no_dist=True)
    assert tensors and all(torch.equal(stored[f"model.{k}"], v) for k, v in tensors.items())
    code, _, lines = train_refusal([*SMALL, "--load", ckpt, "--hidden-size", "128"], capsys)
    assert code == 2 and "the checkpoint's model has --hidden-size 64 (this job: 128)" in lines[-1]  # (once)


@pytest.mark.parametrize("flags,message", [
    (["--global-batch-size", "10"], r"--global-batch-size=10 is not divisible by --dp \* --micro-batch-size = 2\*2"),
    (["--pp", "8", "--dp", "1", "--tp", "1"], r"pp=8 pipeline stages need at least 8 layers, the model has "
                                              r"num_layers=4"),
    (["--tp", "3", "--pp", "1", "--dp", "1"], r"num_heads=4 is not divisible by tp=3"),
    (["--sequence-parallel", "--seq-len", "33"], r"--seq-len=33 is not divisible by --tp=2"),
    (["--lr", "-1"], r"--lr=-1.0 must be a finite number > 0"),
    (["--seq-len", "100000"], r"--global-batch-size=16 exceeds the \d+ sequences of --seq-len=100000"),
    (["--from-hf", "/nonexistent"], r"--from-hf /nonexistent: no such directory"),
])
def test_bad_configuration_is_one_line_before_any_process(flags, message, capsys):
    import re

    start = time.perf_counter()
    code, out, lines = train_refusal(flags, capsys)
    assert code == 2 and out == "", (out, lines)
    assert len(lines) == 1 and re.search(message, lines[0]), lines
    assert time.perf_counter() - start < 60


def test_world_size_mismatch_under_torchrun_is_refused(monkeypatch):
    from models.training.cli import main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["--tp", "2", "--pp", "2", "--dp", "2"]) == 2


def test_a_failing_rank_stops_the_others_and_is_named():
    start = time.perf_counter()
    result = _run(*SMALL, "--tp", "2", "--pp", "2", "--dp", "1", "--fail-at-step", "2", "--fail-rank", "3",
                  timeout=240)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "error: rank 3 of 4 failed" in result.stderr and "injected failure at step 2 on rank 3" in result.stderr
    assert time.perf_counter() - start < 180


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    """A save_pretrained Llama directory: 2 layers, 64 positions, a vocabulary covering bytes."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("hf") / "llama"
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("flags,message", [
    (["--lr", "nan"], r"--lr=nan must be a finite number > 0"),
    (["--lr", "inf"], r"--lr=inf must be a finite number > 0"),
    (["--weight-decay", "nan"], r"--weight-decay=nan must be a finite number >= 0"),
    (["--warmup-steps", "-3"], r"--warmup-steps=-3 must be >= 0"),
    (["--save", "{file}"], r"--save .*afile exists and is not a directory"),
    (["--export-hf", "{file}"], r"--export-hf .*afile exists and is not a directory"),
    (["--load", "{empty}"], r"holds no checkpoint"),
    (["--from-hf", "{hf}", "--num-layers", "1"], r"--from-hf takes the model's shape from its config: drop "
                                                 r"--num-layers"),
    (["--from-hf", "{hf}", "--model", "small"], r"--from-hf takes the model's shape from its config: drop --model"),
    (["--from-hf", "{hf}", "--seq-len", "128"], r"--seq-len=128 exceeds the model's max_seq_len=64"),
])
def test_bad_values_are_refused_up_front_naming_them(flags, message, tmp_path, tiny_hf_dir):
    """validate() (what the launcher runs before any process): the values that used to fail in every rank, after
    training, or not at all."""
    from models.training.cli import validate

    (tmp_path / "afile").write_text("")
    (tmp_path / "empty").mkdir()
    paths = {"file": str(tmp_path / "afile"), "empty": str(tmp_path / "empty"), "hf": tiny_hf_dir}
    args = parser().parse_args([flag.format(**paths) for flag in flags])
    with pytest.raises((ValueError, OSError), match=message):
        validate(args)


def test_from_hf_without_overrides_validates(tiny_hf_dir):
    from models.training.cli import validate

    config = validate(parser().parse_args(["--from-hf", tiny_hf_dir, "--seq-len", "64", "--tp", "2"]))
    assert (config.num_layers, config.hidden_size, config.max_seq_len) == (2, 32, 64)


def test_flags_win_over_the_checkpoints_hyperparameters():
    """A resumed run's optimizer takes --weight-decay (and the schedule's lr) from the flags, not the checkpoint."""
    import torch

    from models.training.build import set_hyperparameters
    from models.training.cli import job_config

    args = job_config(parser().parse_args(["--weight-decay", "0.5", "--lr", "1e-3", "--warmup-steps", "0"]))
    weight, norm = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([{"params": [weight]}, {"params": [norm], "weight_decay": 0.0}])
    for group in optimizer.param_groups:  # as checkpoint.load leaves them: the saved run's values
        group.update(lr=7.0, weight_decay=0.01)
    set_hyperparameters(optimizer, args, step=0)
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [(1e-3, 0.5), (1e-3, 0.0)]


def test_load_without_latest_takes_the_newest_step_directory(tmp_path):
    from models.training.checkpoint_dirs import latest as _latest

    for step in (2, 10, 9):
        (tmp_path / f"step-{step:06d}").mkdir()
        (tmp_path / f"step-{step:06d}" / ".metadata").write_text("")  # complete (a half-written one is ignored)
    (tmp_path / "step-notes.txt").write_text("")
    assert _latest(str(tmp_path)) == str(tmp_path / "step-000010")
    (tmp_path / "latest").write_text("step-000002")
    assert _latest(str(tmp_path)) == str(tmp_path / "step-000002")
    assert _latest(str(tmp_path / "step-000009")) == str(tmp_path / "step-000009")  # a step directory itself


# ---- resuming as a Megatron-LM user does (issue 35) ----------------------------------------------------------------

RESUME = ["--seq-len", "32", "--global-batch-size", "4", "--micro-batch-size", "2", "--seed", "7", "--pp", "1",
          "--dp", "1", "--log-interval", "1", "--no-sample", "--warmup-steps", "1"]


def _params(stdout):
    """The parameters the start line reports."""
    return re.search(r"hidden \d+, ([\d,]+) params\)", stdout)[1]


@pytest.fixture(scope="module")
def moe_bpe_run(tmp_path_factory):
    """An MoE model on a BPE tokenizer with documents (--reset-position-ids), 2 steps saved every step into A with
    --keep-last 1; A/logs held an earlier 4-rank run's logs."""
    import inspect

    from .helpers import build_tokenizer

    tmp = tmp_path_factory.mktemp("resume")
    text = "\n\n".join(inspect.getsource(__import__(m)) for m in ("textwrap", "shlex", "bisect"))
    (tmp / "data.txt").write_text(text)
    tokenizer = build_tokenizer(tmp / "tok", text, 300)
    (tmp / "A" / "logs").mkdir(parents=True)
    for rank in range(4):
        (tmp / "A" / "logs" / f"rank-{rank}.log").write_text("an earlier run's\n")
    result = _run("--model", "tiny-moe", "--tokenizer", tokenizer, "--reset-position-ids", *RESUME, "--tp", "1",
                  "--data", str(tmp / "data.txt"), "--steps", "2", "--save", str(tmp / "A"), "--save-every", "1",
                  "--keep-last", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp, result


def test_keep_last_and_stale_rank_logs(moe_bpe_run):
    tmp, _ = moe_bpe_run
    assert sorted(os.listdir(tmp / "A")) == ["latest", "logs", "step-000002"]  # step 1 removed after step 2's save
    # (and torchrun's own removed)
    assert sorted(os.listdir(tmp / "A" / "logs")) == ["config.toml", "data.txt", "rank-0.log"]


def test_resuming_another_model_names_the_flags(moe_bpe_run, capsys):
    """Resumed without restating --model tiny-moe and --tokenizer: one line naming the flags that differ."""
    tmp, _ = moe_bpe_run
    code, _, err = train_refusal([*RESUME, "--tp", "1", "--data", str(tmp / "data.txt"), "--steps", "3", "--load",
                                  str(tmp / "A"), "--save", str(tmp / "A")], capsys)
    assert code == 2 and len(err) == 1, err
    assert "--num-experts 8 (this job: 0)" in err[0] and "--vocab-size 300 (this job: 256)" in err[0], err
    assert err[0].endswith("give the same flags, or --use-checkpoint-args to take them from the checkpoint"), err
    code, _, err = train_refusal([*RESUME, "--tp", "1", "--data", str(tmp / "data.txt"), "--steps", "3", "--load",
                                  str(tmp / "A"), "--save", str(tmp / "A"), "--use-checkpoint-args",
                                  "--num-experts", "4"], capsys)
    assert code == 2 and err == ["error: --num-experts=4: the checkpoint's model has 8 (--use-checkpoint-args takes "
                                 "the model from it: drop the flag)"], err
    code, _, err = train_refusal(["--model", "tiny-moe", "--tokenizer", str(tmp / "tok"), *RESUME, "--tp", "1",
                                  "--data", str(tmp / "data.txt"), "--steps", "5", "--save", str(tmp / "A")], capsys)
    assert code == 2 and err == [f"error: --save {tmp / 'A'} holds step 2, later than this run's start (step 0): "
                                 f"its saves would move {tmp / 'A' / 'latest'} back; resume it (--load "
                                 f"{tmp / 'A'}) or give another --save"], err


def test_use_checkpoint_args_resumes_with_the_checkpoints_model_tokenizer_and_documents(moe_bpe_run):
    """The command line gives the layout (tp 2 now), the steps (4: a new schedule, said in one line) and the paths;
    the model, tokenizer and data format come from the checkpoint (here without its AdamW moments and generators:
    --no-load-optim, --no-load-rng). Its manifest removed: an older checkpoint, which loads with a note. The start
    line counts the whole model at either split."""
    tmp, first = moe_bpe_run
    os.remove(tmp / "A" / "step-000002" / "manifest.json")
    result = _run(*RESUME, "--tp", "2", "--data", str(tmp / "data.txt"), "--steps", "4", "--load", str(tmp / "A"),
                  "--save", str(tmp / "A"), "--use-checkpoint-args", "--no-load-optim", "--no-load-rng")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {tmp / 'A' / 'step-000002'} (step 2)" in result.stdout
    assert "done: 2 steps (3..4)" in result.stdout and _params(result.stdout) == _params(first.stdout)
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert notes[0] == f"note: {tmp / 'A' / 'step-000002'} has no manifest.json (saved before manifests): its files " \
                       "were not verified"
    assert re.fullmatch(r"note: the learning-rate schedule changed \(--steps 2 -> 4\): step 3's lr \S+ -> \S+",
                        notes[1]), notes
    config = (tmp / "A" / "logs" / "config.toml").read_text()
    assert f'tokenizer = "{tmp / "tok"}"' in config and "reset_position_ids = true" in config


def test_finetune_starts_at_step_0_from_the_weights_and_leaves_nothing_in_tmp(moe_bpe_run, tmp_path):
    """--finetune: the weights alone, steps 1..2 again. Without --save or --log-dir the ranks' logs go to
    $XDG_STATE_HOME/tp-layers/runs/...; nothing is left in the temporary directory (torchrun's, torch's caches)."""
    tmp, _ = moe_bpe_run
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path / "tmp"), XDG_STATE_HOME=str(tmp_path / "state"),
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    (tmp_path / "tmp").mkdir()
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    result = subprocess.run([sys.executable, "-m", "models.train", *RESUME, "--tp", "1", "--data",
                             str(tmp / "data.txt"), "--steps", "2", "--load", str(tmp / "A"), "--finetune",
                             "--use-checkpoint-args"], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"\(step \d\): its weights, fine-tuned from step 0 \(--finetune\)", result.stdout), result.stdout
    assert "done: 2 steps (1..2)" in result.stdout and "learning-rate" not in result.stderr
    logs = re.search(r"; rank logs: (\S+)$", result.stdout.strip())[1]
    assert logs.startswith(str(tmp_path / "state" / "tp-layers" / "runs") + "/")
    assert os.listdir(tmp_path / "tmp") == []


def test_a_resume_at_another_schedule_says_so_with_the_lr_before_and_after():
    from models.training import resuming
    from models.training.config import JobConfig

    job = JobConfig()
    job.optimizer.warmup_steps, job.training.steps = 1, 4
    saved = {k: getattr(job.optimizer, k) for k in resuming.SCHEDULE} | {"steps": 2}
    assert resuming.schedule_change(job, saved, 2, None) == ("note: the learning-rate schedule changed (--steps 2 -> "
                                                             "4): step 3's lr 0.0003 -> 0.002325")
    assert resuming.schedule_change(job, saved | {"steps": 4}, 2, None) is None
    job.optimizer.warmup_steps = saved["warmup_steps"] = 5  # still warming up: the same rates from here on
    assert resuming.schedule_change(job, saved, 2, None) is None
    assert resuming.schedule_change(job, None, 2, 7e-3) == (  # a checkpoint that kept no schedule: its last lr
        "note: the learning-rate schedule differs from the checkpoint's run: its step 2 ran at lr 0.007, this schedule "
        "gives 0.0012 (step 3: 0.0018)")
    job.evaluation.eval_only = True  # --eval-only trains no step: neither the schedule nor the data order applies
    assert resuming.notes(job, {"lr_schedule": saved, "seed": 7}, 2, 7e-3) == []
