"""The training job's typed configuration (models/training/config/): TOML written and read back equal, --config
with the command line's flags winning, unknown keys refused in one line, the resolved configuration each run writes
beside its logs."""
import os
import subprocess
import sys

import pytest

from models.training.cli import job_config, main, parser, validate
from models.training.config import JobConfig


def _job(*flags):
    return job_config(parser().parse_args(list(flags)))


def test_toml_round_trip(tmp_path):
    job = _job("--tp", "1", "--pp", "4", "--dp", "3", "--schedule", "interleaved", "--virtual-stages", "2",
               "--sequence-parallel", "--lr", "1e-05", "--clip-grad", "0", "--model", "small", "--num-layers", "8",
               "--attention-dropout", "0.125", "--data", str(tmp_path / 'a "quoted" dir\\x'), "--save", "ckpt",
               "--distributed-timeout-minutes", "0.5", "--fail-at-step", "3")
    path = tmp_path / "job.toml"
    path.write_text(job.to_toml())
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
    ("[parallelism]\nschedule = \"1F1B\"\n", r"--schedule=1F1B must be one of gpipe, 1f1b, interleaved, zb"),
    ("[training\n", r"not TOML"),
])
def test_a_bad_file_is_refused_in_one_line(tmp_path, capsys, text, message):
    import re

    path = tmp_path / "job.toml"
    path.write_text(text)
    assert main(["--config", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(message, lines[0]), lines


def test_a_run_writes_its_resolved_config_beside_its_logs(tmp_path):
    flags = ["--model", "tiny", "--seq-len", "32", "--global-batch-size", "4", "--micro-batch-size", "2",
             "--steps", "2", "--tp", "1", "--pp", "1", "--lr", "0.002", "--log-dir", str(tmp_path / "logs")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")} | {"OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "models.train", *flags], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    written = tmp_path / "logs" / "config.toml"
    start = next(line for line in result.stdout.splitlines() if " ranks: " in line)
    assert start.endswith(f"; config: {written}")  # the start line says where
    expected = _job(*flags)
    expected.parallelism.dp, expected.launch.device, expected.training.precision = 2, "cpu", "fp32"  # resolved
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
    with pytest.raises(ValueError, match=r"^8 ranks on this machine \(--tp\*--cp\*--pp\*--dp = 2\*1\*2\*2\) but it "
                                         r"has 4 GPUs: NCCL needs one GPU per rank; .* or --device cpu for 8 gloo"):
        _job("--dp", "2").validate()
    job = _job("--dp", "2", "--device", "cpu")
    job.validate()
    assert (job.launch.device, job.parallelism.world_size, job.training.precision) == ("cpu", 8, "fp32")
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
