"""The training job's typed configuration (models/training/config/) and its command line: TOML written and read back
equal, --config with the command line's flags winning, unknown keys refused in one line, the resolved configuration
each run writes beside its logs (and reruns from anywhere); the flags built from the fields, Megatron-LM's names as
aliases, an unknown flag refused in one line with suggestions; the named shapes, shared with the planner."""
import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from models.presets import MODELS
from models.training.cli import job_config, main, parser, validate
from models.training.config import JobConfig

ROOT = Path(__file__).resolve().parent.parent


def _job(*flags):
    return job_config(parser().parse_args(list(flags)))


def _run_job(flags, cwd=None):
    """`python -m models.train FLAGS` in a user's environment (no torchrun variables), from `cwd`; it succeeds."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "models.train", *flags], capture_output=True, text=True,
                            timeout=600, env=env, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _losses(path):
    return [row["loss"] for row in map(json.loads, Path(path).read_text().splitlines()) if "loss" in row]


def test_toml_round_trip(tmp_path):
    job = _job("--tp", "1", "--pp", "4", "--dp", "3", "--schedule", "interleaved", "--virtual-stages", "2",
               "--sequence-parallel", "--lr", "1e-05", "--clip-grad", "0", "--model", "small", "--num-layers", "8",
               "--attention-dropout", "0.125", "--data", str(tmp_path / 'a "quoted" dir\\x'), "--save", "ckpt",
               "--distributed-timeout-minutes", "0.5", "--fail-at-step", "3")
    path = tmp_path / "job.toml"
    path.write_text(job.to_toml())
    job.checkpoint.save = os.path.abspath("ckpt")  # (written absolute: the file runs from any directory)
    assert JobConfig.from_toml(str(path)) == job
    assert "[faults]" in path.read_text() and "[faults]" not in JobConfig().to_toml()  # (test-only: when set)
    path.write_text(JobConfig().to_toml())
    assert JobConfig.from_toml(str(path)) == JobConfig() == _job()  # the flags' defaults are the dataclasses'


def test_flags_given_on_the_command_line_win_over_the_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[parallelism]\ntp = 4\npp = 1\n\n[training]\nsteps = 7\nseq_len = 32\n\n'
                    '[model]\npreset = "small"\n')
    job = _job("--config", str(path), "--tp", "2", "--seq-len", "64")  # 2 and 64 are also the flags' defaults
    assert (job.parallelism.tp, job.parallelism.pp, job.training.steps, job.training.seq_len) == (2, 1, 7, 64)
    assert job.model.preset == "small" and job.optimizer.lr == JobConfig().optimizer.lr  # not given: the file's
    args = parser().parse_args(["--config", str(path), "--global-batch-size", "8"])
    validate(args)  # a Namespace with --config: the file and the given flags, dp resolved in both
    assert args.dp == 2


@pytest.mark.parametrize("text,message", [
    ("[training]\nstepz = 3\n", r"unknown key 'stepz' in \[training\] \(keys: steps, "),
    ("[trainer]\nsteps = 3\n", r"unknown section \[trainer\] \(sections: model, parallelism, "),
    ("[training]\nsteps = \"3\"\n", r"\[training\] steps = '3' must be an integer"),
    ("[parallelism]\nschedule = \"1F1B\"\n", r"^error: --config .*job.toml: \[parallelism\] schedule = '1F1B' must "
                                             r"be one of gpipe, 1f1b, interleaved, zb$"),
    ("[parallelism]\nrecompute_modules = [\"mlp\", \"norm\"]\n", r": \[parallelism\] recompute_modules = 'norm' must "
                                                               r"be one of "),
    ("[trainer]\nsteps = 3\n", r"\(sections: model, parallelism, .*, launch\)$"),  # (not the tests' [faults])
    ("[training\n", r"not TOML"),
    ("steps = 3\n", r": steps = 3 is outside any section; each key belongs to one \(\[training\] steps\)$"),
])
def test_a_bad_file_is_refused_in_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "job.toml"
    path.write_text(text)
    assert main(["--config", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(message, lines[0]), lines


def test_a_refusal_names_the_config_file_keys_behind_the_flags_it_names(tmp_path, capsys):
    """The checks name flags; a value the --config file gave (not the command line) is named as the file's key too."""
    path = tmp_path / "job.toml"
    path.write_text('[parallelism]\npp = 2\nvirtual_stages = 2\nschedule = "zb"\n')
    assert main(["--config", str(path), "--tp", "1", "--dp", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: --schedule zb: virtual_stages=2: ") and line.endswith(
        f" ([parallelism] schedule, virtual_stages: from --config {path})"), line
    assert main(["--config", str(path), "--tp", "1", "--dp", "1", "--schedule", "zb"]) == 2  # (--schedule given)
    assert capsys.readouterr().err.strip().endswith(f" ([parallelism] virtual_stages: from --config {path})")
    # a run's resolved config.toml (which our launcher hands its ranks) holds every key: it blames none
    from models.training import launch
    from models.training.cli import from_the_file

    written = launch.write_config(JobConfig(), str(tmp_path / "logs"))
    args = parser().parse_args(["--config", written])
    assert from_the_file("--schedule zb: virtual_stages=2: ... --virtual-stages", args) == ""


def test_a_run_writes_its_resolved_config_beside_its_logs(tmp_path):
    flags = ["--model", "tiny", "--seq-len", "32", "--global-batch-size", "4", "--micro-batch-size", "2",
             "--steps", "2", "--tp", "1", "--pp", "1", "--lr", "0.002", "--log-dir", str(tmp_path / "logs")]
    result = _run_job(flags)
    written = tmp_path / "logs" / "config.toml"
    start = next(line for line in result.stdout.splitlines() if " ranks: " in line)
    assert start.endswith(f"; config: {written}")  # the start line says where
    expected = _job(*flags)
    expected.parallelism.dp, expected.launch.device, expected.training.precision = 2, "cpu", "fp32"  # resolved
    expected.training.compile = False  # (auto: off on the CPU)
    assert JobConfig.from_toml(str(written)) == expected


def test_on_gpus_the_job_is_sized_to_them_and_defaults_to_bf16(monkeypatch):
    """(CUDA faked.) One rank per GPU: dp fills the GPUs, a layout that needs more is refused in one line that offers
    --device cpu; bf16 by default on CUDA, fp32 on the CPU; --precision wins."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("TP_DEVICE", raising=False)  # (tests/conftest.py sets it: the tests' jobs on the CPU)
    job = _job("--tp", "2", "--pp", "1", "--global-batch-size", "4")
    job.validate()
    assert (job.launch.device, job.parallelism.dp, job.training.precision) == ("cuda", 2, "bf16")
    assert job.training.compile is True  # --compile auto: compiled blocks on CUDA
    with pytest.raises(ValueError, match=r"^8 ranks on this machine \(--tp\*--cp\*--pp\*--dp = 2\*1\*2\*2\) but it "
                                         r"has 4 GPUs: NCCL needs one GPU per rank; .* or --device cpu for 8 gloo"):
        _job("--dp", "2").validate()
    job = _job("--tp", "1", "--pp", "2", "--dp", "2", "--schedule", "zb")
    job.validate()
    assert job.training.compile is False  # (auto: eager where compiled blocks cannot run; --compile on: refused)
    job = _job("--dp", "2", "--device", "cpu")
    job.validate()
    assert (job.launch.device, job.parallelism.world_size, job.training.precision) == ("cpu", 8, "fp32")
    assert job.training.compile is False  # ... eager on the CPU
    job = _job("--tp", "1", "--pp", "1", "--dp", "4", "--precision", "tf32")
    job.validate()
    assert (job.launch.device, job.training.precision) == ("cuda", "tf32")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"--device cuda: no CUDA device is visible"):
        _job("--device", "cuda").validate()
    job = _job()
    job.validate()
    assert (job.launch.device, job.parallelism.dp, job.training.precision) == ("cpu", 2, "fp32")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TP_DEVICE", "cpu")  # --device auto follows it
    job = _job()
    job.validate()
    assert (job.launch.device, job.parallelism.world_size, job.training.precision) == ("cpu", 8, "fp32")


@pytest.mark.parametrize("flags,toml,device,expected", [
    ((), None, "cpu", False), ((), None, "cuda", True), (("--compile",), None, "cpu", True),
    (("--compile", "on", "--steps", "2"), None, "cpu", True), (("--compile", "off"), None, "cuda", False),
    (("--compile", "auto"), None, "cuda", True), ((), "true", "cpu", True), ((), "false", "cuda", False),
    ((), '"off"', "cuda", False), (("--compile", "on"), "false", "cpu", True)])
def test_compile_is_auto_by_default_and_resolved_once_with_the_device(tmp_path, flags, toml, device, expected):
    """--compile auto|on|off (auto: on for CUDA, off on the CPU), a bare --compile is on, a config file's true/false
    (earlier runs' files) still read; resolved to a bool with the device; a bad value is one line."""
    if toml is not None:
        (tmp_path / "job.toml").write_text(f"[training]\ncompile = {toml}\n")
        flags = ("--config", str(tmp_path / "job.toml"), *flags)
    job = _job(*flags)
    job.training.resolve_compile(device)
    assert job.training.compile is expected
    job.training.compile = "maybe"
    with pytest.raises(ValueError, match=r"^--compile='maybe' must be one of auto, on, off \(TOML: or true, false\)$"):
        job.training.resolve_compile("cpu")


# ---- the command line built from the fields ------------------------------------------------------------------------

MEGATRON_JOB = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--train-iters", "3",
                "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8"]
OUR_JOB = ["--tp", "2", "--pp", "2", "--steps", "3", "--seq-len", "64", "--micro-batch-size", "2",
           "--global-batch-size", "8"]


@pytest.mark.parametrize("megatron,ours", [
    (MEGATRON_JOB, OUR_JOB),
    (["--context-parallel-size", "2", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
      "--sequence-parallel", "--recompute-granularity", "selective"],
     ["--cp", "2", "--ep", "2", "--etp", "1", "--sequence-parallel", "--recompute", "selective"]),
    (["--num-layers", "2", "--hidden-size", "96", "--num-attention-heads", "6", "--num-query-groups", "2",
      "--ffn-hidden-size", "128", "--kv-channels", "16", "--rotary-base", "5e5", "--init-method-std", "0.01",
      "--norm-epsilon", "1e-6", "--hidden-dropout", "0.1"],
     ["--num-layers", "2", "--hidden-size", "96", "--num-heads", "6", "--num-kv-heads", "2", "--ffn-hidden-size",
      "128", "--head-dim", "16", "--rope-theta", "500000", "--init-std", "0.01", "--norm-eps", "1e-6", "--dropout",
      "0.1"]),
    (["--lr", "1e-3", "--min-lr", "1e-5", "--lr-warmup-iters", "2", "--lr-decay-style", "linear", "--lr-decay-iters",
      "50", "--weight-decay", "0.1", "--clip-grad", "0.5", "--bf16", "--use-distributed-optimizer", "--seed", "7"],
     ["--lr", "1e-3", "--min-lr", "1e-5", "--warmup-steps", "2", "--lr-decay-style", "linear", "--lr-decay-steps",
      "50", "--weight-decay", "0.1", "--clip-grad", "0.5", "--precision", "bf16", "--dp-mode", "zero1", "--seed",
      "7"]),
    (["--save", "/c", "--load", "/c", "--save-interval", "5", "--eval-interval", "4", "--eval-iters", "2",
      "--log-interval", "1", "--tensorboard-dir", "/tb", "--wandb-project", "p", "--data-path", "0.3", "/a", "0.7",
      "/b"],
     ["--save", "/c", "--load", "/c", "--save-every", "5", "--eval-every", "4", "--eval-iters", "2", "--log-interval",
      "1", "--tensorboard-dir", "/tb", "--wandb-project", "p", "--data", "0.3", "/a", "0.7", "/b"]),
    (["--pp", "2", "--num-layers-per-virtual-pipeline-stage", "1"], ["--pp", "2", "--virtual-stages", "2",
                                                                     "--schedule", "interleaved"]),
    (["--virtual-pipeline-model-parallel-size", "2", "--schedule", "zb"], ["--virtual-stages", "2", "--schedule",
                                                                          "zb"]),
    (["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3",
      "--recompute-granularity", "selective", "--recompute-modules", "layernorm", "moe_act"],
     ["--first-stage-layers", "1", "--last-stage-layers", "3", "--recompute", "selective", "--recompute-modules",
      "layernorm", "moe_act"]),
    (["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split", "--recompute-granularity",
      "full", "--recompute-method", "block", "--recompute-num-layers", "2"],
     ["--embedding-as-layer", "--loss-as-layer", "--recompute", "full", "--recompute-method", "block",
      "--recompute-num-layers", "2"]),
])
def test_megatron_flags_are_the_same_fields(megatron, ours):
    """Megatron-LM's flag names set our fields with Megatron's meaning: the same JobConfig (hence the same run)."""
    assert _job(*megatron) == _job(*ours)


def test_virtual_stages_without_a_schedule_choose_the_interleaved_one_as_megatrons_flag_does():
    """--virtual-stages V > 1 alone ran into the default schedule's refusal (1f1b runs one chunk per rank), which
    named a --schedule the user never gave; as --virtual-pipeline-model-parallel-size, it now picks interleaved."""
    assert _job("--pp", "2", "--virtual-stages", "2") == _job("--pp", "2", "--virtual-pipeline-model-parallel-size",
                                                              "2")
    assert _job("--pp", "2", "--virtual-stages", "2").parallelism.schedule == "interleaved"
    assert _job("--pp", "2", "--virtual-stages", "2", "--schedule", "zb").parallelism.schedule == "zb"
    assert _job("--pp", "2", "--virtual-stages", "1").parallelism.schedule == "1f1b"


def test_virtual_stages_in_a_config_file_without_a_schedule_choose_the_interleaved_one(tmp_path):
    """The same rule for a --config file: its virtual_stages without a schedule of its own (or a flag's) picks
    interleaved; a schedule the file names stays."""
    path = tmp_path / "job.toml"
    path.write_text("[parallelism]\npp = 2\nvirtual_stages = 2\n")
    assert _job("--config", str(path)).parallelism.schedule == "interleaved"
    path.write_text("[parallelism]\npp = 2\nvirtual_stages = 2\nschedule = \"zb\"\n")
    assert _job("--config", str(path)).parallelism.schedule == "zb"
    path.write_text("[parallelism]\npp = 2\nschedule = \"1f1b\"\n")
    assert _job("--config", str(path), "--virtual-stages", "2").parallelism.schedule == "1f1b"  # (then refused)


@pytest.mark.parametrize("flags,message", [
    (["--num-layers-per-virtual-pipeline-stage", "3"],  # tiny: 4 layers, 2 per stage at --pp 2
     r"^--num-layers-per-virtual-pipeline-stage=3 does not divide the 4 layers' 2 per pipeline stage \(--pp=2\)$"),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--virtual-pipeline-model-parallel-size", "2"],
     r"^give one of --num-layers-per-virtual-pipeline-stage and --virtual-pipeline-model-parallel-size$"),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--first-stage-layers", "2"],
     r"^--num-layers-per-virtual-pipeline-stage with an uneven pipeline split: give --virtual-stages V"),
])
def test_megatron_virtual_pipeline_flags_refuse_what_does_not_divide(flags, message):
    with pytest.raises(ValueError, match=message):
        _job(*flags)


