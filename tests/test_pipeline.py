"""The pipeline runner against the un-pipelined model: every schedule (GPipe, 1F1B, interleaved, ZB-H1) at pp = 2
and 4 with dp = 2 (DDP and FSDP2; tp and SP inside the stages, uneven layer splits, tied embeddings across stages)
gives the serial loss and every gradient; the layers' B/W split gives the fused backward's gradients."""
import warnings

import pytest
import torch
import torch.distributed as dist

import models
import tp
from models.hf import hf_state_dict
from models.stages import StageSplit, allreduce_tied_embedding_grads, build_chunks, layers_per_stage, stage_layers
from models.training.model import wrap_data_parallel
from tests.helpers import assert_close, randn
from tp.pipeline import PipelineRunner, defer_wgrad
from tp.testing import distributed

from .helpers import rng

VOCAB, SEQ, MICRO, NUM_MICRO = 50, 8, 2, 4


def micro_batches(seed=0, count=NUM_MICRO):
    g = rng(seed)
    return [(torch.randint(0, VOCAB, (MICRO, SEQ), generator=g), torch.randint(0, VOCAB, (MICRO, SEQ), generator=g))
            for _ in range(count)]


def test_stage_layers_split_evenly_first_stages_take_the_rest():
    assert [stage_layers(5, 2, s) for s in range(2)] == [(0, 3), (3, 5)]
    assert [stage_layers(6, 4, s) for s in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert [stage_layers(8, 2, s, 2) for s in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]  # virtual stages
    with pytest.raises(ValueError, match=r"pp=4 pipeline stages need at least 4 layers, the model has num_layers=3"):
        stage_layers(3, 4, 0)
    with pytest.raises(ValueError, match=r"num_layers=6 is not divisible by pp\*virtual_stages = 2\*4"):
        stage_layers(6, 2, 0, 4)


def test_megatrons_split_flags_place_the_layers():
    """Megatron-LM's --decoder-first/last-pipeline-num-layers (the rest evenly over the middle stages, each rank's
    layers evenly over its chunks) and --account-for-embedding/loss-in-pipeline-split (one layer fewer on the chunk
    holding them), in virtual-stage order (chunk c of rank r is stage c·pp + r)."""
    assert layers_per_stage(126, 16, split=StageSplit(7, 7)) == (7,) + (8,) * 14 + (7,)  # Llama 3 405B
    assert layers_per_stage(5, 2, split=StageSplit(first_stage_layers=1)) == (1, 4)
    assert layers_per_stage(6, 3, split=StageSplit(last_stage_layers=4)) == (1, 1, 4)
    assert layers_per_stage(12, 4, 2, split=StageSplit(2, 2)) == (1, 2, 2, 1, 1, 2, 2, 1)
    assert layers_per_stage(6, 2, 2, split=StageSplit(embedding_as_layer=True, loss_as_layer=True)) == (1, 2, 2, 1)
    assert layers_per_stage(6, 4, 2, split=StageSplit(embedding_as_layer=True, loss_as_layer=True)) == \
        (0,) + (1,) * 6 + (0,)  # the embedding alone, the loss alone
    assert layers_per_stage(7, 2, split=StageSplit(embedding_as_layer=True)) == (3, 4)
    assert [stage_layers(12, 4, s, 2, split=StageSplit(2, 2)) for s in (0, 4, 7)] == [(0, 1), (6, 7), (11, 12)]
    for args, split, message in (
            ((5, 2), StageSplit(2, 2), r"first_stage_layers=2 last_stage_layers=2: the first and last stages' layers "
                                       r"must add up to num_layers=5 \(pp=2: no middle stage\)"),
            ((7, 4), StageSplit(1, 1), r"the other 5 of num_layers=7 layers do not split evenly over the 2 middle "
                                       r"stages of pp=4"),
            ((6, 4), StageSplit(first_stage_layers=7), r"^first_stage_layers=7: the given stage holds 7 of "
                                                       r"num_layers=6 layers, leaving 0 for the other 3 stages of "
                                                       r"pp=4 \(each needs at least one\)$"),
            ((6, 2), StageSplit(last_stage_layers=6), r"^last_stage_layers=6: the given stage holds 6 of num_layers=6 "
                                                      r"layers, leaving 0 for the other 1 stage of pp=2"),
            ((7, 3), StageSplit(last_stage_layers=2), r"the other 5 of num_layers=7 layers do not split evenly over "
                                                      r"the other 2 stages of pp=3"),
            ((8, 2, 2), StageSplit(first_stage_layers=3), r"pipeline rank 0's 3 layers do not split into "
                                                          r"virtual_stages=2 equal chunks"),
            ((4, 1), StageSplit(first_stage_layers=4), r"need pp >= 2 \(pp=1\)"),
            ((5, 2), StageSplit(2, embedding_as_layer=True), r"do not combine with the embedding or loss counted"),
            ((6, 4), StageSplit(embedding_as_layer=True),
             r"num_layers=6 \+ 1 \(the embedding and/or loss counted as layers\) = 7 is not divisible by "
             r"pp\*virtual_stages = 4\*1")):
        with pytest.raises(ValueError, match=message):
            layers_per_stage(*args, split=split)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb"])
@distributed(world_size=8, timeout=300)
def test_schedule_with_data_parallelism_equals_the_unpipelined_model(schedule):
    """pp=4 x dp=2 under DDP, and tp=2 (SP) x pp=2 x dp=2 under FSDP2: loss and every gradient of the serial model
    on all 2 x 4 micro-batches; every rank runs exactly its action list and its transfers."""
    from tp.pipeline.schedules import build

    chunks_per_rank = 2 if schedule == "interleaved" else 1
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]  # the serial reference's
    for tp_size, pp_size, sp, mode in ((1, 4, False, "ddp"), (2, 2, True, "fsdp")):
        mesh = tp.init_mesh(tp=tp_size, pp=pp_size, dp=2)
        config = models.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_layers=8 if chunks_per_rank > 1 else 5,
                                  num_heads=4, num_kv_heads=2, ffn_hidden_size=24, tie_embeddings=True,
                                  sequence_parallel=sp)
        torch.manual_seed(0)
        chunks = build_chunks(config, mesh, chunks_per_rank)
        wrapped = [_data_parallel(chunk, mesh, mode, schedule) for chunk in chunks]
        runner = PipelineRunner(wrapped if chunks_per_rank > 1 else wrapped[0], mesh, micro_batch_size=MICRO,
                                seq_len=SEQ)
        batches = micro_batches(seed=mesh.dp_rank)
        stats = runner.run(batches, schedule)
        allreduce_tied_embedding_grads(chunks, mesh)
        plan = build(schedule, pp_size, NUM_MICRO, chunks_per_rank)
        assert stats.order == list(plan.actions[mesh.pp_rank])
        assert stats.peak_activations == _peak(plan, mesh.pp_rank)
        assert 0.0 <= stats.bubble < 1.0 and (stats.times["W"] > 0) == (schedule == "zb")

        torch.manual_seed(0)
        reference = models.GPT(config.replace(sequence_parallel=False), group=solo)
        every = [b for rank in range(2) for b in micro_batches(seed=rank)]
        loss = sum(reference(x, y) for x, y in every) / len(every)
        loss.backward()
        mean = torch.tensor([stats.loss], dtype=torch.float64)
        dist.all_reduce(mean, group=mesh.dp_group)
        assert abs(mean.item() / 2 - loss.item()) <= 1e-5 * loss.item(), (mean.item() / 2, loss.item())
        expected = hf_state_dict(reference, solo, grads=True)
        ours = {k: v for chunk in chunks for k, v in hf_state_dict(chunk, grads=True).items()}
        assert ours and set(ours) <= set(expected)
        for name, grad in ours.items():
            err = (grad - expected[name]).abs().max().item()
            assert err <= 1e-5, f"{schedule} {mode}: {name}: grad err {err}"
        names = [None] * pp_size
        dist.all_gather_object(names, sorted(ours), group=mesh.pp_group)
        assert set().union(*map(set, names)) == set(expected)  # the stages hold every parameter between them
        assert runner.forward_only(batches) == pytest.approx(stats.loss, rel=1e-6)  # evaluation: the same loss
        tp.destroy_mesh()


