"""Mixture of experts in the training job. Layer level, against a one-rank GPT built beside the split one (fp64, to
~1e-12): the experts' gradients reduced over the expert-data-parallel group (not dp) by every dp mode, counted once
by clipping, an expert without tokens; the aux loss's gradient under gradient accumulation, tp and cp; capacity
drops the same on every tp rank; the pipeline's B/W split through the grouped GEMM. Job level (shared runs of
`python -m models.train`): every split trains the one-process curve with its aux loss, grad_norm and load statistics,
checkpoints move between (tp, ep, etp, pp, dp) splits with each expert under its own HF name, the Hugging Face export
gives the run's val_loss, the sigmoid routers' bias updates are the same at every split; bad configurations stop
before any process starts.

The jobs run in fp64 (the default dtype; _records) wherever a split is compared with one process or with
transformers: routing is discrete, and in fp32 a decision within rounding of a tie goes either way by machine
(test_capacity_sp_and_full_recompute_at_ep_2_follow_the_one_process_run says why fp64 does not). The fp32 layer-level
comparisons assert their routing's margin instead (tests/moe_reference.py)."""
import pytest
import torch
import torch.distributed as dist

import models
import tp
from models.hf import hf_state_dict
from tp.testing import distributed

from .moe_reference import MARGIN, routing_margins

VOCAB, SEQ, BATCH = 50, 8, 2
BASE = dict(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=24,
            max_seq_len=32, num_experts=6, moe_router_topk=2, moe_ffn_hidden_size=8, moe_aux_loss_coeff=0.1,
            moe_z_loss_coeff=0.01)
UNUSED = 5  # the expert no token chooses (its selection bias far below the sigmoid scores)


def _batches(dp, seed=1):
    g = torch.Generator().manual_seed(seed)
    X = torch.randint(0, VOCAB, (dp * BATCH, SEQ), generator=g)
    return X, torch.randint(0, VOCAB, X.shape, generator=g)


def _serial(config):
    """The one-rank GPT (built before any mesh: its MoE groups are this rank alone) and its group."""
    solo = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    torch.manual_seed(0)
    return models.GPT(config, group=solo), solo


def _starve(model):
    for m in model.modules():
        if isinstance(m, tp.moe.TopKRouter):
            m.expert_bias[UNUSED] = -100.0


def _serial_step(serial, X, Y, parts):
    """The mean over `parts` micro-batches of (LM + aux) losses, backward; its gradient norm."""
    serial.set_moe_aux_loss_scale(1 / parts)
    for x, y in zip(X.chunk(parts), Y.chunk(parts)):
        (serial(x, y) / parts).backward()
    return torch.nn.utils.clip_grad_norm_(serial.parameters(), float("inf")).item()


SPLITS = {"dp4 ep2 (edp 2)": dict(dp=4, ep=2), "tp2 dp2 ep2 etp2 (edp 1)": dict(tp=2, dp=2, ep=2)}


@pytest.mark.parametrize("mode,capacity", [("ddp", None), ("zero1", None), ("fsdp", None), ("ddp", 0.5)])
@pytest.mark.parametrize("split", list(SPLITS))
@distributed(world_size=4)
def test_expert_grads_are_reduced_over_edp_not_dp_and_clipping_counts_each_expert_once(split, mode, capacity):
    """The job's data parallelism (models.training.model.wrap_data_parallel) on a GPT whose experts split over ep:
    the gradients after the reduction, stepped by SGD(lr=1) (p - g, gathered back to dense HF tensors), equal the
    one-rank model's, experts included (summed over edp and divided by dp: reduced over dp they would mix other
    experts' gradients); clip_grad_norm_ gives its norm (each expert once, not once per ep or tp rank); the expert
    no token chose has a zero gradient and nobody waits for it; with a capacity factor (0.5: tokens dropped) too.
    (FSDP2 in fp32, as the job runs it: in fp64 it divides
    a one-rank group's gradients twice, torch 2.13's overflow path.)"""
    from models.training.model import aux_losses_per_micro_batch, wrap_data_parallel

    torch.set_default_dtype(torch.float32 if mode == "fsdp" else torch.float64)
    tol = 1e-6 if mode == "fsdp" else 1e-12
    config = models.GPTConfig(**BASE, moe_router_score="sigmoid", moe_capacity_factor=capacity)
    serial, solo = _serial(config)
    _starve(serial)
    mesh = tp.init_mesh(**SPLITS[split])
    torch.manual_seed(0)
    stage = models.GPT(config)
    _starve(stage)
    aux_losses_per_micro_batch(stage, mesh)
    module = wrap_data_parallel(stage, mesh, mode)
    X, Y = _batches(mesh.dp_size)
    with routing_margins(serial) as margins:
        norm = _serial_step(serial, X, Y, mesh.dp_size)
    # fsdp's fp32 routing is compared across splits: no decision near a tie (tests/moe_reference.py)
    assert mode != "fsdp" or min(margins) >= MARGIN, f"routed within {min(margins):.2g} of a tie"
    x, y = X.chunk(mesh.dp_size)[mesh.dp_rank], Y.chunk(mesh.dp_size)[mesh.dp_rank]
    module(x, y).backward()
    assert abs(tp.clip_grad_norm_(module.parameters(), 0, mesh=mesh).item() - norm) <= max(tol, 1e-7) * norm
    if isinstance(module, tp.optim.DataParallel):
        optimizer = tp.optim.DistributedOptimizer(module, optimizer=torch.optim.SGD, lr=1.0)
        expert_buckets = [b for b in module.buckets if b.group is not module.group]
        assert expert_buckets and all(p.expert_parallel for b in expert_buckets for p in b.params)
    else:
        optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    optimizer.step()
    for p in serial.parameters():
        p.data -= p.grad
    if isinstance(module, tp.optim.DataParallel):
        module.finish_param_sync()
    ours, theirs = hf_state_dict(stage), hf_state_dict(serial, solo)
    assert ours.keys() == theirs.keys()
    for name, want in theirs.items():
        assert (ours[name] - want).abs().max().item() <= tol, name
    for layer in serial.layers:  # (no token chose it: a zero gradient, which the split run matched)
        assert layer.mlp.experts.fc1.grad[UNUSED].abs().max().item() == 0.0


