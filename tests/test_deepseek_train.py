"""`python -m models.train --model tiny-deepseek` (multi-head latent attention, group-limited sigmoid routing with its
bias update, the sequence-wise loss, one MTP depth on the last stage): the LM loss, the MTP loss, the sequence-wise
loss, the load imbalance and the grad norm of every split equal the one-process run's (fp32, 1e-5 relative); a run
resumed at another ep continues the curve exactly; the checkpoint holds the MTP layer under DeepSeek-V3's names and
the HF export carries it where DeepSeek's checkpoints do."""
import json
import os

import pytest

from tp.testing import run

JOB = ["--model", "tiny-deepseek", "--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2",
       "--steps", "3", "--seed", "7", "--no-sample", "--moe-seq-aux-loss-coeff", "0.01"]
KEYS = ("loss", "grad_norm", "mtp_loss", "moe_seq_aux_loss", "moe_load_imbalance")


def _job(flags, log):
    from models.training.cli import parser, train

    train(parser().parse_args([*JOB, *flags, "--log-jsonl", log]))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(log) as f:
            return [json.loads(line) for line in f]


def _records(tmp, name, world_size, *flags):
    return run(_job, world_size, flags=list(flags), log=os.path.join(tmp, f"{name}.jsonl"), timeout=300)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process; tp 2 x pp 2 x dp 2 with ep 2 (checkpoints every step, the HF export); resumed from its step 1 at
    ep 4, etp 1."""
    tmp = tmp_path_factory.mktemp("deepseek_runs")
    out = {"tmp": tmp, "serial": _records(tmp, "serial", 1, "--tp", "1", "--pp", "1", "--dp", "1")}
    out["tp2 pp2 dp2 ep2"] = _records(tmp, "ep2", 8, "--tp", "2", "--pp", "2", "--dp", "2", "--ep", "2", "--save",
                                      str(tmp / "ckpt"), "--save-every", "1", "--export-hf", str(tmp / "hf"))
    out["resumed ep4 etp1"] = _records(tmp, "resumed", 8, "--tp", "2", "--pp", "2", "--dp", "2", "--ep", "4",
                                       "--etp", "1", "--load", str(tmp / "ckpt" / "step-000001"))
    return out


def _same_curve(ours, serial, name):
    reference = serial[-len(ours):]
    for step, (mine, want) in enumerate(zip(ours, reference, strict=True)):
        for key in KEYS:
            assert abs(mine[key] - want[key]) <= 1e-5 * abs(want[key]), (name, step, key, mine[key], want[key])


def test_splits_and_an_ep_change_on_resume_train_the_one_process_curve(runs):
    serial = runs["serial"]
    assert len(serial) == 3 and serial[-1]["loss"] < serial[0]["loss"]
    assert all(r["mtp_loss"] > 0 and r["moe_seq_aux_loss"] > 0 for r in serial)
    _same_curve(runs["tp2 pp2 dp2 ep2"], serial, "tp2 pp2 dp2 ep2")
    assert len(runs["resumed ep4 etp1"]) == 2
    _same_curve(runs["resumed ep4 etp1"], serial, "resumed ep4 etp1")


def test_the_checkpoint_and_the_export_keep_the_mtp_layer(runs):
    """The checkpoint's keys and the export's tensors hold the MTP layer as DeepSeek-V3's checkpoints do (the layer
    after the last: enorm, hnorm, eh_proj, shared_head.norm and a decoder layer), with num_nextn_predict_layers;
    the GPT reads it back with the MTP depth."""
    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(runs["tmp"] / "ckpt" / "step-000003")).read_metadata().state_dict_metadata
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate.e_score_correction_bias"):
        assert f"model.model.layers.4.{name}" in keys, name
    hf = runs["tmp"] / "hf"
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["num_nextn_predict_layers"] == 1
    names = set()
    for path in hf.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            names |= set(f.keys())
    assert {"model.layers.4.eh_proj.weight", "model.layers.4.mlp.experts.0.gate_proj.weight"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("name,flags", [
    ("cp2 pp2 dp2 ep2", ["--tp", "1", "--cp", "2", "--pp", "2", "--dp", "2", "--ep", "2"]),
    ("tp2 pp2 dp2 ep2 interleaved", ["--tp", "2", "--pp", "2", "--dp", "2", "--ep", "2", "--schedule",
                                     "interleaved", "--virtual-stages", "2"]),
])
def test_cp_and_interleaved_pipelines_train_the_one_process_curve(runs, name, flags, tmp_path):
    _same_curve(_records(tmp_path, "split", 8, *flags), runs["serial"], name)