def _data_parallel(chunk, mesh, mode, name):
    if mode == "ddp":
        return wrap_data_parallel(chunk, mesh, mode)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    # models.training.trainer's wrapping, on a DeviceMesh named after the call: torch caches DTensor sharding plans
    # by mesh equality (ranks and names, not groups), so the next test call's equal mesh would reuse this call's groups,
    # destroyed by then, in the pool's long-lived processes.
    dp_mesh = DeviceMesh.from_group(mesh.dp_group, "cpu", mesh=torch.tensor(mesh.ranks("dp")),
                                    mesh_dim_names=(f"dp_{name}",))
    for block in chunk.layers:
        fully_shard(block, mesh=dp_mesh)
    return fully_shard(chunk, mesh=dp_mesh)


def _peak(plan, rank):
    alive = peak = 0
    for a in plan.actions[rank]:
        alive += {"F": 1, "B": -1, "BW": -1}.get(a.kind, 0)
        peak = max(peak, alive)
    return peak / plan.virtual_stages


@distributed(world_size=2)
def test_evaluation_leaves_fsdp2_parameters_sharded():
    """forward_only under FSDP2 (no backward to reshard the root's parameters after its forward) leaves the stage
    holding its sharded parameters, the ones the optimizer steps and checkpoints save (models.train --eval-every with
    --dp-mode fsdp, then --save)."""
    mesh = tp.init_mesh(dp=2)
    config = models.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=4, ffn_hidden_size=24)
    torch.manual_seed(0)
    module = _data_parallel(build_chunks(config, mesh, 1)[0], mesh, "fsdp", "evaluation")
    runner = PipelineRunner(module, mesh, micro_batch_size=MICRO, seq_len=SEQ)
    before = [id(p) for p in module.parameters()]
    runner.forward_only(micro_batches())
    assert [id(p) for p in module.parameters()] == before, "evaluation left unsharded parameters registered"


