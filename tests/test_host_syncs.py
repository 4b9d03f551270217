"""Host syncs: tp.host_syncs.count_host_syncs sees every read of a tensor's values by the host, on the CPU too; the
training job's step has none until a step logs (one read then, for every step since the last), but for the ones a
mixture of experts needs; the optimizer over the fp32 masters is torch's fused AdamW, which skips a step whose
gradient norm is not finite on the device."""
import math

import pytest
import torch

import tp
from tp.host_syncs import count_host_syncs, host_values, to_host
from tp.testing import distributed

FLAGS = ["--model", "tiny", "--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--seed", "7",
         "--no-sample", "--steps", "4", "--log-interval", "4"]
GLOBAL_MICRO_BATCHES = 4  # per step, over the dp ranks


def test_every_kind_of_host_read_is_counted_and_nothing_else():
    x = torch.randn(10, requires_grad=True)

    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            g.tolist()  # (autograd's backward: counted too)
            return g * 2

    with count_host_syncs() as syncs:
        ReadsInBackward.apply(x).sum().backward()
        y = x.detach().sum()
        x.grad.clamp_(-1, 1)
        torch.nn.utils.clip_grad_norm_([x], 1.0, foreach=True)  # torch's clipping: no read
        x[torch.tensor([1, 2])], torch.repeat_interleave(torch.tensor([1, 2]), torch.tensor([1, 2]), output_size=3)
        host_values(torch.tensor([1.0]))  # (a host tensor by design: not counted)
        assert len(syncs) == 1  # the backward's tolist
        y.item(), bool(y > 0), float(y), x[x > 0], x.tolist(), x.detach().numpy(), torch.nonzero(x), torch.unique(x)
        torch.repeat_interleave(torch.tensor([1, 2]), torch.tensor([1, 2])), to_host(x)
    ops = [s.op for s in syncs]
    assert ops == ["tolist", "aten._local_scalar_dense.default", "aten._local_scalar_dense.default",
                   "aten._local_scalar_dense.default", "aten.index.Tensor", "tolist", "numpy", "aten.nonzero.default",
                   "aten._unique2.default", "aten.repeat_interleave.Tensor", "to_host"], ops
    assert syncs[1].where[-1].startswith("tests/test_host_syncs.py:")  # where: the caller's line
    assert "ReadsInBackward" not in syncs.summary() and "3 x aten._local_scalar_dense.default at tests/" in \
        syncs.summary()
    with pytest.raises(ValueError, match="host_values: a tensor on meta"):
        host_values(torch.empty(1, device="meta"))
    assert torch.Tensor.tolist is torch.Tensor.__dict__["tolist"]  # (unwrapped after the block)


def test_the_id_range_checks_read_nothing_on_a_good_batch_and_name_a_bad_id():
    ids = torch.tensor([[0, 5, 9]])
    with count_host_syncs() as syncs:
        tp.debug.check_range(ids, 10, lambda i: f"id {i} out of range")
    assert len(syncs) == 0
    with pytest.raises(ValueError, match="^id 12 out of range$"):
        tp.debug.check_range(torch.tensor([3, 12, 11]), 10, lambda i: f"id {i} out of range")


def _trainer(flags):
    from models.training.cli import job_config, parser, validate
    from models.training.trainer import Trainer

    job = job_config(parser().parse_args([*FLAGS, *flags]))
    validate(job, torch.distributed.get_world_size())
    return Trainer(job)


def _counted_step(flags):
    """Step 1 (after step 0) run without reading, then read: (its syncs, the read's syncs, the trainer)."""
    trainer = _trainer(flags)
    trainer.read([trainer.run_step(0)])
    with count_host_syncs() as syncs:
        values = trainer.run_step(1)
    with count_host_syncs() as read:
        (record, _), = trainer.read([values])
    assert math.isfinite(record["loss"]) and record["step"] == 2
    return syncs, read, trainer