@pytest.mark.parametrize("mode", ["zero1", "fsdp"])
@distributed(world_size=4, timeout=120)
def test_an_expert_without_tokens_gets_zero_grads_and_no_rank_waits(mode):
    """No token on any rank chooses expert 5 (its selection bias far below the scores): its gradient is zero, and
    the data-parallel reduction over edp (zero1's reduce-scatter of the experts' bucket, FSDP2's) and the optimizer
    step complete on every rank (the buckets are reduced at finish_grad_sync whether or not a gradient arrived)."""
    from models.training.model import aux_losses_per_micro_batch, wrap_data_parallel

    torch.set_default_dtype(torch.float32)
    mesh = tp.init_mesh(dp=4, ep=2, etp=1)
    torch.manual_seed(0)
    stage = models.GPT(models.GPTConfig(**BASE, moe_router_score="sigmoid"))
    _starve(stage)
    aux_losses_per_micro_batch(stage, mesh)
    module = wrap_data_parallel(stage, mesh, mode)
    optimizer = tp.optim.DistributedOptimizer(module, optimizer=torch.optim.SGD, lr=1.0) if mode == "zero1" else \
        torch.optim.SGD(module.parameters(), lr=1.0)
    X, Y = _batches(mesh.dp_size)
    module(X.chunk(4)[mesh.dp_rank], Y.chunk(4)[mesh.dp_rank]).backward()
    assert all(a.tokens_per_expert[UNUSED] == 0 for a in tp.moe.aux_losses(stage))
    tp.clip_grad_norm_(module.parameters(), 0, mesh=mesh)  # (reduces first)
    optimizer.step()
    for layer in stage.layers:
        experts = layer.mlp.experts
        if UNUSED in experts.expert_range:
            local = UNUSED - experts.expert_range.start
            for p in experts.weights:
                grad = p.main_grad if mode == "zero1" else p.grad.full_tensor()
                assert grad[local].abs().max().item() == 0.0
                assert grad.abs().max().item() > 0  # (the others' did arrive)


@pytest.mark.parametrize("split", [dict(dp=4, ep=2, etp=1), dict(tp=2, dp=2, ep=2, etp=1), dict(dp=4, ep=4)])
@distributed(world_size=4)
def test_zero1_expert_shards_over_edp_are_the_memory_models_bytes(split):
    """zero1 with the experts sharded over edp (2, 1 and 1 ranks here, the dense weights over dp 4 or 2): after an
    AdamW step of the job's optimizer (tp.optim.memory_bytes, the largest rank's) params, grads and optimizer state
    equal bench.plan.memory's, which pairs each rank's dense shard with its expert shard through tp.mesh.layout."""
    from bench.plan import memory
    from models.training import config as job_config
    from models.training.build import build_optimizer
    from models.training.model import wrap_data_parallel

    torch.set_default_dtype(torch.float32)
    config = models.GPTConfig(**BASE | dict(vocab_size=301, num_experts=4))  # (odd sizes: padded buckets)
    mesh = tp.init_mesh(**split)
    torch.manual_seed(0)
    module = wrap_data_parallel(models.GPT(config), mesh, "zero1")
    optimizer = build_optimizer(module, job_config.JobConfig(), 1)
    X, Y = _batches(mesh.dp_size)
    module(X.chunk(mesh.dp_size)[mesh.dp_rank], Y.chunk(mesh.dp_size)[mesh.dp_rank]).backward()
    module.finish_grad_sync()
    optimizer.step()
    got = torch.tensor(list(tp.optim.memory_bytes(module, optimizer).values()))
    dist.all_reduce(got, op=dist.ReduceOp.MAX)
    want = memory.parameter_memory(config, tp=mesh.tp_size, pp=1, stage=0, virtual_stages=1, dp_mode="zero1",
                                   precision="fp32", shards=mesh.dp_size, ep=split["ep"], etp=split.get("etp"))
    assert tuple(got.tolist()) == want[:3], (tuple(got.tolist()), want)