@distributed(world_size=4)
def test_transfers_are_those_the_schedule_derives():
    """p2p counted on the wire: each rank sends one activation per micro-batch and chunk except from the last
    virtual stage, and one gradient except from the first; receives mirror them; nothing is sent twice."""
    mesh = tp.init_mesh(pp=4)
    config = models.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_layers=8, num_heads=4, ffn_hidden_size=24)
    torch.manual_seed(0)
    runner = PipelineRunner(build_chunks(config, mesh, 2), mesh, micro_batch_size=MICRO, seq_len=SEQ)
    counted = {"isend": 0, "irecv": 0}
    isend, irecv = dist.isend, dist.irecv

    def count(name, fn):
        def wrapper(*args, **kwargs):
            counted[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    dist.isend, dist.irecv = count("isend", isend), count("irecv", irecv)
    try:
        runner.run(micro_batches(), "interleaved")
    finally:
        dist.isend, dist.irecv = isend, irecv
    r, m, v = mesh.pp_rank, NUM_MICRO, 2
    sends = m * v - m * (r == 3) + m * v - m * (r == 0)
    assert counted == {"isend": sends, "irecv": m * v - m * (r == 0) + m * v - m * (r == 3)}, counted


@distributed(world_size=2)
def test_micro_batches_of_another_shape_or_count_raise_on_every_stage():
    """A micro-batch the runner was not built for (or stages given different counts) is refused on every stage
    before any send: the receiving buffers have the built shape, so it would compute on garbage or hang."""
    mesh = tp.init_mesh(tp=1, pp=2)
    config = models.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=4, ffn_hidden_size=24)
    torch.manual_seed(0)
    runner = PipelineRunner(build_chunks(config, mesh, 1)[0], mesh, micro_batch_size=MICRO, seq_len=SEQ)
    smaller = [(x[:1], y[:1]) for x, y in micro_batches()]
    with pytest.raises(ValueError, match=r"micro-batch 0: tokens shape \(1, 8\) != \[micro_batch_size, seq_len\] "
                                         r"\(2, 8\)"):
        runner.run(smaller)
    fewer = micro_batches()[:NUM_MICRO - mesh.pp_rank]
    with pytest.raises(ValueError, match=r"stages were given different numbers of micro-batches: 3 to 4"):
        runner.run(fewer)
    with pytest.raises(ValueError, match=r"schedule 'interleaved' needs virtual_stages >= 2"):
        runner.run(micro_batches(), "interleaved")  # one chunk per rank: refused on every rank alike
    assert runner.run(micro_batches(), "zb").loss > 0  # and the runner still works