@pytest.mark.parametrize("flags,message", [
    (["--recompute-modules", "mlp"], r"^--recompute-modules mlp chooses what --recompute selective recomputes "
                                     r"\(--recompute=none\)$"),
    (["--recompute", "selective", "--recompute-num-layers", "2"],
     r"^--recompute-num-layers=2 groups the blocks --recompute full recomputes \(--recompute=selective\)$"),
    (["--recompute-method", "block"], r"^--recompute-method=block groups the blocks --recompute full recomputes"),
    (["--recompute", "full", "--recompute-num-layers", "0"], r"^--recompute-num-layers=0 must be >= 1$"),
    (["--first-stage-layers", "1", "--embedding-as-layer"], r"^--first-stage-layers / --last-stage-layers do not "
                                                            r"combine with --embedding-as-layer / --loss-as-layer"),
    (["--pp", "1", "--last-stage-layers", "2"], r"^--first-stage-layers / --last-stage-layers split a pipeline: "
                                                r"give --pp >= 2 \(--pp=1\)$"),
    (["--compile", "--recompute", "selective", "--recompute-modules", "core_attn", "moe_act"],
     r"^--compile with --recompute-modules core_attn moe_act: layernorm and moe_act free and refill their outputs"),
])
def test_recompute_and_stage_split_flags_refuse_what_does_not_apply(flags, message):
    """The values alone (JobConfig.validate): each option with the granularity it belongs to, one line each."""
    with pytest.raises(ValueError, match=message):
        _job(*flags).validate(world_size=None)