@distributed(world_size=4)
def test_aux_loss_gradient_is_not_scaled_by_micro_batches_tp_or_cp():
    """models.training.model.build_model scales each MoE layer's aux-loss gradient as the runner scales the LM loss
    (1 / micro-batches) and computes the aux losses over a micro-batch's tp·cp ranks: the tp = cp = 2 job's gradient
    over 2 accumulated micro-batches (through the pipeline runner) is the one-rank model's gradient of the mean of
    the two micro-batches' LM + aux losses, with an aux coefficient large enough to matter."""
    from models.training import config as job_config
    from models.training.model import build_model
    from tp.pipeline import PipelineRunner

    torch.set_default_dtype(torch.float64)
    config = models.GPTConfig(**BASE | dict(moe_aux_loss_coeff=1.0, moe_z_loss_coeff=0.1))
    serial, solo = _serial(config)
    X, Y = _batches(2, seed=3)
    _serial_step(serial, X, Y, 2)
    job = job_config.JobConfig()
    job.parallelism.tp, job.parallelism.cp, job.parallelism.pp, job.parallelism.dp = 2, 2, 1, 1
    job.training.global_batch_size, job.training.micro_batch_size, job.training.seed = 2 * BATCH, BATCH, 0
    mesh = tp.init_mesh(tp=2, cp=2)
    chunks, module = build_model(job, config, mesh)
    runner = PipelineRunner(module, mesh, micro_batch_size=BATCH, seq_len=SEQ)
    runner.run([(x, y) for x, y in zip(X.chunk(2), Y.chunk(2))], "1f1b")
    tp.allreduce_sequence_parallel_grads(chunks[0], mesh.tp_group)
    ours, theirs = hf_state_dict(chunks[0], grads=True), hf_state_dict(serial, solo, grads=True)
    for name, want in theirs.items():
        assert (ours[name] - want).abs().max().item() <= 1e-12 * max(1.0, want.abs().max().item()), name


@pytest.mark.parametrize("sp", [False, True])
@distributed(world_size=2)
def test_capacity_drops_the_same_slots_whatever_the_tp_rank(sp):
    """With a capacity factor the tp ranks route different tokens (their sequence shard under SP, 1/tp of the
    replicated ones without it), and drop by one threshold over the micro-batch (a radix select over tp·cp): the
    tp = 2 model's loss and gradients equal the one-rank model's, its ranks' dropped slots add up to the one-rank
    model's, none of them zero (the factor drops)."""
    torch.set_default_dtype(torch.float64)
    from models.training.model import aux_losses_per_micro_batch

    config = models.GPTConfig(**BASE | dict(moe_capacity_factor=0.5))
    serial, solo = _serial(config)
    mesh = tp.init_mesh(tp=2)
    torch.manual_seed(0)
    model = models.GPT(config.replace(sequence_parallel=sp))
    aux_losses_per_micro_batch(model, mesh)
    X, Y = _batches(1)
    want, loss = serial(X, Y), model(X, Y)
    assert abs(loss.item() - want.item()) <= 1e-12
    want.backward()
    loss.backward()
    tp.allreduce_sequence_parallel_grads(model, mesh.tp_group)
    ours, theirs = hf_state_dict(model, grads=True), hf_state_dict(serial, solo, grads=True)
    for name, value in theirs.items():
        assert (ours[name] - value).abs().max().item() <= 1e-12, name
    for a, b in zip(tp.moe.aux_losses(model), tp.moe.aux_losses(serial)):
        assert torch.equal(a.tokens_per_expert, b.tokens_per_expert)
    for ours, theirs in zip((m for m in model.modules() if isinstance(m, tp.moe.MoE)),
                            (m for m in serial.modules() if isinstance(m, tp.moe.MoE))):
        dropped = ours.dropped_slots.clone()
        dist.all_reduce(dropped, group=mesh.tp_group)
        assert dropped.item() == theirs.dropped_slots.item() > 0