@pytest.mark.parametrize("kind,sp,main_grad,replicas", [
    ("column", False, False, False), ("column", True, False, False), ("column", False, True, False),
    ("column", False, False, True), ("row", False, False, False), ("row", True, False, False),
    ("row", True, True, False)])
@distributed(world_size=2)
def test_split_backward_gives_the_fused_gradients(kind, sp, main_grad, replicas):
    """Under tp.pipeline.defer_wgrad() backward computes the input gradient (B) and queues the weight gradient; run()
    (W) then gives .grad / main_grad exactly as the fused backward does (fp64), at tp=2 with SP, main_grad and kv
    parts held by several ranks (their replica sum runs at W)."""
    mesh = tp.init_mesh(tp=2)
    torch.manual_seed(0)
    if kind == "column":
        options = dict(parts=(4, 2, 2), part_replicas=(1, 2, 2)) if replicas else {}
        layer = tp.ColumnParallelLinear(6, 8, sequence_parallel=sp, dtype=torch.float64, **options)
        x = randn(4, 3, 6, seed=1)
        x = x.chunk(2)[mesh.tp_rank] if sp else x
    else:
        layer = tp.RowParallelLinear(8, 6, sequence_parallel=sp, dtype=torch.float64)
        x = randn(4, 3, 4, seed=1 + mesh.tp_rank)
    if main_grad:
        layer.weight.main_grad = torch.zeros_like(layer.weight)

    def gradients(split):
        layer.zero_grad(set_to_none=True)
        if main_grad:
            layer.weight.main_grad.zero_()
        x_ = x.clone().requires_grad_()
        with defer_wgrad() if split else torch.enable_grad():
            y = layer(x_)
        with defer_wgrad() if split else torch.enable_grad() as queue:
            y.backward(randn(*y.shape, seed=7 + mesh.tp_rank))
        if split:
            assert len(queue) == 1 and layer.weight.grad is None
            assert not main_grad or not layer.weight.main_grad.any()  # B left the weight alone
            queue.run()
            assert len(queue) == 0
        weight = layer.weight.main_grad if main_grad else layer.weight.grad
        return x_.grad, weight, None if layer.bias is None else layer.bias.grad

    for fused, split, what in zip(gradients(False), gradients(True), ("input", "weight", "bias")):
        assert_close(split, fused, 1e-12, what)


TRAIN = ["--model", "tiny", "--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--steps", "3",
         "--seed", "7"]


def _train(flags, log):
    from models.training.cli import parser, train

    train(parser().parse_args([*TRAIN, *flags, "--log-jsonl", log]))


def _losses(tmp_path, name, world_size, *flags):
    import json

    from tp.testing import run

    log = str(tmp_path / f"{name}.jsonl")
    run(_train, world_size, flags=list(flags), log=log, timeout=300)
    with open(log) as f:
        return [json.loads(line)["loss"] for line in f]