@pytest.mark.parametrize("world_size,flags", [
    (1, ["--tp", "1", "--pp", "1"]),
    (8, ["--tp", "2", "--pp", "2", "--dp", "2"]),  # 1F1B over 2 stages, DDP
    (4, ["--tp", "2", "--pp", "1", "--dp", "2", "--dp-mode", "zero1", "--sequence-parallel"]),
])
def test_a_dense_step_has_no_host_sync_until_it_logs_and_steps_fused_adamw(world_size, flags):
    from tp.testing import run

    for syncs, read, fused in run(_dense_step, world_size, flags=flags, timeout=300):
        assert syncs == "", syncs  # (before: 47 at one rank: the norm, the loss, the id checks, AdamW's step counts)
        assert read == 1  # the log's one copy of the step's values to the host
        assert fused


def _dense_step(flags):
    syncs, read, trainer = _counted_step(flags)
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # (zero1: tp.optim.DistributedOptimizer's)
    return syncs.summary(), len(read), inner.defaults["fused"] and inner.param_groups[0]["fused"]


MOE = ["--model", "tiny-moe", "--tp", "1", "--pp", "1"]


@pytest.mark.parametrize("world_size,flags,dispatched", [
    (1, ["--moe-dispatcher", "alltoall"], None),  # ep = 1: every slot stays on the rank, no exchange
    (2, ["--moe-dispatcher", "alltoall", "--ep", "2"], "to_host"),
    (2, ["--moe-dispatcher", "allgather", "--ep", "2"], "aten.nonzero.default"),
    (1, ["--moe-capacity-factor", "1.0"], "to_host"),  # dropping: the all-to-all's path, at ep = 1 too
])
def test_a_moe_step_syncs_only_for_the_sizes_its_dispatch_needs(world_size, flags, dispatched):
    """Per MoE layer and micro-batch, in the forward only (the backward reuses the sizes):
    - alltoall at ep > 1, or with a capacity factor: one copy of the count table [etp, ep, E] to the host: the
      all-to-all-v's split sizes are host integers (NCCL's and gloo's all_to_all_single take them so) — inherent;
    - allgather: this rank's experts' slots among the gathered ones (`nonzero`: their number sizes the grouped GEMM's
      input; a fixed-size layout would need none: not done yet);
    and, on the CPU's torch backend, the grouped weight-gradient loop reads the rows per expert (twice: w1, w2; the
    Triton kernels take them as offsets on the device)."""
    from tp.testing import run

    for ops in run(_moe_step, world_size, flags=[*MOE, "--dp", str(world_size), *flags], timeout=300):
        layers = GLOBAL_MICRO_BATCHES // world_size * 4  # 4 MoE layers (tiny-moe) x this dp rank's micro-batches
        expected = {"tolist grouped wgrad": 2 * layers} | ({dispatched: layers} if dispatched else {})
        assert ops == expected, ops


def _moe_step(flags):
    syncs, read, _ = _counted_step(flags)
    assert len(read) == 1
    ops = {}
    for sync in syncs:
        name = f"{sync.op} grouped wgrad" if "_torch_wgrad" in str(sync) else sync.op
        ops[name] = ops.get(name, 0) + 1
    return ops


