"""Mixture of experts in the training job. Layer level, against a one-rank GPT built beside the split one (fp64, to
~1e-12): the experts' gradients reduced over the expert-data-parallel group (not dp) by every dp mode, counted once
by clipping, an expert without tokens; the aux loss's gradient under gradient accumulation, tp and cp; capacity
drops the same on every tp rank; the pipeline's B/W split through the grouped GEMM. Job level (shared runs of
`python -m models.train`): every split trains the one-process curve with its aux loss, grad_norm and load statistics,
checkpoints move between (tp, ep, etp, pp, dp) splits with each expert under its own HF name, the Hugging Face export
gives the run's val_loss, the sigmoid routers' bias updates are the same at every split; bad configurations stop
before any process starts."""
import pytest
import torch
import torch.distributed as dist

import models
import tp
from models.hf import hf_state_dict
from tp.testing import distributed

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


@pytest.mark.parametrize("mode", ["ddp", "zero1", "fsdp"])
@pytest.mark.parametrize("split", list(SPLITS))
@distributed(world_size=4)
def test_expert_grads_are_reduced_over_edp_not_dp_and_clipping_counts_each_expert_once(split, mode):
    """The job's data parallelism (models.training.model.wrap_data_parallel) on a GPT whose experts split over ep:
    the gradients after the reduction, stepped by SGD(lr=1) (p - g, gathered back to dense HF tensors), equal the
    one-rank model's, experts included (summed over edp and divided by dp: reduced over dp they would mix other
    experts' gradients); clip_grad_norm_ gives its norm (each expert once, not once per ep or tp rank); the expert
    no token chose has a zero gradient and nobody waits for it. (FSDP2 in fp32, as the job runs it: in fp64 it divides
    a one-rank group's gradients twice, torch 2.13's overflow path.)"""
    from models.training.model import aux_losses_per_micro_batch, wrap_data_parallel

    torch.set_default_dtype(torch.float32 if mode == "fsdp" else torch.float64)
    tol = 1e-6 if mode == "fsdp" else 1e-12
    config = models.GPTConfig(**BASE, moe_router_score="sigmoid")
    serial, solo = _serial(config)
    _starve(serial)
    mesh = tp.init_mesh(**SPLITS[split])
    torch.manual_seed(0)
    stage = models.GPT(config)
    _starve(stage)
    aux_losses_per_micro_batch(stage, mesh)
    module = wrap_data_parallel(stage, mesh, mode)
    X, Y = _batches(mesh.dp_size)
    norm = _serial_step(serial, X, Y, mesh.dp_size)
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