def test_models_train_schedules_train_the_serial_curve(tmp_path):
    """models.train --schedule zb (DDP) and interleaved --virtual-stages 2 (FSDP2) train the 1x1x1 loss curve; the
    checkpoint the interleaved run wrote at step 2 (two chunks per rank) resumes at pp=4 with one chunk per rank."""
    serial = _losses(tmp_path, "serial", 1, "--tp", "1", "--pp", "1", "--dp", "1")
    ckpt = str(tmp_path / "ckpt")
    runs = {
        "zb 1x2x2 ddp": ["--tp", "1", "--pp", "2", "--dp", "2", "--schedule", "zb"],
        "interleaved 1x2x2 fsdp": ["--tp", "1", "--pp", "2", "--dp", "2", "--schedule", "interleaved",
                                   "--virtual-stages", "2", "--dp-mode", "fsdp", "--save", ckpt, "--save-every", "2"],
    }
    for name, flags in runs.items():
        curve = _losses(tmp_path, name.replace(" ", "_"), 4, *flags)
        for step, (ours, reference) in enumerate(zip(curve, serial, strict=True)):
            assert abs(ours - reference) <= 1e-5 * reference, f"{name}, step {step + 1}: {ours} vs {reference}"
    resumed = _losses(tmp_path, "resumed", 4, "--tp", "1", "--pp", "4", "--dp", "1", "--load",
                      f"{ckpt}/step-000002")
    assert len(resumed) == 1 and abs(resumed[0] - serial[2]) <= 1e-5 * serial[2], (resumed, serial)


SIX = ["--num-layers", "6", "--tp", "1"]  # (a stage split needs layers to place)


def _close_to(curve, serial, name):
    for step, (ours, reference) in enumerate(zip(curve, serial, strict=True)):
        assert abs(ours - reference) <= 1e-5 * reference, f"{name}, step {step + 1}: {ours} vs {reference}"


def test_uneven_stages_train_the_serial_curve(tmp_path):
    """Megatron's split flags at pp = 2 under 1F1B (2 | 4 layers), ZB-H1 (5 | 1) and interleaved (the embedding and
    loss counted: chunks of 1, 2 | 2, 1), with recompute modules and methods on top, train the 1x1x1 curve; the
    interleaved run's checkpoint resumes at pp = 4 with 3 | 1 | 1 | 1 layers."""
    serial = _losses(tmp_path, "serial", 1, *SIX, "--pp", "1", "--dp", "1")
    ckpt = str(tmp_path / "ckpt")
    runs = {
        "1f1b first 2, layernorm mlp core_attn": ["--first-stage-layers", "2", "--recompute", "selective",
                                                 "--recompute-modules", "layernorm", "mlp", "core_attn"],
        "zb last 1, full block 1": ["--schedule", "zb", "--decoder-last-pipeline-num-layers", "1", "--recompute",
                                    "full", "--recompute-method", "block", "--recompute-num-layers", "1"],
        "interleaved embedding+loss, full uniform 2": [
            "--schedule", "interleaved", "--virtual-stages", "2", "--account-for-embedding-in-pipeline-split",
            "--loss-as-layer", "--recompute", "full", "--recompute-num-layers", "2", "--save", ckpt,
            "--save-every", "2"],
    }
    for name, flags in runs.items():
        _close_to(_losses(tmp_path, name.replace(" ", "_"), 2, *SIX, "--pp", "2", "--dp", "1", *flags), serial, name)
    resumed = _losses(tmp_path, "resumed", 4, *SIX, "--pp", "4", "--dp", "1", "--schedule", "gpipe",
                      "--first-stage-layers", "3", "--load", f"{ckpt}/step-000002")
    _close_to(resumed, serial[2:], "resumed at pp 4, 3 | 1 | 1 | 1")


@pytest.mark.slow
def test_uneven_stages_at_pp_4_train_the_serial_curve(tmp_path):
    """pp = 4: GPipe (3 | 1 | 1 | 1), ZB-H1 (1 | 2 | 2 | 1, layernorm recomputed) and interleaved with the embedding
    and the loss each on a chunk of their own (0, 1, 1, 1 | 1, 1, 1, 0 layers)."""
    serial = _losses(tmp_path, "serial", 1, *SIX, "--pp", "1", "--dp", "1")
    runs = {
        "gpipe first 3": ["--schedule", "gpipe", "--first-stage-layers", "3"],
        "zb first 1 last 1, layernorm": ["--schedule", "zb", "--first-stage-layers", "1", "--last-stage-layers", "1",
                                         "--recompute", "selective", "--recompute-modules", "layernorm"],
        "interleaved embedding+loss alone": ["--schedule", "interleaved", "--virtual-stages", "2",
                                             "--embedding-as-layer", "--loss-as-layer"],
    }
    for name, flags in runs.items():
        _close_to(_losses(tmp_path, name.replace(" ", "_"), 4, *SIX, "--pp", "4", "--dp", "1", *flags), serial, name)