@pytest.mark.parametrize("fused", [True, False])
def test_a_step_with_a_non_finite_norm_changes_nothing(fused):
    """tp.optim.step_if_finite: fused AdamW skips on the device (torch's found_inf, no host sync), any other
    optimizer on the host (one read); the parameters and the state (its step count) as they were."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, **({"fused": True} if fused else {"foreach": True}))
    assert tp.optim.fast_adam(model.parameters()) == {"fused": True}
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
    model.weight.grad[0, 0] = math.nan
    with count_host_syncs() as syncs:
        tp.optim.step_if_finite(optimizer, torch.linalg.vector_norm(model.weight.grad))
    assert len(syncs) == (0 if fused else 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(v, optimizer.state[model.weight][k]) for k, v in state.items())
    model.weight.grad.fill_(1.0)
    tp.optim.step_if_finite(optimizer, torch.linalg.vector_norm(model.weight.grad))
    assert not torch.equal(before[0], model.weight) and optimizer.state[model.weight]["step"].item() == 2


@distributed(world_size=1)
def test_clipping_leaves_the_norm_on_the_device():
    tp.init_mesh()
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    with count_host_syncs() as syncs:
        norm, local = tp.clip_grad_norm_(params, 1.0, with_local=True)
    assert len(syncs) == 0 and norm.dtype == torch.float32 and norm.item() == pytest.approx(math.sqrt(28))
    assert local.item() == norm.item()
    assert params[0].grad[0].item() == pytest.approx(2 / math.sqrt(28), rel=1e-6)


@pytest.mark.parametrize("world_size,flags", [
    (1, ["--tp", "1", "--pp", "1"]), (2, ["--tp", "1", "--pp", "2"]), (1, MOE),
    (2, ["--tp", "1", "--pp", "1", "--dp", "2", "--dp-mode", "fsdp"])])
def test_a_step_makes_its_host_numbers_on_the_host_under_any_default_device(world_size, flags):
    """A CUDA job sets CUDA as the default device: a host-side number made without a device (the runner's clocks,
    the batch check's flags, the memory totals, the MoE counts) then lands on the GPU and host_values refuses it
    (run 4 on an H200: `python -m models.train --device cuda` failed at its first step; FSDP2's clipping read each
    gradient's shard offset from the device). Here the default device is "meta" while the job runs on the CPU: the
    steps log what they log without it."""
    from tp.testing import run

    for plain, meta in run(_records_under, world_size, flags=flags, timeout=300):
        assert meta == plain


CLOCKS = ("time", "_s", "bubble", "per_s", "mfu", "tflops")  # a record's clock readings: differ run to run


def _records_under(flags):
    records = []
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        trainer = _trainer(flags)
        with torch.device(device):
            values = [trainer.run_step(0)]  # (the first step: the memory totals too)
            records.append([{k: v for k, v in record.items() if not any(w in k for w in CLOCKS)}
                            for record, _ in trainer.read(values)])
        tp.destroy_mesh()
    return records


@distributed(world_size=2)
def test_the_straggler_gather_reads_host_clocks_without_a_device_sync():
    """Every rank's step clocks are host numbers: gathered on the host (gloo) and read at once, never as 2 x world
    `.item()` reads of device tensors (on a GPU each one a sync, at every log step)."""
    from models.training.stragglers import Stragglers

    watch = Stragglers(interval=1, factor=2.0, rank0=False)
    rank = torch.distributed.get_rank()
    with count_host_syncs() as syncs, torch.device("meta"):  # (meta: a CUDA job's default device, see above)
        row = watch.gather(1, 0.5 + rank, 0.75 + rank, 1)
    assert len(syncs) == 0, syncs.summary()
    assert row == {"slowest_rank": 1, "rank_step_s_max": 1.5, "rank_step_s_min": 0.5, "rank_wait_s_max": 0.25}



@distributed(world_size=2)
def test_a_whole_run_with_evaluation_and_a_checkpoint_takes_no_default_device():
    """The rest of a CUDA job's run beside its steps: validation, and a checkpoint (its DeviceMesh's rank table and
    the shards' dense indices are host numbers; made on a CUDA default device they went to the GPU, where "meta"
    cannot hold them). tp 2 under a "meta" default device trains, evaluates and saves as on the CPU."""
    import os
    import tempfile

    folder = [tempfile.mkdtemp()]
    torch.distributed.broadcast_object_list(folder)  # (rank 0's folder for both)
    trainer = _trainer(["--tp", "2", "--pp", "1", "--eval-interval", "2", "--eval-iters", "1",
                        "--save", os.path.join(folder[0], "ckpt"), "--log-dir", folder[0]])
    with torch.device("meta"):
        trainer.fit()
    assert sorted(os.listdir(os.path.join(folder[0], "ckpt"))) == ["latest", "step-000004"]