@distributed(world_size=2)
def test_the_pipelines_b_w_split_defers_the_experts_grouped_gemms():
    """Under tp.pipeline.defer_wgrad (zero-bubble schedules' B) the experts' weight gradients are queued too (not
    computed in B), and the W pass computes them into the same gradients as a plain backward, at ep = 2."""
    from tp.pipeline import defer_wgrad

    torch.set_default_dtype(torch.float64)
    mesh = tp.init_mesh(dp=2, ep=2)
    config = models.GPTConfig(**BASE)
    X, Y = _batches(2)
    x, y = X.chunk(2)[mesh.dp_rank], Y.chunk(2)[mesh.dp_rank]
    grads = []
    for split in (False, True):
        torch.manual_seed(0)
        model = models.GPT(config)
        if not split:
            model(x, y).backward()
        else:
            with defer_wgrad() as queue:
                model(x, y).backward()
            experts = tp.moe.expert_parameters(model)
            assert all(p.grad is None for p in experts) and len(queue) >= 2 * len(experts)
            queue.run()
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, deferred in zip(*grads):
        assert (plain - deferred).abs().max().item() <= 1e-15


# ---- the job ---------------------------------------------------------------------------------------------------------

JOB = ["--model", "tiny-moe", "--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--steps", "3",
       "--seed", "7", "--no-sample", "--moe-aux-loss-coeff", "0.1", "--moe-z-loss-coeff", "0.01"]
SPLIT = ["--tp", "2", "--pp", "2", "--dp", "2"]  # 2x1x2x2 (tp x cp x pp x dp)
MOE_KEYS = ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_load_imbalance")


@distributed(world_size=8, timeout=300)
def _train_on_ranks(flags, log):
    return _job(flags, log)


def _job(flags, log, base=JOB, fp64=False):
    """models.train's job on this rank with `flags` after `base`; fp64: every tensor it builds in fp64 (the default
    dtype: this worker's is reset to fp32 after each call)."""
    import json
    import os

    from models.training.cli import parser, train

    if fp64:
        torch.set_default_dtype(torch.float64)
    train(parser().parse_args([*base, *flags, "--log-jsonl", log]))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(log) as f:
            return [json.loads(line) for line in f]