@pytest.mark.parametrize("flags,message", [
    (["--schedule", "interleaved", "--virtual-stages", "2", "--global-batch-size", "12"],
     r"--schedule interleaved: schedule 'interleaved' needs micro_batches divisible by pp: micro_batches=3 is not a "
     r"multiple of pp=2 \(micro_batches = --global-batch-size / \(--dp \* --micro-batch-size\) = 3"),
    (["--schedule", "interleaved", "--virtual-stages", "3"],
     r"num_layers=4 is not divisible by pp\*virtual_stages = 2\*3"),
    (["--schedule", "interleaved"], r"needs virtual_stages >= 2 model chunks per rank, got virtual_stages=1"),
    (["--schedule", "zb", "--virtual-stages", "2"], r"virtual_stages=2: schedule 'zb' runs one model chunk per rank"),
    (["--virtual-stages", "0"], r"--virtual-stages=0 must be >= 1"),
    (["--first-stage-layers", "3", "--last-stage-layers", "2"],
     r"first_stage_layers=3 last_stage_layers=2: the first and last stages' layers must add up to num_layers=4"),
    (["--schedule", "interleaved", "--virtual-stages", "2", "--first-stage-layers", "1"],
     r"first_stage_layers=1: pipeline rank 0's 1 layers do not split into virtual_stages=2 equal chunks"),
])
def test_models_train_refuses_impossible_schedules_in_one_line(flags, message):
    """validate(), which the launcher runs before any process: Megatron's constraints, each in one line."""
    from models.training.cli import parser, validate

    with pytest.raises(ValueError, match=message) as info:
        validate(parser().parse_args(flags))
    assert "\n" not in str(info.value)


def test_fsdp_parameter_groups_are_read_in_torch_2_11_and_later():
    """FSDP2's per-state parameter groups: a list since torch 2.12, one group (or None) in torch 2.11."""
    from types import SimpleNamespace

    from tp.pipeline.runner import _param_groups

    assert _param_groups(SimpleNamespace(_fsdp_param_groups=["a", "b"], _fsdp_param_group="a")) == ["a", "b"]
    assert _param_groups(SimpleNamespace(_fsdp_param_group="a")) == ["a"]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=None)) == []


@distributed(world_size=2)
def test_the_kernels_are_tuned_once_before_the_first_schedule_each_shape_once():
    """A first-time autotune inside the schedule would synchronise the GPU while a peer waits in a receive: the runner
    tunes every linear's kernels before its first schedule, for a micro-batch's tokens (b·s/cp), each shape once.
    (The calls are counted here; tests/test_kernels.py launches them.)"""
    mesh = tp.init_mesh(tp=2)
    config = models.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=4, ffn_hidden_size=24)
    stage = build_chunks(config, mesh, 1)[0]
    calls, schedules_run = [], []
    for layer in (m for m in stage.modules() if hasattr(m, "tune_kernels")):
        layer.tune_kernels = lambda tokens, seen, layer=layer: calls.append((layer, tokens, len(schedules_run))) or 0
    runner = PipelineRunner(stage, mesh, micro_batch_size=MICRO, seq_len=SEQ)
    execute = runner._execute
    runner._execute = lambda *args: (schedules_run.append(1), execute(*args))[1]
    runner.run(micro_batches())
    runner.run(micro_batches(1))
    linears = [m for m in stage.modules() if isinstance(m, (tp.ColumnParallelLinear, tp.RowParallelLinear))]
    assert [c[0] for c in calls] == linears and {c[1:] for c in calls} == {(MICRO * SEQ, 0)}