@pytest.mark.parametrize("flags,refused", [
    (["--lr-warmup-iters", "10", "--train-iters", "3"], True),
    (["--warmup-steps", "4", "--lr-decay-steps", "4", "--steps", "10"], True),
    (["--warmup-steps", "2", "--steps", "3"], False),
    (["--steps", "2"], False),  # the default 5 warm-up steps in a short run (the docs' smoke runs)
])
def test_a_given_warmup_the_decay_never_follows_is_refused(flags, refused):
    """Megatron asserts lr_warmup_steps < lr_decay_steps: a warm-up as long as the run never reaches --lr."""
    if refused:
        with pytest.raises(ValueError, match=r"^--warmup-steps=\d+ must be less than the decay's \d+ steps "
                                             r"\(--lr-decay-steps, default --steps\)"):
            _job(*flags)
    else:
        _job(*flags)


@pytest.mark.parametrize("flag,line", [
    ("--tensor-parallel-size", "error: unknown flag --tensor-parallel-size: did you mean --tensor-model-parallel-size"),
    ("--trainiters", "error: unknown flag --trainiters: did you mean --train-iters"),
    ("--xyzzy", "error: unknown flag --xyzzy: python -m models.train --help lists the flags"),
])
def test_an_unknown_flag_is_one_line_naming_the_closest_flags(capsys, flag, line):
    with pytest.raises(SystemExit) as exit_:
        main(["--tp", "1", flag, "3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(line) and err.count("\n") == 1, err


def test_every_flag_comes_from_its_field_and_help_shows_each_default_once():
    """Each field's flag parses to the field's type with its default (the dataclass's); --help groups them by
    section and shows a default once, the dataclass's, never written into the help by hand."""
    p = parser()
    text = re.sub(r"\s+", " ", p.format_help())
    by_dest = {a.dest: a for a in p._actions if a.default is not argparse.SUPPRESS}
    for name, section in JobConfig().sections().items():
        assert name == "faults" or f" [{name}]: " in f" {text}"  # (the tests' faults are hidden)
        for field in dataclasses.fields(section):
            action = by_dest[field.metadata.get("flag", field.name)]
            assert action.default == field.default, field.name
            assert "(default: " not in field.metadata["help"] or field.default is None, field.name
            shown = p._get_formatter()._expand_help(action) if field.metadata.get("help") else ""
            if name != "faults" and field.default is not None and field.default is not False:
                assert shown.count("(default: ") == 1 and shown.endswith(f"(default: {field.default})"), shown


def test_the_written_config_holds_every_field_with_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = _job("--save", "ckpt", "--data", "0.3", "a", "0.7", "sub/b", "--log-jsonl", "log.jsonl")
    text = job.to_toml()
    for name, section in job.sections().items():
        for field in dataclasses.fields(section) if name != "faults" else ():
            assert re.search(rf"^(# )?{field.name} ", text, re.M), field.name  # (None: a comment)
    assert f'save = "{tmp_path / "ckpt"}"' in text and f'log_jsonl = "{tmp_path / "log.jsonl"}"' in text
    assert f'path = ["0.3", "{tmp_path / "a"}", "0.7", "{tmp_path / "sub" / "b"}"]' in text


def test_the_optimizer_takes_the_adam_fields():
    import torch

    from models.training.build import build_optimizer

    job = _job("--adam-beta1", "0.8", "--adam-beta2", "0.99", "--adam-eps", "1e-6", "--lr", "0.5")
    group = build_optimizer(torch.nn.Linear(2, 2), job, 1).param_groups[0]
    assert (group["betas"], group["eps"], group["lr"]) == ((0.8, 0.99), 1e-6, 0.5)
    assert JobConfig().optimizer.adam_beta2 == 0.95  # (as before these fields: the same runs)


def test_the_docs_table_of_megatron_names_is_the_parsers():
    """docs/job-config.md's table: each Megatron-LM name and the flag of ours it sets, as the fields declare them."""
    declared = {}
    for section in JobConfig().sections().values():
        for field in dataclasses.fields(section):
            ours = "--" + field.metadata.get("flag", field.name).replace("_", "-")
            declared |= dict.fromkeys(field.metadata["aliases"], ours)
            declared |= {flag: f"{ours} {value}" for flag, value in field.metadata["consts"].items()}
    rows = re.findall(r"\| `(--[\w-]+)` \| `(--[\w -]+)` ", (ROOT / "docs" / "job-config.md").read_text())
    rows += re.findall(r"\| `--[\w-]+` \| `--[\w -]+` \| `(--[\w-]+)` \| `(--[\w -]+)` \|",
                       (ROOT / "docs" / "job-config.md").read_text())
    assert dict(rows) == declared

# ---- the named shapes: one registry for the job and the planner ---------------------------------------------------

def test_the_job_and_the_planner_take_the_same_model_names():
    from bench.plan.cli import parser as plan_parser

    def choices(p):
        return set(next(a.choices for a in p._actions if "--model" in a.option_strings))

    assert choices(parser()) == choices(plan_parser()) == set(MODELS)


SHRINK = ["--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "512", "--num-attention-heads", "4",
          "--num-query-groups", "2", "--vocab-size", "1000"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_named_shape_trains_shrunk_by_the_flags(name):
    """Every shape the planner knows is a job the trainer takes, its fields overridden to fit (checked in process:
    the GPTConfig the ranks would build)."""
    experts = ["--moe-ffn-hidden-size", "128", "--moe-layer-freq", "1"] if MODELS[name].get("num_experts") else []
    latent = MODELS[name].get("multi_latent_attention")  # (no query groups: every head its own keys and values)
    shrink = SHRINK[:8] + SHRINK[10:] if latent else SHRINK
    config = validate(_job("--model", name, *shrink, *experts, "--tp", "1", "--pp", "1", "--dp", "1"))
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size, config.num_heads, config.num_kv_heads,
            config.vocab_size) == (2, 256, 512, 4, 4 if latent else 2, 1000)
    for field in ("rope_theta", "activation", "norm", "position", "num_experts", "qk_norm"):  # the rest: the shape's
        assert getattr(config, field) == MODELS[name].get(field, getattr(type(config)(), field)), field


def test_a_given_vocab_size_must_hold_the_data():
    with pytest.raises(ValueError, match=r"^vocab_size=100 cannot hold the 256 byte tokens$"):
        validate(_job("--vocab-size", "100", "--tp", "1", "--pp", "1", "--dp", "1"))


@pytest.mark.slow  # the docs' run block trains this command in the default suite (test_docs.test_bash_blocks_run)
def test_llama3_8b_shrunk_trains_on_the_cpu(tmp_path):
    result = _run_job(["--model", "llama3-8b", *SHRINK, "--tp", "1", "--pp", "1", "--dp", "1", "--steps", "2",
                       "--global-batch-size", "2", "--seq-len", "32", "--no-sample", "--log-jsonl",
                       str(tmp_path / "log.jsonl"), "--log-dir", str(tmp_path / "logs")])
    assert "model llama3-8b (2 layers, hidden 256," in result.stdout
    losses = _losses(tmp_path / "log.jsonl")
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)


@pytest.mark.parametrize("megatron", [
    ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2", "--dp", "1", "--train-iters", "3",
     "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4"],  # 2 ranks
    pytest.param(MEGATRON_JOB, marks=pytest.mark.slow),  # the command: 8 ranks
])
def test_megatron_flags_run_and_the_written_config_reruns_them_from_another_directory(tmp_path, megatron):
    """The Megatron-named command runs (the same JobConfig as ours: test_megatron_flags_are_the_same_fields); its
    LOGDIR/config.toml, its paths given relative, reruns it from another directory: the same losses."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    (first / "corpus.txt").write_text(Path(json.__file__).read_text() * 2)
    _run_job([*megatron, "--data-path", "corpus.txt", "--data-cache-dir", "cache", "--log-dir", "logs",
              "--log-jsonl", "log.jsonl", "--no-sample"], cwd=first)
    _run_job(["--config", "../first/logs/config.toml", "--log-dir", "logs", "--log-jsonl", "log.jsonl"], cwd=second)
    assert _losses(second / "log.jsonl") == _losses(first / "log.jsonl") and len(_losses(first / "log.jsonl")) == 3


def test_use_checkpoint_args_takes_the_runs_seq_len_and_dropout_unless_given(monkeypatch, tmp_path):
    """--use-checkpoint-args: the sequence length and the dropout rates the command line leaves out come from the
    checkpoint's run (they fell back to the defaults, 64 and 0.0, silently); given ones win, a given --dropout for the
    attention's too."""
    from models.training import cli, resuming

    saved = {"config": {"dropout": 0.1, "attention_dropout": 0.05}, "extra": {"seq_len": 48}}
    monkeypatch.setattr(resuming, "_saved", lambda job: (str(tmp_path / "step-000002"), saved))

    def job(*flags):
        return cli.job_config(cli.parser().parse_args(["--load", str(tmp_path), *flags]))

    taken = job("--use-checkpoint-args")
    assert (taken.training.seq_len, taken.model.dropout, taken.model.attention_dropout) == (48, 0.1, 0.05)
    given = job("--use-checkpoint-args", "--seq-len", "32", "--hidden-dropout", "0.2")
    assert (given.training.seq_len, given.model.dropout, given.model.attention_dropout) == (32, 0.2, None)  # (--dropout
    # drives the attention's)
    both = job("--use-checkpoint-args", "--attention-dropout", "0.3")
    assert (both.model.dropout, both.model.attention_dropout) == (0.1, 0.3)
    assert job().training.seq_len == 64