def _records(tmp, name, world_size, *flags, base=JOB, fp64=True):
    """Rank 0's log rows of the job on `world_size` ranks; in fp64 unless fp64=False (the module docstring)."""
    import os

    from tp.testing import run

    return run(_job, world_size, flags=list(flags), log=os.path.join(tmp, f"{name}.jsonl"), base=base, fp64=fp64,
               timeout=300)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The shared runs, in fp64: one process; 2x1x2x2 with ep 2 (ddp, 1F1B; checkpoints every step, val_loss, the
    HF export); ep 4 at etp 1 (zero1, ZB-H1: the B/W split through the grouped GEMM); ep 4 at etp 1 with the allgather
    dispatcher; and 1x2x2x2 (cp 2) with ep 2 at etp 1 (edp 2), FSDP2, resumed from the ep 2 run's step 1. And ep 2
    with zero1 + bf16 + interleaved beside one process in fp32 (the job's default dtype)."""
    tmp = tmp_path_factory.mktemp("moe_runs")
    evaluate = ["--eval-every", "3", "--eval-iters", "1"]
    serial = ["--tp", "1", "--pp", "1", "--dp", "1"]
    out = {"tmp": tmp, "serial": _records(tmp, "serial", 1, *serial, *evaluate),
           "serial fp32": _records(tmp, "serial32", 1, *serial, fp64=False)}
    out["ep2"] = _records(tmp, "ep2", 8, *SPLIT, "--ep", "2", "--save", str(tmp / "ckpt"), "--save-every", "1",
                          "--export-hf", str(tmp / "hf"), *evaluate)
    out["ep4 etp1 zero1 zb"] = _records(tmp, "ep4", 8, *SPLIT, "--ep", "4", "--etp", "1", "--dp-mode", "zero1",
                                        "--schedule", "zb")
    out["ep2 zero1 bf16 interleaved"] = _records(tmp, "bf16", 8, *SPLIT, "--ep", "2", "--dp-mode", "zero1",
                                                 "--precision", "bf16", "--schedule", "interleaved",
                                                 "--virtual-stages", "2", fp64=False)
    out["ep4 etp1 allgather"] = _records(tmp, "allgather", 8, *SPLIT, "--ep", "4", "--etp", "1", "--moe-dispatcher",
                                         "allgather")
    out["resumed cp2 ep2 etp1 fsdp"] = _records(tmp, "resumed", 8, "--tp", "1", "--cp", "2", "--pp", "2", "--dp", "2",
                                                "--ep", "2", "--etp", "1", "--dp-mode", "fsdp",
                                                "--load", str(tmp / "ckpt" / "step-000001"))
    return out


def test_every_split_trains_the_one_process_curve_with_its_aux_loss_and_grad_norm(runs):
    """Dropless: loss, grad_norm, aux and z losses and the load imbalance of every fp64 split equal the one-process
    run's (≤ 1e-5 relative): the aux losses' gradient is neither scaled by the micro-batch count (4 here, 2 there) nor
    by tp, the experts' gradients are reduced over edp, clipping counts each expert once; bf16 within the dense runs'
    bf16 tolerance (3 %) of the fp32 one; the resumed run continues the curve at another (tp, cp, ep, etp, pp, dp).
    (In fp32 a token whose k-th and (k+1)-th experts score within rounding of each other may pick either: ~12,000
    routings here, the closest 5e-6 apart, would flip one now and then on some machine, moving the load imbalance by
    1/64 and grad_norm by ~1e-4. fp64 routes alike: see the capacity test below. bf16 routes otherwise anyway: its
    tolerance covers it.)"""
    serial = runs["serial"]
    assert len(serial) == 3 and serial[-1]["loss"] < serial[0]["loss"]
    assert all(r["moe_aux_loss"] > 0 and r["moe_z_loss"] > 0 and r["moe_load_imbalance"] >= 1 for r in serial)
    assert "moe_dropped_tokens" not in serial[0]  # dropless
    for name in ("ep2", "ep4 etp1 zero1 zb", "ep4 etp1 allgather", "resumed cp2 ep2 etp1 fsdp"):
        reference = serial[-len(runs[name]):]
        for step, (ours, want) in enumerate(zip(runs[name], reference, strict=True)):
            for key in MOE_KEYS:
                assert abs(ours[key] - want[key]) <= 1e-5 * abs(want[key]), (name, step, key, ours[key], want[key])
    for ours, want in zip(runs["ep2 zero1 bf16 interleaved"], runs["serial fp32"], strict=True):
        for key in MOE_KEYS:
            assert abs(ours[key] - want[key]) <= 0.03 * abs(want[key]), ("bf16", key, ours[key], want[key])
    assert abs(runs["ep2"][-1]["val_loss"] - serial[-1]["val_loss"]) <= 1e-5 * serial[-1]["val_loss"]


RUN_SPLITS = {  # (tp, cp, pp, dp, ep, etp, dp_mode, precision, virtual stages) of the shared runs
    "serial": (1, 1, 1, 1, 1, 1, "ddp", "fp64", 1), "serial fp32": (1, 1, 1, 1, 1, 1, "ddp", "fp32", 1),
    "ep2": (2, 1, 2, 2, 2, 2, "ddp", "fp64", 1), "ep4 etp1 zero1 zb": (2, 1, 2, 2, 4, 1, "zero1", "fp64", 1),
    "ep2 zero1 bf16 interleaved": (2, 1, 2, 2, 2, 2, "zero1", "bf16", 2),
    "ep4 etp1 allgather": (2, 1, 2, 2, 4, 1, "ddp", "fp64", 1),
    "resumed cp2 ep2 etp1 fsdp": (1, 2, 2, 2, 2, 1, "fsdp", "fp64", 1)}


def test_the_jobs_logged_bytes_equal_the_memory_estimate(runs):
    """bench.plan.memory counts the experts exactly: each shared run's logged param_bytes, grad_bytes and
    optimizer_bytes (the largest rank's) equal parameter_memory's largest stage, byte for byte: the experts' own
    buckets over edp (ddp in its all-reduce form, zero1 sharded, bf16 masters), FSDP2's experts sharded over edp.
    (An fp64 run holds the fp32 run's tensors at twice the bytes.)"""
    from bench.plan import memory
    from models.config import PRESETS

    config = models.GPTConfig(**PRESETS["tiny-moe"] | dict(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01))
    for name, (t, c, p, d, ep, etp, mode, precision, v) in RUN_SPLITS.items():
        stages = []
        for s in range(p):
            params, grads, optimizer = memory.parameter_memory(
                config, tp=t, pp=p, stage=s, virtual_stages=v, dp_mode=mode,
                precision="fp32" if precision == "fp64" else precision, shards=d * c, ep=ep, etp=etp)[:3]
            if precision == "fp64":  # fp32's tensors at twice the bytes but the resumed run's AdamW step counters,
                # read from the ep 2 checkpoint as tp.optim's DistributedOptimizer stores them (fp32 scalars; FSDP2's
                # estimate: 8 bytes of moments per 4 of parameter, then the counters)
                steps = optimizer - 2 * params if name.startswith("resumed") else 0
                params, grads, optimizer = 2 * params, 2 * grads, 2 * optimizer - steps
            stages.append((params, grads, optimizer))
        want = tuple(max(stage[i] for stage in stages) for i in range(3))
        first = runs[name][0]
        assert (first["param_bytes"], first["grad_bytes"], first["optimizer_bytes"]) == want, (name, first, want)


def test_tflops_count_active_parameters(runs):
    """tflops_per_rank counts the k routed experts (and the router) per token, not the E held."""
    from models.config import PRESETS
    from models.flops import flops_per_token, matmul_params

    config = models.GPTConfig(**PRESETS["tiny-moe"])
    assert matmul_params(config) < matmul_params(config, active=False)
    first = runs["serial"][0]
    assert first["tflops_per_rank"] == pytest.approx(flops_per_token(config, 32) * 8 * 32 / first["step_s"] / 1e12,
                                                     rel=1e-9)


def test_checkpoints_hold_each_expert_under_its_hf_name_and_global_index(runs):
    """The ep 2 run's checkpoint stores every expert as Mixtral's per-expert tensors (block_sparse_moe.experts.<e>.w1
    / w3 / w2) under its global index: equal to the same names in its Hugging Face export, so a run resumed at
    another ep (the fsdp run above, ep 2 at etp 1 over other ranks) finds each expert, not a permutation of them."""
    import safetensors.torch

    ckpt, hf = runs["tmp"] / "ckpt" / "step-000003", runs["tmp"] / "hf"
    exported = {}
    for file in hf.glob("*.safetensors"):
        exported |= safetensors.torch.load_file(file)
    names = [n for n in exported if ".block_sparse_moe.experts." in n]
    assert len(names) == 4 * 8 * 3  # layers x experts x (w1, w3, w2)
    state = {f"model.{n}": torch.empty_like(exported[n]) for n in names}
    _read_checkpoint(state, ckpt)
    for n in names:
        assert torch.equal(state[f"model.{n}"], exported[n]), n


def _read_checkpoint(state, path):
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # (no_dist: this process alone reads it)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def _held_out_loss(path):
    """A Hugging Face directory's loss through transformers on the job's first held-out batch (its val_loss with
    --eval-iters 1)."""
    import transformers

    from models.training import data

    model = transformers.AutoModelForCausalLM.from_pretrained(  # (fp64: HF's expert loop, grouped_mm has no fp64)
        path, experts_implementation="eager").eval()
    _, held_out = data.split(data.corpus(), 32)
    (x, y), = data.eval_batches(held_out, dp=1, dp_rank=0, global_batch_size=8, micro_batch_size=8, iters=1)[0]
    with torch.no_grad():
        return model.config.model_type, torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1),
                                                                           y.flatten()).item()