@distributed(world_size=2)
def test_the_stages_send_device_tensors_through_host_buffers_over_gloo():
    """gloo's send and recv take host memory only (a CUDA tensor: "writev: Bad address"): the runner's transfers go
    through tp.collectives, which stages a device tensor through a host copy; here the CPU counts as such a device,
    and the step is the same to the bit."""
    from unittest import mock

    mesh = tp.init_mesh(pp=2)
    config = models.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=4, ffn_hidden_size=24)
    torch.manual_seed(0)
    stage = build_chunks(config, mesh, 1)[0]
    runner = PipelineRunner(stage, mesh, micro_batch_size=MICRO, seq_len=SEQ)
    runs, landed = [], []
    land = tp.collectives._Landing.wait
    counted = lambda self: landed.extend(t is not None for _, t in self.pairs) or land(self)  # True: a receive
    for staged in ((), ("cpu",)):
        stage.zero_grad()
        with mock.patch.object(tp.collectives, "GLOO_P2P_DEVICES", staged), \
                mock.patch.object(tp.collectives._Landing, "wait", counted):
            loss = runner.run(micro_batches()).loss
        runs.append([loss, *(p.grad.clone() for p in stage.parameters())])
    # the last stage's activations (received), its gradients (sent); the first stage's the other way: per micro-batch
    assert sum(landed) == NUM_MICRO and len(landed) == 2 * NUM_MICRO
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(*runs))


class _Toy(torch.nn.Module):
    """A stage of one or two: the first embeds and projects ([s, b, h] out, or what `mistake` makes of it), the last
    projects and returns the mean square; every rank builds both parts (the same weights)."""

    def __init__(self, mistake=None):
        super().__init__()
        self.mistake = mistake
        self.embed, self.first, self.last = torch.nn.Embedding(VOCAB, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, tokens, targets, *, hidden=None):
        x = hidden
        if tokens is not None:
            x = self.first(self.embed(tokens))  # [b, s, h]
            x = {"transposed": x, "tuple": (x.transpose(0, 1), x)}.get(self.mistake, x.transpose(0, 1))
        if targets is None:
            return x
        return self.last(x) if self.mistake == "per token" else self.last(x).float().pow(2).mean()

    def activation_shape(self, micro_batch_size, seq_len):
        return (seq_len, micro_batch_size, 4)


@pytest.mark.parametrize("mistake,message", [
    ("transposed", r"pipeline stage 0's output for micro-batch 0 is a float32 tensor of shape \(2, 8, 4\); the runner "
                   r"moves activation_shape\(2, 8\) = \(8, 2, 4\) in float32"),
    ("autocast", r"pipeline stage 0's output for micro-batch 0 is a bfloat16 tensor of shape \(8, 2, 4\); the runner "
                 r"moves activation_shape\(2, 8\) = \(8, 2, 4\) in float32 \(PipelineRunner\(activation_dtype=\) "),
    ("tuple", r"pipeline stage 0's output for micro-batch 0 is a tuple; the runner moves"),
    ("per token", r"the last pipeline stage returned shape \(8, 2, 4\) for micro-batch 0: it returns the "
                  r"micro-batch's mean loss \(a 0-d tensor\)")])
@distributed(world_size=2)
def test_a_stage_output_the_next_stage_cannot_receive_is_refused_before_it_is_sent(mistake, message):
    """The receiving rank builds its buffer from activation_shape and the activation dtype: an output of another
    shape or dtype was read as garbage (a silently wrong loss; under autocast, bf16 bytes read as fp32) or aborted
    gloo. The sending stage refuses it in one line before sending (the receiving one waits, as under
    torch.pipelining; torchrun stops it): here the receiving rank joins only the runner's first all-reduce, and the
    last stage's non-scalar loss is shown at pp 1."""
    mesh = tp.init_mesh(pp=1 if mistake == "per token" else 2)  # (one stage: no rank waits on the failing one)
    runner = PipelineRunner(_Toy(mistake), mesh, micro_batch_size=MICRO, seq_len=SEQ)
    batches = micro_batches(count=2)
    for call in (runner.run, runner.forward_only):
        if mesh.pp_rank == 1:
            runner._check_batches(batches)
            continue
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mistake == "autocast"), \
                pytest.raises(ValueError, match=f"^{message}"):
            call(batches)


