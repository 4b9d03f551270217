"""Checkpoints that reshard: train AdamW at one tp/pp/dp split, save, load at another (tp 2->4 and 4->1, pp 2<->1, dp
1->4, DDP, FSDP2, the distributed optimizer (zero1, also over two model chunks per rank), bf16 with fp32 masters, tied
embeddings across stages) and check that (a) the loaded parameters (fp32 masters) and AdamW states, gathered dense,
equal the saved ones bit for bit, and (b) one more step gives what the uninterrupted run gives (bit for bit at the
same split; not compared when the precision changes). A checkpoint corrupted in place, or holding non-finite
values, never loads."""
import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import models
import tp
import tp.testing
from models.hf import hf_state_dict
from models.stages import build_chunks
from models.training import checkpoint
from tp.optim import DataParallel, DistributedOptimizer
from tp.pipeline import PipelineRunner
from tp.testing import distributed

from .helpers import rng

# kv heads 2 < tp 4: replicated k/v chunks; no tp divides the vocabulary.
LLAMA = models.GPTConfig(vocab_size=50, hidden_size=16, num_layers=4, num_heads=4, num_kv_heads=2,
                         ffn_hidden_size=24, max_seq_len=16)
# Conv1D weights stored transposed, biases (the row biases replicated), learned positions, tied embeddings.
GPT2 = LLAMA.replace(num_kv_heads=4, hf_model_type="gpt2", activation="gelu_tanh", norm="layernorm",
                     position="learned", bias=True, tie_embeddings=True)
BATCH, SEQ, STEPS = 4, 8, 2
STATES = ("exp_avg", "exp_avg_sq")