def test_the_hf_export_gives_the_runs_val_loss_in_transformers(runs):
    """--export-hf of the 2x1x2x2 ep 2 run: a Mixtral directory transformers loads, whose loss on the held-out batch
    is the run's val_loss. (fp64 on both sides, transformers loading the saved dtype: they route alike.)"""
    family, loss = _held_out_loss(runs["tmp"] / "hf")
    assert family == "mixtral" and abs(loss - runs["ep2"][-1]["val_loss"]) <= 1e-5 * loss


def test_from_hf_qwen3_moe_trains_at_ep_2_and_exports_qwen3_moe(tmp_path):
    """--from-hf a Qwen3-MoE directory (per-head q/k norms, experts smaller than its dense size): trained at pp 2 x
    dp 4 with ep 2 (each rank reading only its experts), its --export-hf is a Qwen3-MoE directory again whose
    held-out loss in transformers is the run's val_loss. (An fp64 directory trained in fp64: transformers routes the
    held-out batch as the run did.)"""
    import transformers

    source = tmp_path / "qwen3"
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(config).double().save_pretrained(source)
    base = ["--from-hf", str(source), "--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2",
            "--steps", "2", "--no-sample", "--moe-aux-loss-coeff", "0.01"]
    records = _records(str(tmp_path), "qwen3", 8, "--tp", "1", "--pp", "2", "--dp", "4", "--ep", "2", "--eval-every",
                       "2", "--eval-iters", "1", "--export-hf", str(tmp_path / "out"), base=base)
    assert len(records) == 2 and records[-1]["loss"] < records[0]["loss"] and records[0]["moe_aux_loss"] > 0
    family, loss = _held_out_loss(tmp_path / "out")
    assert family == "qwen3_moe" and abs(loss - records[-1]["val_loss"]) <= 1e-5 * loss