def test_moe_loss_weights_and_capacity_are_training_choices_on_a_resume(monkeypatch, tmp_path):
    """The aux / z-loss coefficients and the capacity factor (Megatron's runtime arguments) hold no weights: a resume
    or --finetune may change them (they were compared like the model's shape, and refused); --use-checkpoint-args
    takes the checkpoint's unless given."""
    import dataclasses

    from models.training import checkpoint_meta, cli, model, resuming

    def job(*flags):
        return cli.job_config(cli.parser().parse_args(["--model", "tiny-moe", "--tp", "1", *flags]))

    saved_config = model.gpt_config_from_job(job("--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"))
    saved = dataclasses.asdict(saved_config)
    changed = model.gpt_config_from_job(job("--moe-aux-loss-coeff", "0.1", "--moe-capacity-factor", "1.0"))
    assert checkpoint_meta.config_differences(saved, changed) == {}
    meta = {"config": saved, "extra": {}}
    monkeypatch.setattr(resuming, "_saved", lambda job: (str(tmp_path / "step-000002"), meta))

    def resumed(*flags):
        return model.gpt_config_from_job(cli.job_config(cli.parser().parse_args(
            ["--load", str(tmp_path), "--use-checkpoint-args", "--tp", "1", *flags])))

    taken = resumed()
    assert (taken.moe_aux_loss_coeff, taken.moe_z_loss_coeff, taken.moe_capacity_factor) == (0.01, 0.001, None)
    given = resumed("--moe-aux-loss-coeff", "0.1", "--moe-capacity-factor", "1.25")
    assert (given.moe_aux_loss_coeff, given.moe_z_loss_coeff, given.moe_capacity_factor) == (0.1, 0.001, 1.25)