def build(config, mesh, wrap, seed):
    """This rank's pipeline stage (equal layer counts), wrapped for dp, and its AdamW (zero1 / bf16: tp.optim's
    DataParallel and DistributedOptimizer; "ddp-bf16": the all-reduce form). A wrap ending in "-v2": two model chunks
    per rank (interleaved), a list of DataParallel modules under one DistributedOptimizer."""
    per_stage = config.num_layers // mesh.pp_size
    torch.manual_seed(seed)
    if str(wrap).endswith("-v2"):
        chunks = [DataParallel(chunk, group=mesh.dp_group, shard=not wrap.startswith("ddp"), bucket_numel=500,
                               param_dtype=torch.bfloat16 if "bf16" in wrap else None,
                               tied=[(t, mesh.embedding_group)] if (t := _tied_copy(chunk, mesh)) is not None else ())
                  for chunk in build_chunks(config, mesh, 2)]
        for chunk in chunks:
            chunk.set_micro_batches(BATCH // mesh.dp_size)  # one row per micro-batch
        return chunks, DistributedOptimizer(chunks, lr=1e-2, weight_decay=0.1)
    model = models.GPT(config, layers=(mesh.pp_rank * per_stage, (mesh.pp_rank + 1) * per_stage),
                       pre_process=mesh.is_first_stage, post_process=mesh.is_last_stage)
    if wrap in ("zero1", "zero1-bf16", "ddp-bf16"):
        tied = _tied_copy(model, mesh)
        model = DataParallel(model, group=mesh.dp_group, shard=wrap != "ddp-bf16", bucket_numel=500,
                             param_dtype=torch.bfloat16 if wrap.endswith("bf16") else None,
                             tied=[(tied, mesh.embedding_group)] if tied is not None else ())
        return model, DistributedOptimizer(model, lr=1e-2, weight_decay=0.1)
    if wrap == "ddp":
        model = DistributedDataParallel(model, process_group=mesh.dp_group)
    elif wrap == "fsdp2":
        for layer in model.layers:
            fully_shard(layer, mesh=mesh.device_mesh["dp"])
        fully_shard(model, mesh=mesh.device_mesh["dp"])  # the parameters become DTensors sharded over dp
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _tied_copy(stage, mesh):
    if not stage.config.tie_embeddings or mesh.pp_size == 1 or not mesh.in_embedding_group:
        return None
    if mesh.is_first_stage and stage.pre_process:
        return stage.embedding.weight
    return stage.output.weight if mesh.is_last_stage and stage.post_process else None  # (a chunk without it: None)


def train_step(model, opt, mesh, step):
    """One AdamW step on the global batch `step` (split over dp), through a two-stage pipeline when pp = 2."""
    g = rng(step)
    x, y = (torch.randint(0, LLAMA.vocab_size, (BATCH, SEQ), generator=g).chunk(mesh.dp_size)[mesh.dp_rank]
            for _ in range(2))
    stage = getattr(model, "module", model)
    if isinstance(model, list):  # model chunks: the interleaved schedule, one row per micro-batch
        PipelineRunner(model, mesh, micro_batch_size=1, seq_len=SEQ).run(list(zip(x.split(1), y.split(1))),
                                                                          "interleaved")
    elif mesh.pp_size == 1:
        model(x, y).backward()
    elif mesh.is_first_stage:
        hidden = model(x)  # [s, b/dp, h]
        tp.collectives.isend(hidden.detach(), mesh.next_stage_rank).wait()
        grad = torch.empty_like(hidden)
        tp.collectives.irecv(grad, mesh.next_stage_rank).wait()
        hidden.backward(grad)
    else:
        seq = SEQ // mesh.tp_size if stage.config.sequence_parallel else SEQ
        hidden = torch.empty(seq, len(x), stage.config.hidden_size,  # [s(/tp), b/dp, h]
                             dtype=next(stage.parameters()).dtype)
        tp.collectives.irecv(hidden, mesh.prev_stage_rank).wait()
        hidden.requires_grad_()
        model(hidden=hidden, targets=y).backward()
        tp.collectives.isend(hidden.grad, mesh.prev_stage_rank).wait()
    if mesh.pp_size > 1 and not isinstance(model, (list, DataParallel)) and stage.config.tie_embeddings:  # (DP sums)
        # the two copies of the tied embedding stay equal
        tied = stage.embedding.weight if mesh.is_first_stage else stage.output.weight
        dist.all_reduce(tied.grad, group=mesh.embedding_group)
    opt.step()
    opt.zero_grad()


def snapshot(model, opt, mesh):
    """{"<what> <hf name>": dense tensor} of every parameter and AdamW state of the whole model, on every rank."""
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    # the distributed optimizer's fp32 masters and state, dp-gathered (what its checkpoints hold)
    whole = opt.full_state() if isinstance(opt, DistributedOptimizer) else None
    out = {}
    for chunk in model if isinstance(model, list) else [model]:
        stage = getattr(chunk, "module", chunk)
        plain = models.GPT(stage.config, layers=stage.layer_range, pre_process=stage.pre_process,
                           post_process=stage.post_process, _init=False)  # holds FSDP2's gathered tensors
        pairs = list(zip(plain.parameters(), stage.parameters()))
        with torch.no_grad():
            for mine, theirs in pairs:
                mine.copy_(full(theirs) if whole is None else whole[theirs]["param"])
        out |= {f"param {k}": v for k, v in hf_state_dict(plain, mesh.tp_group).items()}
        for state in STATES:
            for mine, theirs in pairs:
                mine.grad = full(opt.state[theirs][state]) if whole is None else whole[theirs][state]
            out |= {f"{state} {k}": v for k, v in hf_state_dict(plain, mesh.tp_group, grads=True).items()}
    every = [None] * mesh.world_size
    dist.all_gather_object(every, out)
    return {k: v for part in every for k, v in part.items()}


def assert_state_as_torch_makes_it(model, opt, step):
    if isinstance(opt, DistributedOptimizer):  # its pieces: flat fp32 shards of the masters
        for master, state in opt.state.items():
            assert set(state) == {"step", *STATES} and state["step"].item() == step
            assert all(state[name].shape == master.shape and state[name].dtype == torch.float32 for name in STATES)
        return
    for p in getattr(model, "module", model).parameters():
        state = opt.state[p]
        assert set(state) == {"step", *STATES}, set(state)
        assert state["step"].dtype == torch.float32 and state["step"].device.type == "cpu" and \
            state["step"].dim() == 0 and state["step"].item() == step
        for name in STATES:
            assert type(state[name]) is type(p.data) and state[name].shape == p.shape and state[name].dtype == p.dtype


def train_and_save(config, split, wrap, path):
    """Split A: STEPS steps, save, one more. Returns the dense state at the save, after the extra step, and the RNG."""
    mesh = tp.init_mesh(**split)
    model, opt = build(config, mesh, wrap, seed=0)
    tp.model_parallel_seed(5)
    for step in range(STEPS):
        train_step(model, opt, mesh, step)
    rng_at_save = torch.get_rng_state()
    checkpoint.save(path, model, opt, mesh=mesh, step=STEPS, extra={"data position": 8})
    saved = snapshot(model, opt, mesh)
    train_step(model, opt, mesh, STEPS)
    uninterrupted = snapshot(model, opt, mesh)
    dist.barrier()
    if mesh.rank == 0:  # the files hold plain dense Hugging Face tensors: readable without this package
        dense = {k: torch.empty_like(v) for k, v in saved.items() if k.startswith("param ")}
        dcp.load({f"model.{k[len('param '):]}": v for k, v in dense.items()}, checkpoint_id=path, no_dist=True)
        for key, value in dense.items():
            assert torch.equal(value, saved[key]), key
    return saved, uninterrupted, rng_at_save


def load_and_continue(config, mesh, wrap, path, saved, uninterrupted, exact):
    """Split B: a model with other weights, load, (a) equals the saved state, (b) one more step equals the
    uninterrupted run (bit for bit when `exact`). Returns the RNG state before and after the load."""
    model, opt = build(config, mesh, wrap, seed=1)
    opt.param_groups[0]["lr"] = 0.5  # the checkpoint's hyperparameters replace it
    tp.model_parallel_seed(6)
    rng_before_load = torch.get_rng_state()
    assert checkpoint.load(path, model, opt, mesh=mesh) == (STEPS, {"data position": 8})
    rng_after_load = torch.get_rng_state()
    loaded = snapshot(model, opt, mesh)
    assert set(loaded) == set(saved), set(loaded) ^ set(saved)
    for key, value in saved.items():  # (a)
        assert torch.equal(loaded[key], value), key
    assert_state_as_torch_makes_it(model, opt, STEPS)
    train_step(model, opt, mesh, STEPS)
    resumed = snapshot(model, opt, mesh)
    for key, value in uninterrupted.items() if uninterrupted is not None else ():  # (b)
        if exact:
            assert torch.equal(resumed[key], value), key
            continue
        got = resumed[key]
        if key.startswith("exp_avg_sq "):  # squared gradients, squared rounding: compare them in gradient units
            got, value = got.sqrt(), value.sqrt()
        err = (got - value).abs()  # other reduction orders: fp32 rounding of the gradients
        if key.startswith("param ") and key.endswith("attn.c_attn.bias"):
            # GPT-2's k bias has a zero gradient in exact arithmetic (softmax ignores a per-query shift), so AdamW
            # normalises rounding noise into steps: it follows the uninterrupted run only to ~lr·1e-3.
            k_rows = slice(config.hidden_size, 2 * config.hidden_size)
            assert err[k_rows].max().item() <= 1e-5, f"{key} (k rows): err {err[k_rows].max().item():.3g}"
            err[k_rows] = 0
        # Adam's moments relative to their largest entry: up to 6.5e-7 seen for exp_avg and sqrt(exp_avg_sq)
        # (exp_avg_sq itself: 1.05e-6 on an AMD EPYC); a wrong reshard is off by O(1)
        scale = 1.0 if key.startswith("param ") else value.abs().max().item()
        assert err.max().item() <= 1e-6 * scale, f"{key}: err {err.max().item():.3g}"
    return rng_before_load, rng_after_load


CASES = {  # name: (config, split saved, wrap, split loaded, wrap)
    "tp2pp2-to-tp4": (LLAMA, dict(tp=2, pp=2), None, dict(tp=4), None),
    "tp4-to-tp1dp4-ddp": (LLAMA, dict(tp=4), None, dict(tp=1), "ddp"),
    "tp2dp2-ddp-to-pp2dp2-ddp": (LLAMA, dict(tp=2), "ddp", dict(tp=1, pp=2), "ddp"),
    "same-split-dropout": (LLAMA.replace(dropout=0.1, attention_dropout=0.1), dict(tp=2, pp=2), None,
                           dict(tp=2, pp=2), None),
    "gpt2-tied-tp2pp2-to-tp4": (GPT2, dict(tp=2, pp=2), None, dict(tp=4), None),
    "fsdp2-tp2dp2-to-tp1dp4": (LLAMA, dict(tp=2), "fsdp2", dict(tp=1), "fsdp2"),
    "zero1-tp2dp2-to-tp1dp4-zero1": (LLAMA, dict(tp=2), "zero1", dict(tp=1), "zero1"),
    "ddp-fp32-to-zero1-bf16-pp2dp2": (LLAMA, dict(tp=2), "ddp", dict(pp=2), "zero1-bf16"),
    "gpt2-tied-zero1-bf16-pp2dp2-to-fsdp2-fp32": (GPT2, dict(pp=2), "zero1-bf16", dict(tp=2), "fsdp2"),
    "ddp-bf16-tp2dp2-to-zero1-fp32-tp4": (LLAMA, dict(tp=2), "ddp-bf16", dict(tp=4), "zero1"),
    # two model chunks per rank (interleaved), one DistributedOptimizer over their DataParallel modules
    "zero1-bf16-chunks-pp2dp2-to-fsdp2-fp32-tp2": (LLAMA, dict(pp=2), "zero1-bf16-v2", dict(tp=2), "fsdp2"),
    "gpt2-tied-ddp-tp2dp2-to-zero1-chunks-pp2dp2": (GPT2, dict(tp=2), "ddp", dict(pp=2), "zero1-v2"),
}


@pytest.mark.parametrize("case", list(CASES))
@distributed(world_size=4)
def test_resume_at_another_split_continues_the_run(case, tmp_path):
    config, split_a, wrap_a, split_b, wrap_b = CASES[case]
    path = str(tmp_path / "ckpt")
    saved, uninterrupted, rng_at_save = train_and_save(config, split_a, wrap_a, path)
    tp.destroy_mesh(keep_groups=True)
    same_split = split_a == split_b and wrap_a == wrap_b
    mesh = tp.init_mesh(**split_b)
    # sequence parallelism may differ between save and load; at the same split it changes the numerics, so not there
    same_precision = ("bf16" in str(wrap_a)) == ("bf16" in str(wrap_b))  # (else one more step differs)
    before, after = load_and_continue(config.replace(sequence_parallel=not same_split), mesh, wrap_b, path, saved,
                                      uninterrupted if same_precision else None, exact=same_split)
    assert torch.equal(after, rng_at_save if same_split else before)  # restored at the same split only



@distributed(world_size=4)
def test_bad_input_raises_on_every_rank_before_any_collective(tmp_path):
    path = str(tmp_path / "ckpt")
    mesh = tp.init_mesh(tp=2)
    model, opt = build(LLAMA, mesh, None, seed=0)
    with pytest.raises(ValueError, match=r"step=-1 must be an integer >= 0"):
        checkpoint.save(path, model, opt, mesh=mesh, step=-1)
    with pytest.raises(FileNotFoundError, match=r"holds no checkpoint \(no .metadata\)"):
        checkpoint.load(path, model, opt, mesh=mesh)
    checkpoint.save(path, model, opt, mesh=mesh, step=0)
    wider, wider_opt = build(LLAMA.replace(hidden_size=32), mesh, None, seed=0)
    with pytest.raises(ValueError, match=r"another GPTConfig: hidden_size=16 \(model: 32\)$"):
        checkpoint.load(path, wider, wider_opt, mesh=mesh)
    with pytest.raises(ValueError, match=r"holds AdamW state, not SGD"):
        checkpoint.load(path, model, torch.optim.SGD(model.parameters(), lr=0.1), mesh=mesh)
    with pytest.raises(ValueError, match=r"optimizer param_groups \[0\] hold parameters that are not the model's"):
        checkpoint.save(path, model, wider_opt, mesh=mesh, step=0)
    with pytest.raises(TypeError, match=r"must be a models.GPT stage .* got Linear"):
        checkpoint.save(path, torch.nn.Linear(2, 2), None, mesh=mesh, step=0)
    solo = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    with pytest.raises(ValueError, match=r"split over tp=1 ranks but mesh has tp=2"):
        checkpoint.load(path, models.GPT(LLAMA, group=solo), None, mesh=mesh)


def test_resume_in_one_process(tmp_path):
    """Saved at tp 2 x pp 2 on four ranks, resumed at 1 x 1 x 1 in this lone process."""
    path = str(tmp_path / "ckpt")
    saved, uninterrupted, _ = tp.testing.run(train_and_save, 4, config=LLAMA, split=dict(tp=2, pp=2), wrap=None,
                                             path=path)[0]
    mesh = tp.init_mesh()
    try:
        load_and_continue(LLAMA, mesh, None, path, saved, uninterrupted, exact=False)
        model, opt = build(LLAMA.replace(dropout=0.1), mesh, None, seed=1)
        with warnings.catch_warnings():  # the masks are keyed by the samples' indices, not by a restored RNG state
            warnings.simplefilter("error")
            checkpoint.load(path, model, opt, mesh=mesh)
    finally:
        tp.destroy_mesh()


def test_max_seq_len_defines_weights_only_for_learned_positions():
    """RoPE has no position weights: a checkpoint resumes at another max_seq_len (a longer --seq-len); learned
    positions do not."""
    import dataclasses

    rope = models.GPTConfig(vocab_size=64, hidden_size=16, num_layers=1, num_heads=4, max_seq_len=32)
    checkpoint.check_config(dataclasses.asdict(rope), rope.replace(max_seq_len=64, sequence_parallel=True), "ckpt")
    learned = rope.replace(position="learned")
    with pytest.raises(ValueError, match=r"checkpoint 'ckpt' was saved with another GPTConfig: max_seq_len=32 "
                                         r"\(model: 64\)"):
        checkpoint.check_config(dataclasses.asdict(learned), learned.replace(max_seq_len=64), "ckpt")
    with pytest.raises(ValueError, match=r"hidden_size=16 \(model: 32\)"):
        checkpoint.check_config(dataclasses.asdict(rope), rope.replace(hidden_size=32), "ckpt")


# ---- integrity: a manifest of every file, checked before any byte is used (issue 35) -------------------------------

def _saved_alone(path, *, poison=False):
    """LLAMA after one AdamW step, saved by this lone process into `path` (`poison`: a NaN in a weight first);
    returns (model, optimizer, mesh)."""
    mesh = tp.init_mesh()
    model, opt = build(LLAMA, mesh, None, seed=0)
    train_step(model, opt, mesh, 0)
    if poison:
        with torch.no_grad():
            model.layers[1].mlp.fc2.weight.view(-1)[3] = float("nan")
    checkpoint.save(path, model, opt, mesh=mesh, step=1)
    return model, opt, mesh


def _overwrite_inside(file, size=4096):
    """4 KiB of other bytes in the middle of `file`, in place: its size unchanged (a disk's or a copy's fault)."""
    length = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.seek(length // 2 - size // 2)
        f.write(bytes(255 - b for b in f.read(size)))
        f.seek(length // 2 - size // 2)
    assert os.path.getsize(file) == length


def test_a_checkpoint_corrupted_in_place_never_loads(tmp_path):
    """4 KiB overwritten inside a .distcp (its size unchanged) used to load silently: every later step was skipped
    for a NaN grad norm and the job ended `loss 3.1351 -> nan`, exit 0. The save's manifest (every file's size and
    CRC-32) names the file."""
    path = str(tmp_path / "step-000001")
    try:
        model, opt, mesh = _saved_alone(path)
        manifest = json.loads((tmp_path / "step-000001" / "manifest.json").read_text())
        on_disk = set(os.listdir(path)) - {"manifest.json"}
        assert set(manifest["files"]) == on_disk and manifest["algorithm"] == "crc32"
        assert all(manifest["files"][name]["size"] == os.path.getsize(os.path.join(path, name)) for name in on_disk)
        shard = os.path.join(path, "__0_0.distcp")
        _overwrite_inside(shard)
        with pytest.raises(ValueError, match=rf"^{shard} is corrupt: its CRC-32 is [0-9a-f]{{8}}, the checkpoint's "
                                             r"manifest.json says [0-9a-f]{8}"):
            checkpoint.load(path, model, opt, mesh=mesh)
    finally:
        tp.destroy_mesh()


def test_a_checkpoint_corrupted_in_place_is_one_line_before_any_process(tmp_path, capsys):
    from .helpers import train_refusal

    path = str(tmp_path / "step-000001")
    try:
        _saved_alone(path)
    finally:
        tp.destroy_mesh()
    shard = os.path.join(path, "__0_0.distcp")
    _overwrite_inside(shard)
    code, out, err = train_refusal(["--model", "tiny", "--tp", "1", "--pp", "1", "--dp", "1", "--steps", "3",
                                    "--load", path], capsys)
    assert code == 2 and out == "" and len(err) == 1, err
    assert err[0].startswith(f"error: --load {path}: {shard} is corrupt: its CRC-32 is "), err


def test_a_checkpoint_without_a_manifest_still_loads(tmp_path):
    """Checkpoints written before the manifest: nothing to verify them by, so they load as they did."""
    path = str(tmp_path / "step-000001")
    try:
        model, opt, mesh = _saved_alone(path)
        os.remove(os.path.join(path, "manifest.json"))
        assert checkpoint.load(path, model, opt, mesh=mesh)[0] == 1
        assert not checkpoint.has_manifest(path)
    finally:
        tp.destroy_mesh()


def test_non_finite_weights_in_a_checkpoint_are_refused_naming_the_tensor(tmp_path):
    path = str(tmp_path / "step-000001")
    try:
        model, opt, mesh = _saved_alone(path, poison=True)
        with pytest.raises(ValueError, match=rf"^checkpoint {path}: model\.\S+mlp.down_proj.weight holds non-finite "
                                             r"values \(nan or inf\)"):
            checkpoint.load(path, model, opt, mesh=mesh)
    finally:
        tp.destroy_mesh()


def test_weights_only_loads_leave_the_optimizer_and_the_generators_as_they_are(tmp_path):
    """The loads of --finetune, --no-load-optim and --no-load-rng: the weights, without the AdamW moments or the
    generators' states."""
    path = str(tmp_path / "step-000001")
    try:
        model, opt, mesh = _saved_alone(path)
        weights = {name: p.detach().clone() for name, p in model.named_parameters()}
        for load_rng in (False, True):
            fresh, fresh_opt = build(LLAMA, mesh, None, seed=5)
            torch.manual_seed(99)
            expected = torch.rand(4)
            torch.manual_seed(99)
            assert checkpoint.load(path, fresh, fresh_opt, mesh=mesh, load_optimizer=False, load_rng=load_rng)[0] == 1
            assert all(torch.equal(p, weights[name]) for name, p in fresh.named_parameters())
            assert len(fresh_opt.state) == 0
            assert torch.equal(torch.rand(4), expected) != load_rng  # (the saved state is not seed 99's)
    finally:
        tp.destroy_mesh()