@distributed(world_size=2)
def test_under_autocast_the_stages_move_the_activation_dtype_they_are_given():
    """fp32 parameters under bf16 autocast, PipelineRunner(activation_dtype=torch.bfloat16): the loss is the
    unpipelined model's under the same autocast, to the bit (the activation contiguous, as it arrives: bf16 matmuls
    round by layout). A stage with no floating parameter or buffer (a bool mask) moves torch's default dtype (was:
    StopIteration, then the mask's bool)."""
    mesh = tp.init_mesh(pp=2)
    torch.manual_seed(0)
    toy = _Toy()
    runner = PipelineRunner(toy, mesh, micro_batch_size=MICRO, seq_len=SEQ, activation_dtype=torch.bfloat16)
    batches = micro_batches(count=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = runner.run(batches).loss
        serial = sum(toy(None, y, hidden=toy(x, None).contiguous()) / len(batches) for x, y in batches)  # (fp32)
    assert loss == serial.double().item()
    identity = type("Identity", (torch.nn.Module,), {"forward": lambda self, tokens, targets, *, hidden=None: hidden,
                                                     "activation_shape": _Toy.activation_shape})()
    identity.register_buffer("mask", torch.ones(SEQ, dtype=torch.bool))
    runner = PipelineRunner(identity, mesh, micro_batch_size=MICRO, seq_len=SEQ)
    assert (runner.dtype, runner._device()) == (torch.float32, torch.device("cpu"))


@distributed(world_size=2)
def test_stages_whose_runners_would_move_other_buffers_are_refused_on_every_stage():
    """Each side builds its buffers from its own stage (its activation_shape, its first floating parameter's dtype):
    a stage whose first parameter is bf16 beside an fp32 one would send and receive other bytes than the other
    expects. The first all-reduce compares them: every stage raises the one line."""
    mesh = tp.init_mesh(pp=2)
    toy = _Toy()
    if mesh.pp_rank == 1:
        toy.embed.to(torch.bfloat16)
    runner = PipelineRunner(toy, mesh, micro_batch_size=MICRO, seq_len=SEQ)
    with pytest.raises(ValueError, match=r"^the pipeline stages' runners disagree on the activations they move \(this "
                                         r"one: activation_shape\(2, 8\) = \(8, 2, 4\) in (float32|bfloat16)\)"):
        runner.run(micro_batches(count=2))


def test_a_stage_input_without_a_gradient_and_a_one_element_loss():
    """The gradient a stage sends back is None when its output ignored `hidden`: that, not a shape, is named. A loss
    of shape [1] is the micro-batch's loss (as autograd takes it)."""
    from tp.pipeline.checks import check_loss, check_sent
    from tp.pipeline.schedules import Message

    with pytest.raises(ValueError, match=r"^pipeline stage 2's backward gave its input `hidden` no gradient for "
                                         r"micro-batch 3: its output does not depend on it \(detached or unused\)$"):
        check_sent(Message("grad", 1, 3), None, ((8, 2, 4), torch.float32, (2, 8)))
    assert check_loss(torch.ones(1), 0).shape == ()


@distributed(world_size=2)
def test_zero_bubble_over_layers_that_cannot_defer_their_weight_gradients_warns():
    """zb's W runs the weight gradients B queued; plain nn.Linear layers queue none (B computes them all, W does
    nothing: 1F1B's timing under zb's name). The runner says so once; the gradients are right either way."""
    mesh = tp.init_mesh(pp=2)
    runner = PipelineRunner(_Toy(), mesh, micro_batch_size=MICRO, seq_len=SEQ)
    with pytest.warns(UserWarning, match=r"^schedule 'zb': pipeline stage [01]'s backward deferred no weight "
                                         r"gradient"):
        runner.run(micro_batches(count=2), "zb")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner.run(micro_batches(count=2), "zb")  # (once per runner)