def test_an_export_no_hugging_face_family_holds_is_refused_before_any_process(capsys, tmp_path):
    """--export-hf of a model no Hugging Face family represents (small-moe's dense first layer and shared expert) was
    found after the training, at the save; it is one line before any process starts. A sigmoid router fits
    glm4_moe, which --hf-model-type chooses."""
    from tests.helpers import train_refusal

    code, _, lines = train_refusal(["--model", "small-moe", "--hidden-size", "64", "--num-heads", "4",
                                    "--num-kv-heads", "2", "--tp", "1", "--pp", "1", "--dp", "1",
                                    "--export-hf", str(tmp_path / "out")], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: --export-hf {tmp_path / 'out'}: this GPTConfig has no Hugging Face mixtral "
                               "equivalent"), lines
    sigmoid = ["--model", "tiny-moe", "--moe-router-score", "sigmoid", "--tp", "1", "--pp", "1", "--dp", "1",
               "--export-hf", str(tmp_path / "out")]
    code, _, lines = train_refusal(sigmoid, capsys)
    assert code == 2 and "hf_model_type='glm4_moe' fits (--hf-model-type)" in lines[0], lines
    config = model_of(*sigmoid, "--hf-model-type", "glm4_moe")
    assert config.hf_model_type == "glm4_moe"
    from models.hf import check_hf

    assert check_hf(config) == "glm4_moe"


def model_of(*flags):
    from models.training import model

    return model.gpt_config_from_job(_job(*flags))


def test_moe_flags_on_a_dense_model_are_refused_as_ep_is(capsys):
    """--moe-router-topk / --moe-capacity-factor with a dense model trained it without them, silently."""
    from tests.helpers import train_refusal

    code, _, lines = train_refusal(["--model", "tiny", "--moe-router-topk", "2", "--moe-capacity-factor", "1.0"],
                                   capsys)
    assert code == 2 and lines == ["error: --moe-router-topk=2 --moe-capacity-factor=1.0 configure a mixture of "
                                   "experts, and the model has none: give --num-experts E (or --model tiny-moe / "
                                   "small-moe)"], lines