def test_sigmoid_routers_bias_updates_are_the_same_at_every_split(tmp_path):
    """--moe-router-score sigmoid: after each step every router's selection bias moves by 1e-3 · sign(mean load - load)
    (--moe-router-bias-update-rate; 0: they stay) from the step's global loads (over the stage's tp·cp·dp ranks), so
    the one-process run and the tp 2 x dp 2 ep 2 run end with the same biases (read from their checkpoints, where they
    are stored as HF's e_score_correction_bias) and the same curve. (In fp64: a load is a count of routings, fp64
    routes alike.)"""
    sigmoid = ["--moe-router-score", "sigmoid", "--steps", "2"]
    serial = _records(str(tmp_path), "serial", 1, "--tp", "1", "--pp", "1", "--dp", "1", *sigmoid,
                      "--save", str(tmp_path / "serial"))
    split = _records(str(tmp_path), "split", 4, "--tp", "2", "--pp", "1", "--dp", "2", "--ep", "2", *sigmoid,
                     "--save", str(tmp_path / "split"))
    for ours, want in zip(split, serial, strict=True):
        assert abs(ours["loss"] - want["loss"]) <= 1e-5 * want["loss"]
    keys = [f"model.model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias" for i in range(4)]
    biases = [_read_checkpoint({k: torch.empty(8, dtype=torch.float64) for k in keys}, tmp_path / run / "step-000002")
              for run in ("serial", "split")]
    for key in keys:
        assert torch.equal(biases[0][key], biases[1][key]) and biases[0][key].abs().sum() > 0, key
    _records(str(tmp_path), "frozen", 1, "--tp", "1", "--pp", "1", "--dp", "1", *sigmoid, "--steps", "1",
             "--moe-router-bias-update-rate", "0", "--save", str(tmp_path / "frozen"))  # (Megatron's flag)
    frozen = _read_checkpoint({k: torch.empty(8, dtype=torch.float64) for k in keys},
                              tmp_path / "frozen" / "step-000001")
    assert all(not value.any() for value in frozen.values())


def test_capacity_sp_and_full_recompute_at_ep_2_follow_the_one_process_run(tmp_path):
    """--moe-capacity-factor 1 (tokens dropped, logged as moe_dropped_tokens) with SP, full recompute and zero1 at
    tp 2 x dp 4 with ep 2: the recomputed forward routes and drops as the first one did, so the first step's loss,
    aux loss, grad_norm and dropped count equal the one-process run's.

    Both jobs run in fp64 (the default dtype: the model, its activations and gradients). Why the dropped count can be
    compared exactly: a hard capacity cut is a discontinuous function of the routing weights. In fp32 the two runs'
    weights differ by rounding (the router's GEMM at other shapes, reductions in another order, and each CPU kernel
    set rounding its own way), and a slot within that rounding of the cut flips, then the layers after it see another
    input: the count was off by 1 to 3 of ~490 under ATEN_CPU_CAPABILITY=default, avx2 and avx512 (issue 40). In fp64
    the runs' logits agree to ~1e-16 relative; the router rounds them to fp32 (its choice is made in fp32) where two
    such values round apart only within ~1e-16 of an fp32 rounding midpoint (a chance of ~1e-9 a logit, ~8,000
    logits here), and the same fp32 logits give the same fp32 weights, cut and drops: the count is the same on any
    machine. The tolerances: the loss is fp64 throughout (1e-12 relative, ~1e4 x its reduction-order error); the
    gradient norm (clip_grad_norm_ returns fp32) and the aux and z losses (recorded in fp32 per layer) are fp64
    values rounded to fp32, at most 2^-23 = 1.2e-7 apart relative (1e-6)."""
    extra = ["--moe-capacity-factor", "1.0", "--steps", "1"]
    serial = _records(str(tmp_path), "serial", 1, "--tp", "1", "--pp", "1", "--dp", "1", *extra)
    split = _records(str(tmp_path), "split", 8, "--tp", "2", "--pp", "1", "--dp", "4", "--ep", "2", "--dp-mode",
                     "zero1", "--recompute", "full", "--sequence-parallel", *extra)  # (the shared runs' pools)
    (ours,), (want,) = split, serial
    assert want["moe_dropped_tokens"] > 0 and ours["moe_dropped_tokens"] == want["moe_dropped_tokens"]
    assert ours["moe_load_imbalance"] == want["moe_load_imbalance"]  # (from the routed counts: integers)
    assert abs(ours["loss"] - want["loss"]) <= 1e-12 * want["loss"]
    for key in ("moe_aux_loss", "moe_z_loss", "grad_norm"):
        assert abs(ours[key] - want[key]) <= 1e-6 * abs(want[key]), (key, ours[key], want[key])


