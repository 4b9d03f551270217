"""Defects found by trying the job as a new user would (issue 28), each a test that failed before its fix: the
Hugging Face export after --tokenizer (tokenizer files, token ids, file modes); a corrupt or truncated checkpoint
refused in one line before any process; val_loss on the progress line, whose s/step leaves evaluation out; `| head`
ends quietly; --help's defaults once; the start line at --pp 1; where a run without --save leaves its logs; the
planner's required flags. (The restart line: tests/test_faults.py.)"""
import inspect
import io
import json
import os
import pickle
import re
import shutil
import stat
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from models.training import progress
from models.training.cli import main, parser

transformers = pytest.importorskip("transformers")
JOB = ["--model", "tiny", "--seq-len", "32", "--global-batch-size", "4", "--micro-batch-size", "2", "--seed", "7",
       "--tp", "1", "--pp", "1", "--dp", "1", "--log-interval", "1"]


def env():
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    return clean | {"OMP_NUM_THREADS": "1"}


def tokenizer_dir(path, text):
    """A byte-level BPE trained here whose special tokens are <unk> 0, <eos> 1, <bos> 2 (Llama's defaults swapped)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>", "<bos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="<eos>",
                                         bos_token="<bos>").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A run on a user's text with --tokenizer and --export-hf, without --save or --log-dir."""
    tmp = tmp_path_factory.mktemp("export")
    text = "\n\n".join(inspect.getsource(__import__(m)) for m in ("textwrap", "shlex", "bisect"))
    (tmp / "data.txt").write_text(text)
    tokenizer = tokenizer_dir(tmp / "tokenizer", text)
    result = subprocess.run([sys.executable, "-m", "models.train", *JOB, "--steps", "2", "--data",
                             str(tmp / "data.txt"), "--tokenizer", tokenizer, "--export-hf", str(tmp / "out")],
                            capture_output=True, text=True, timeout=600, env=env())
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp, result


def test_export_hf_after_tokenizer_holds_the_tokenizer_and_its_token_ids(exported):
    tmp, _ = exported
    out = tmp / "out"
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)  # the tokenizer files are in the export
    assert (tokenizer.eos_token_id, tokenizer.bos_token_id) == (1, 2)
    config = json.loads((out / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"]) == (1, 2)  # not Llama's defaults, eos 2 bos 1
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.generation_config.eos_token_id == 1  # generate stops on the tokenizer's <eos>
    modes = {name: stat.S_IMODE(os.stat(out / name).st_mode) for name in ("config.json", "model.safetensors")}
    assert modes["model.safetensors"] == modes["config.json"], modes  # (safetensors wrote 0600)


def test_the_start_line_at_pp_1_names_no_schedule_and_the_done_line_the_logs(exported):
    _, result = exported
    start = next(line for line in result.stdout.splitlines() if line.startswith("1 ranks:"))
    assert "schedule=" not in start and "no pipeline" in start, start
    done = result.stdout.splitlines()[-1]
    logs = re.search(r"; rank logs: (\S+)$", done)  # a run without --save says where its log folder is
    assert done.startswith("done: 2 steps") and logs and os.path.isfile(os.path.join(logs[1], "rank-0.log")), done


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """A small DCP checkpoint (a meta entry and a tensor), written by this process alone."""
    path = tmp_path_factory.mktemp("ckpt") / "step-000002"
    with pytest.warns(UserWarning):
        dcp.save({"meta": pickle.dumps({"step": 2}), "w": torch.randn(4096)}, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.mark.parametrize("damage", ["metadata", "shard"])
def test_a_corrupt_or_truncated_checkpoint_is_one_line_before_any_process(checkpoint_dir, damage, tmp_path, capsys):
    bad = tmp_path / "step-000002"
    shutil.copytree(checkpoint_dir, bad)
    if damage == "metadata":
        (bad / ".metadata").write_bytes(b"\x80\x04garbage" * 10)
        expected = rf"^error: --load {bad}: {bad}/.metadata is not a readable checkpoint index \(\w+"
    else:
        shard = bad / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:5000])
        expected = rf"^error: --load {bad}: {shard} is truncated: 5000 bytes, the checkpoint's .metadata says \d+$"
    assert main([*JOB, "--load", str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and re.search(expected, err.strip()), err


def test_the_progress_line_shows_val_loss_and_its_s_per_step_leaves_evaluation_out():
    stream = io.StringIO()
    bar = progress.progress(True, 0, 10, interval=5, stream=stream)
    bar.update(1)
    bar.set_postfix(loss="4.0000")
    assert stream.getvalue() == ""  # step 1 of interval 5: not due
    time.sleep(0.3)  # an evaluation
    progress.exclude(bar, 0.3)
    bar.update(1)
    bar.set_postfix(loss="3.9000", val_loss="3.8000")  # shown when evaluated, interval or not
    line = stream.getvalue().strip()
    assert line.startswith("step  2/10 | loss 3.9000 | val_loss 3.8000 | ")
    assert float(line.split(" | ")[-1].split()[0]) < 0.1, line  # the 0.3 s of evaluation are not a step's


def test_a_closed_stdout_ends_the_job_quietly(tmp_path):
    """`python -m models.train | head -3` used to end in a BrokenPipeError line naming rank 0 as failed."""
    command = f"{sys.executable} -m models.train {' '.join(JOB)} --steps 40 2> {tmp_path / 'err'} | head -3"
    result = subprocess.run(["bash", "-c", f"set -o pipefail; {command}"], capture_output=True, text=True,
                            timeout=300, env=env())
    lines = result.stdout.splitlines()  # what the launcher found, then the layout rank 0 prints
    assert len(lines) == 3 and lines[0].startswith("data: the corpus") and lines[1].startswith("layout:")
    assert (tmp_path / "err").read_text() == "" and result.returncode == 141  # as a tool killed by SIGPIPE


def test_help_shows_each_default_once():
    helps = [action.help for action in parser()._actions if action.help]
    text = parser().format_help()
    assert "(default: --dropout)" in text
    assert not re.search(r"default[^()]*\) \(default", text), [h for h in helps if h.count("default") > 1]
    assert "(default: None)" not in text.replace("\n", " ").split("--attention-dropout")[1].split("--from-hf")[0]


def test_the_planners_required_flags_are_shown_and_asked_for_at_once():
    result = subprocess.run([sys.executable, "-m", "bench.plan", "--help"], capture_output=True, text=True,
                            timeout=120, env=env())
    usage = result.stdout.split("\n\n")[0]
    assert "--gpus N --seq-len S --global-batch-size B" in usage and "[--seq-len" not in usage, usage
    result = subprocess.run([sys.executable, "-m", "bench.plan", "--model", "tiny"], capture_output=True,
                            text=True, timeout=120, env=env())
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith("error: missing --gpus, --seq-len, --global-batch-size "
                                                           "(see the usage above)")