def test_recompute_modules_train_the_one_process_curve(tmp_path):
    """Megatron-Core's MoE recompute modules in the job, with a shared expert: moe_act (the experts' activation
    output refilled in backward), shared_experts and layernorm at tp 1 x pp 2 x dp 2 with ep 2, and moe (the whole
    layer) at tp 2 with SP and an uneven pipeline: loss, aux losses and grad_norm equal the one-process run's."""
    shared = ["--moe-shared-expert-size", "64"]
    serial = _records(str(tmp_path), "serial", 1, "--tp", "1", "--pp", "1", "--dp", "1", *shared)
    runs = {
        "moe_act shared_experts layernorm": ["--tp", "1", "--pp", "2", "--dp", "2", "--ep", "2", "--recompute",
                                             "selective", "--recompute-modules", "moe_act", "shared_experts",
                                             "layernorm"],
        "moe, tp 2 sp, last stage 1 layer": ["--tp", "2", "--pp", "2", "--dp", "1", "--sequence-parallel",
                                             "--last-stage-layers", "1", "--recompute", "selective",
                                             "--recompute-modules", "moe", "core_attn"],
    }
    for name, flags in runs.items():
        records = _records(str(tmp_path), name.replace(" ", "_").replace(",", ""), 4, *shared, *flags)
        for ours, want in zip(records, serial, strict=True):
            for key in MOE_KEYS:
                assert abs(ours[key] - want[key]) <= 1e-5 * abs(want[key]), (name, key, ours[key], want[key])


@pytest.mark.parametrize("argv,message", [
    (["--model", "tiny-moe", "--tp", "2", "--pp", "1", "--dp", "2", "--ep", "3"],
     r"--ep=3 \* --etp=2 = 6 does not divide --tp\*--cp\*--dp = 2\*1\*2 = 4"),
    (["--model", "tiny-moe", "--tp", "1", "--pp", "1", "--dp", "3", "--ep", "3", "--global-batch-size", "6"],
     r"--ep=3 --etp=1: num_experts=8 is not divisible by ep=3"),
    (["--model", "tiny-moe", "--moe-router-topk", "9"], r"moe_router_topk=9 > num_experts=8"),
    (["--model", "tiny", "--ep", "2"], r"--ep=2 --etp=2 split the experts of a mixture of experts, and the model has "
                                       r"none"),
    (["--model", "tiny-moe", "--moe-layer-freq", "0,2"], r"--moe-layer-freq='0,2' must be N >= 1"),
])
def test_bad_moe_configurations_are_one_line_before_any_process(argv, message, capsys):
    """ep·etp not dividing tp·cp·dp, experts not divisible by ep, top-k above the experts, ep without experts: one
    line, exit 2, no process started."""
    import re

    from models.training.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


@distributed(world_size=2)
def test_a_checkpoint_saved_at_etp_2_resumes_at_ep_2_with_each_expert_in_place():
    """models.training.checkpoint at the layer level: a GPT and its AdamW state saved with every expert's FFN split
    over etp = tp = 2 load at ep = 2 (each rank whole experts: others than it saved): the same dense weights and
    optimizer state, expert by expert (none permuted, none a slice of another)."""
    import tempfile

    from models.training import checkpoint

    torch.set_default_dtype(torch.float64)
    config = models.GPTConfig(**BASE)
    path = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    holder = [path]
    dist.broadcast_object_list(holder)
    path = holder[0]
    states = []
    for split in (dict(tp=2), dict(dp=2, ep=2)):
        mesh = tp.init_mesh(**split)
        torch.manual_seed(0 if split.get("tp") else 1)  # (other weights: loading must overwrite them)
        model = models.GPT(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        if split.get("tp"):
            model(*_batches(1)).backward()
            optimizer.step()
            checkpoint.save(path, model, optimizer, mesh=mesh, step=1)
        else:
            assert checkpoint.load(path, model, optimizer, mesh=mesh)[0] == 1
        exp_avg = {p: optimizer.state[p]["exp_avg"] for p in model.parameters()}
        for p in model.parameters():  # the state, gathered like the weights: swapped in as .grad
            p.grad = exp_avg[p]
        states.append((hf_state_dict(model), hf_state_dict(model, grads=True)))
        tp.destroy_mesh(keep_groups=True)
    for saved, loaded in zip(*states):
        assert saved.keys() == loaded.keys()
        for name in saved:
            assert torch.equal(saved[name], loaded[name]), name
