"""tp.optim against a serial reference: the distributed optimizer (ZeRO-1) and its all-reduce form step exactly as one
process's AdamW does (fp64), with gradient accumulation, several buckets, padding, a deferred weight gradient; the
collectives are one reduce-scatter and one all-gather per bucket; bf16 parameters are copies of fp32 masters that the
optimizer updates; bytes per parameter follow REFERENCE §11's table; clip_grad_norm_ gives the serial model's norm
across tp (replicated kv rows, duplicated norms and biases), pp (a tied embedding on two stages) and dp (replicated,
zero1 shards, FSDP2 shards)."""
import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import kernels
import models
import tp
from models.stages import stage_options
from tests.helpers import comm_counts
from tp.optim import DataParallel, DistributedOptimizer, clip_grad_norm_, keep_param_tags, memory_bytes, reduced_grad
from tp.testing import distributed

from .helpers import rng

ROWS, MICRO, STEPS = 8, 2, 3  # global batch rows, micro-batches per step, steps


def net(group, dtype=torch.float64, late=False):
    """LayerNorm (.grad path, 5 elements: padding) -> column (fused wgrad into main_grad) -> row parallel layer."""
    torch.manual_seed(0)
    column = tp.ColumnParallelLinear(5, 6, activation="gelu", group=group, dtype=dtype)
    row = tp.RowParallelLinear(6, 3, group=group, dtype=dtype)
    if late:  # its weight gradient computed after backward, as a zero-bubble schedule's W pass does
        row.forward = _late_row(row)
    return nn.Sequential(nn.LayerNorm(5, bias=False, dtype=dtype), column, row)


_deferred = []


class _LateWgrad(torch.autograd.Function):
    """forward: x Wᵀ · backward: dx now, W's gradient queued (into main_grad through kernels.ops.linear_wgrad)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        ctx.main_grad = weight.main_grad
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        _deferred.append(lambda: kernels.ops.linear_wgrad(grad.reshape(-1, grad.shape[-1]),
                                                          x.reshape(-1, x.shape[-1]), main_grad=ctx.main_grad))
        return grad @ weight, None


def _late_row(row):
    def forward(x):
        return tp.reduce_from_tp_region(_LateWgrad.apply(x, row.weight), row.group) + row.bias
    return forward


def batch(step, dp_rank, dp_size):
    g = rng(step)
    return torch.randn(ROWS, 5, generator=g, dtype=torch.float64).chunk(dp_size)[dp_rank]


def solo_group():
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)


def reference(steps):
    """One process, the dense layers, torch's AdamW on the whole batch: the parameters after each step."""
    model = net(solo_group())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    states = []
    for step in range(steps):
        model(batch(step, 0, 1)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        states.append([p.detach().clone() for p in model.parameters()])
    return model, states


@pytest.mark.parametrize("shard,accumulate", [(True, "count"), (True, "no_sync"), (False, "count")])
@distributed(world_size=4)
def test_distributed_optimizer_steps_as_serial_adamw(shard, accumulate):
    mesh = tp.init_mesh(tp=2)
    _, ref_states = reference(STEPS)
    model = DataParallel(net(mesh.tp_group), group=mesh.dp_group, shard=shard, bucket_numel=10)
    assert [len(b.params) for b in model.buckets] == [2, 2, 1]  # row (12), column (3·5 + 3), norm (5: padded to 6)
    opt = DistributedOptimizer(model, lr=1e-2, weight_decay=0.1)
    column, row = model.module[1], model.module[2]
    plain = net(mesh.tp_group)  # the tp layers' own backward collectives, counted apart
    hidden = plain[1](plain[0](batch(0, 0, 1)))
    _, tp_counts = comm_counts(lambda: plain[2](hidden).sum().backward())
    for step in range(STEPS):
        micro = batch(step, mesh.dp_rank, mesh.dp_size).chunk(MICRO)
        if accumulate == "count":  # each parameter's gradient is complete after MICRO arrivals
            model.set_micro_batches(MICRO)
        with model.no_sync() if accumulate == "no_sync" else contextlib.nullcontext():
            _, counts = comm_counts(lambda: (model(micro[0]).square().mean() / MICRO).backward())
        assert counts["reduce_scatter"] == 0 and counts["all_reduce"] == tp_counts["all_reduce"]
        fired = []
        hidden = model.module[1](model.module[0](micro[1]))
        hidden.register_hook(lambda g: fired.append([b.handle is not None for b in model.buckets]))
        _, counts = comm_counts(lambda: (model.module[2](hidden).square().mean() / MICRO).backward())
        # the row layer's bucket was already reducing when backward reached its input; the norm's was not
        assert fired == [[True, False, False]]
        assert counts["reduce_scatter"] == (3 if shard else 0)
        assert counts["all_reduce"] - tp_counts["all_reduce"] == (0 if shard else 3)
        _, counts = comm_counts(opt.step)
        assert (counts["all_gather"], counts["reduce_scatter"], counts["all_reduce"]) == ((3, 0, 0) if shard
                                                                                          else (0, 0, 0))
        opt.zero_grad()
        model.finish_param_sync()
        expected = ref_states[step]
        for got, want, layer in zip(model.parameters(), expected, (None, column, column, row, row)):
            want = want if layer is None or (layer is row and want.dim() == 1) else layer.shard_dense(want)
            assert (got - want).abs().max().item() < 1e-12


@distributed(world_size=4)
def test_one_distributed_optimizer_over_several_modules():
    """A pipeline rank's model chunks: a DataParallel each (the net split after its column layer), one optimizer
    over both steps as serial AdamW, clips their global norm, and its full_state loads into other chunks."""
    mesh = tp.init_mesh(tp=2)
    _, ref_states = reference(STEPS)
    reference_net = net(solo_group())
    reference_net(batch(0, 0, 1)).square().mean().backward()
    first_norm = torch.nn.utils.get_total_norm([p.grad for p in reference_net.parameters()]).item()

    def chunked(seed):
        torch.manual_seed(seed)
        whole = net(mesh.tp_group)
        chunks = [DataParallel(whole[:2], group=mesh.dp_group, bucket_numel=10),
                  DataParallel(whole[2:], group=mesh.dp_group, bucket_numel=10)]
        return whole, chunks, DistributedOptimizer(chunks, lr=1e-2, weight_decay=0.1)

    whole, chunks, opt = chunked(0)
    inner = opt.param_groups[0]["params"]  # one AdamW over this rank's master pieces of both chunks' buckets
    assert len(opt.param_groups) == 1 and {id(m) for m in inner} == {id(m) for m in opt.masters.values()}
    assert all(any(p in chunk._bucket_of for p in opt.masters) for chunk in chunks)
    column, row = whole[1], whole[2]
    for step in range(STEPS):
        chunks[1](chunks[0](batch(step, mesh.dp_rank, mesh.dp_size))).square().mean().backward()
        norm = clip_grad_norm_([p for chunk in chunks for p in chunk.parameters()], 0, mesh=mesh)
        if step == 0:
            assert abs(norm.item() - first_norm) <= 1e-6 * first_norm  # (the norm comes back in fp32)
        opt.step()
        opt.zero_grad()
        for chunk in chunks:
            chunk.finish_param_sync()
        for got, want, layer in zip(whole.parameters(), ref_states[step], (None, column, column, row, row)):
            want = want if layer is None or (layer is row and want.dim() == 1) else layer.shard_dense(want)
            assert (got - want).abs().max().item() < 1e-12
    state = opt.full_state()  # every parameter of both chunks, with AdamW's state
    other, other_chunks, other_opt = chunked(1)
    for mine, theirs in zip(whole.parameters(), other.parameters()):
        other_opt.load_full_state(theirs, state[mine])
    for _model, parts, optimizer in ((whole, chunks, opt), (other, other_chunks, other_opt)):
        parts[1](parts[0](batch(STEPS, mesh.dp_rank, mesh.dp_size))).square().mean().backward()
        optimizer.step()
        for part in parts:
            part.finish_param_sync()
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), other.parameters()))


@distributed(world_size=4)
def test_a_deferred_weight_gradient_is_waited_for():
    """The row weight's gradient arrives after backward (a B/W split): its bucket reduces only then."""
    mesh = tp.init_mesh(tp=2)
    _, ref_states = reference(1)
    model = DataParallel(net(mesh.tp_group, late=True), group=mesh.dp_group, bucket_numel=10)
    opt = DistributedOptimizer(model, lr=1e-2, weight_decay=0.1)
    _deferred.clear()
    model(batch(0, mesh.dp_rank, mesh.dp_size)).square().mean().backward()
    assert [b.handle is not None for b in model.buckets] == [False, True, True]  # row's waits for its weight
    _deferred.pop()()
    assert model.buckets[0].handle is not None
    opt.step()
    model.finish_param_sync()
    assert (model.module[2].weight - model.module[2].shard_dense(ref_states[0][3])).abs().max().item() < 1e-12


@distributed(world_size=2)
def test_a_gradient_arriving_twice_is_refused():
    tp.init_mesh()
    model = DataParallel(net(None), bucket_numel=1000)  # one bucket: the column layer twice would complete it early
    column = model.module[1]
    x = torch.ones(2, 5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"the gradient of 1.weight arrived 2 times in a step of 1 micro-batches"):
        (column(x) + column(2 * x)).sum().backward()


@distributed(world_size=2)
def test_parameter_all_gathers_are_waited_for_bucket_by_bucket():
    """After a step every bucket's all-gather is in flight; a module's forward waits for its own bucket only, and a
    parameter read outside its module's forward (a learned position table) is waited for when the model starts."""
    mesh = tp.init_mesh()
    model = DataParallel(net(None), bucket_numel=10)
    opt = DistributedOptimizer(model, lr=1e-2)
    x = batch(0, mesh.dp_rank, mesh.dp_size)
    model(x).square().mean().backward()
    opt.step()
    assert [b.gather is not None for b in model.buckets] == [True, True, True]
    model.module[0](x)  # the norm (first in forward order, last bucket)
    assert [b.gather is not None for b in model.buckets] == [True, True, False]
    model(x)
    assert [b.gather is not None for b in model.buckets] == [False, False, False]
    torch.manual_seed(0)
    gpt = DataParallel(models.GPT(GPT), bucket_numel=300)
    x, y, _, _ = gpt_batch(mesh)
    gpt(x, y)  # the first forward finds the modules whose own forward reads their parameters
    position_bucket = gpt._bucket_of[gpt.module.position_embedding.weight]
    assert gpt._eager == [position_bucket]


@distributed(world_size=4)
def test_masters_not_bf16_copies_are_updated_and_bytes_per_parameter():
    mesh = tp.init_mesh()
    d = mesh.dp_size
    table = {("fp32", False): 16, ("fp32", True): 8 + 8 / d, ("bf16", False): 18, ("bf16", True): 6 + 12 / d}
    for (precision, shard), per_param in table.items():
        torch.manual_seed(0)
        dense = nn.Linear(16, 16)  # 272 parameters: one bucket, divisible by dp (no padding)
        with torch.no_grad():  # 0.25 ± 1e-6 rounds to 0.25 in bf16 (whose spacing there is 2^-9)
            dense.weight.fill_(0.25)
        initial = [p.detach().clone() for p in dense.parameters()]
        model = DataParallel(dense, shard=shard, param_dtype=torch.bfloat16 if precision == "bf16" else None)
        opt = DistributedOptimizer(model, lr=1e-6)  # an update far below bf16's resolution
        model(torch.randn(4, 16).to(model.param_dtype)).float().square().mean().backward()
        opt.step()
        model.finish_param_sync()
        masters = opt.full_state()
        for p, init in zip(dense.parameters(), initial):
            master = masters[p]["param"]
            assert master.dtype == torch.float32 and p.dtype == model.param_dtype
            moved = (master - init).abs()
            assert moved.min().item() > 0.9e-6 and moved.max().item() < 1.1e-6  # Adam's first step: ~lr each
            assert torch.equal(p, master.to(p.dtype))  # the parameters are the masters (rounded to bf16)
            if precision == "bf16":
                assert torch.equal(p, init.to(torch.bfloat16))  # ...which did not move in bf16
        got = memory_bytes(model, opt)
        steps = sum(1 for s in opt.state.values() if "step" in s) * 4  # AdamW's scalar step per tensor
        assert sum(got.values()) - steps == per_param * 272, (precision, shard, got)
    ddp = torch.nn.parallel.DistributedDataParallel(nn.Linear(16, 16), process_group=mesh.dp_group)
    adam = torch.optim.AdamW(ddp.parameters())
    ddp(torch.randn(4, 16)).sum().backward()
    adam.step()
    assert sum(memory_bytes(ddp, adam).values()) - 2 * 4 == 16 * 272  # torch DDP + AdamW: 16 bytes per parameter


@distributed(world_size=2)
def test_module_zero_grad_empties_the_gradient_buffers():
    """torch's idiom model.zero_grad() between steps: main_grad is the gradient here, so it is what gets zeroed (else
    the next step adds this step's reduced gradient to its own)."""
    mesh = tp.init_mesh()
    model = DataParallel(net(None), bucket_numel=10)
    opt = DistributedOptimizer(model, lr=1e-2)
    model(batch(0, mesh.dp_rank, mesh.dp_size)).square().mean().backward()
    opt.step()
    model.zero_grad()
    assert not any(p.main_grad.any() for p in model.parameters()) and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("shard", [True, False])
@distributed(world_size=2)
def test_replicas_start_from_the_first_ranks_parameters(shard):
    """As torch DDP does at construction: ranks that built different weights (no common seed) train one model, the
    first rank's, masters included (bf16 parameters), instead of dp models drifting apart or mixed shard by shard."""
    mesh = tp.init_mesh()
    torch.manual_seed(mesh.rank)
    dense = nn.Linear(5, 3)
    first = [p.detach().clone() for p in dense.parameters()]
    for t in first:
        dist.broadcast(t, src=0)
    model = DataParallel(dense, shard=shard, param_dtype=torch.bfloat16)
    opt = DistributedOptimizer(model, lr=0.0)
    masters = opt.full_state()
    for p, want in zip(dense.parameters(), first):
        assert torch.equal(masters[p]["param"], want) and torch.equal(p, want.bfloat16())


@pytest.mark.parametrize("shard", [True, False])
@distributed(world_size=2)
def test_load_state_dict_sets_the_masters(shard):
    """bf16 parameters with fp32 masters: weights loaded after wrapping (model.load_state_dict, or the wrapped
    module's) are what the optimizer steps from, in fp32, not lost at the next step's copy from the old masters."""
    tp.init_mesh()
    torch.manual_seed(0)
    model = DataParallel(nn.Linear(5, 3), shard=shard, param_dtype=torch.bfloat16)
    opt = DistributedOptimizer(model, lr=0.0)
    for load, prefix in ((model.load_state_dict, "module."), (model.module.load_state_dict, "")):
        loaded = {name: torch.randn(p.shape) for name, p in model.module.named_parameters()}
        load({prefix + name: t for name, t in loaded.items()})
        model(torch.randn(2, 5).bfloat16()).float().sum().backward()
        opt.step()
        opt.zero_grad()
        model.finish_param_sync()
        masters = opt.full_state()
        for name, p in model.module.named_parameters():
            assert torch.equal(masters[p]["param"], loaded[name]) and torch.equal(p, loaded[name].bfloat16()), name


@distributed(world_size=2)
def test_floating_inputs_are_cast_to_param_dtype():
    """README's recipe, a model built in fp32 wrapped with param_dtype=bf16 and called on its usual fp32 inputs: they
    are cast to bf16 as Megatron's Float16Module and FSDP2's MixedPrecisionPolicy cast them; integer ids are not."""
    mesh = tp.init_mesh()
    model = DataParallel(net(None, dtype=torch.float32), param_dtype=torch.bfloat16)
    x = batch(0, mesh.dp_rank, mesh.dp_size).float().requires_grad_()
    y = model(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, model(x.detach().bfloat16()))
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    embedding = DataParallel(nn.Embedding(10, 4), param_dtype=torch.bfloat16)
    assert embedding(torch.tensor([1, 2])).dtype == torch.bfloat16



@distributed(world_size=2)
def test_frozen_parameters_stay_out_and_follow_param_dtype():
    """A frozen parameter (requires_grad=False) is not the optimizer's: DistributedOptimizer(model) takes the trainable
    ones, and under param_dtype=bf16 the frozen one is cast too (the forward runs in one dtype), never stepped."""
    tp.init_mesh()
    module = net(None, dtype=torch.float32)
    module[0].weight.requires_grad_(False)
    frozen = module[0].weight.detach().clone()
    model = DataParallel(module, param_dtype=torch.bfloat16)
    opt = DistributedOptimizer(model, lr=0.1)
    model(batch(0, 0, 1).float()).float().sum().backward()
    opt.step()
    assert module[0].weight.dtype == torch.bfloat16 and torch.equal(module[0].weight, frozen.bfloat16())
    with pytest.raises(ValueError, match=r"param_dtype=torch.float16 .*loss scaling"):
        DataParallel(net(None, dtype=torch.float32), param_dtype=torch.float16)



@pytest.mark.parametrize("param_dtype,model_first", [(None, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@distributed(world_size=2)
def test_torch_lr_schedulers_and_state_dicts_drive_it_as_any_torch_optimizer(param_dtype, model_first):
    """A torch.optim.Optimizer to torch: LR schedulers step its param_groups' lr; state_dict() / load_state_dict()
    (this rank's shard, for the same layout; full_state() reshards) resume it bit for bit, with the module's
    state_dict() taken right after a step (its parameters' all-gathers still in flight: waited for first). bf16
    parameters: the optimizer's state dict holds the fp32 masters (the bf16 weights alone lose their low bits),
    whichever of the module and the optimizer loads first."""
    mesh = tp.init_mesh()

    def run(steps, state=None):
        model = DataParallel(net(None, dtype=torch.float64 if param_dtype is None else torch.float32), bucket_numel=10,
                             param_dtype=param_dtype)
        opt = DistributedOptimizer(model, lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
        if state is not None:
            if model_first:
                model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            scheduler.load_state_dict(state["scheduler"])
            if not model_first:
                model.load_state_dict(state["model"])
        for step in steps:
            x = batch(step, mesh.dp_rank, mesh.dp_size)
            model(x if param_dtype is None else x.float()).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            scheduler.step()
        return model, opt, scheduler

    model, opt, scheduler = run(range(2))
    assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)
    assert any(b.gather is not None for b in model.buckets)  # the last step's all-gathers in flight
    state = {"opt": opt.state_dict(), "scheduler": scheduler.state_dict(), "model": model.state_dict()}
    assert all(b.gather is None for b in model.buckets)  # waited for: the state dict holds the updated values
    straight, straight_opt, _ = run(range(3))
    resumed, resumed_opt, _ = run(range(2, 3), state)
    for m in (straight, resumed):  # a step's all-gathers are waited for by the next forward (or a state_dict)
        m.finish_param_sync()
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))
    masters = [opt.full_state() for opt in (straight_opt, resumed_opt)]
    assert all(torch.equal(a["param"], b["param"]) for a, b in zip(*(m.values() for m in masters)))



@distributed(world_size=2)
def test_debug_mode_names_buckets_reduced_in_different_orders():
    """A parameter used on some dp ranks only starts its bucket at finish_grad_sync there, after the others: the
    reductions pair up wrongly across ranks. Debug mode compares the order before any bucket's reduction starts and
    raises, naming the ranks (buckets of other sizes paired up abort gloo: the check came after they were launched)."""
    mesh = tp.init_mesh()
    model = DataParallel(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), bucket_numel=1)  # a bucket per tensor
    first, second = model.module
    x = torch.ones(2, 3)
    with tp.set_debug(True):
        out = second(first(x)) if mesh.dp_rank == 0 else first(x)  # rank 1 skips the layer backward reaches first
        out.sum().backward()
        with pytest.raises(ValueError, match=r"tp debug: the order DataParallel reduced its buckets in .* differs "
                                             r"across the dp group: ranks \[0\] vs ranks \[1\]"):
            model.finish_grad_sync()


# ---- clip_grad_norm_ -----------------------------------------------------------------------------------------------

# kv heads 1 < tp 2 (replicated rows), row biases, learned positions (read outside their module), tied embeddings
GPT = models.GPTConfig(vocab_size=50, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=1, ffn_hidden_size=24,
                       max_seq_len=8, bias=True, position="learned", tie_embeddings=True, activation="gelu",
                       norm="layernorm", make_vocab_size_divisible_by=1)


def gpt_batch(mesh):
    g = rng(3)
    x, y = (torch.randint(0, GPT.vocab_size, (4, 8), generator=g) for _ in range(2))
    return x.chunk(mesh.dp_size)[mesh.dp_rank], y.chunk(mesh.dp_size)[mesh.dp_rank], x, y


def forward_backward(module, mesh, x, y):
    if mesh.pp_size == 1:
        return module(x, y).backward()
    if mesh.is_first_stage:
        hidden = module(x)
        tp.collectives.isend(hidden.detach(), mesh.next_stage_rank).wait()
        grad = torch.empty_like(hidden)
        tp.collectives.irecv(grad, mesh.next_stage_rank).wait()
        return hidden.backward(grad)
    hidden = torch.empty(8, len(x), GPT.hidden_size)
    tp.collectives.irecv(hidden, mesh.prev_stage_rank).wait()
    module(hidden=hidden.requires_grad_(), targets=y).backward()
    tp.collectives.isend(hidden.grad, mesh.prev_stage_rank).wait()


# FSDP2 keeps the parameters on its DeviceMesh's device: the CPU over gloo, where TP_TEST_DEVICE=cuda's ranks share a
# GPU with their tensors on it (H200 run 4: an embedding on the CPU given CUDA ids); nccl mode runs it.
FSDP2_ON_THE_TEST_DEVICE = pytest.mark.skipif(tp.testing.device_mode() == "cuda", reason="FSDP2 over gloo shards on "
                                              "the CPU: TP_TEST_DEVICE=nccl runs it on GPUs")


@pytest.mark.parametrize("split,wrap", [(dict(tp=2, pp=2), None), (dict(tp=2), "ddp"), (dict(tp=2), "zero1"),
                                        pytest.param(dict(tp=2), "fsdp2", marks=FSDP2_ON_THE_TEST_DEVICE),
                                        (dict(pp=2), "zero1"), (dict(cp=2), "zero1")])
@distributed(world_size=4)
def test_clip_grad_norm_is_the_serial_models_norm(split, wrap):
    mesh = tp.init_mesh(**split)
    x, y, full_x, full_y = gpt_batch(mesh)
    torch.manual_seed(0)
    solo = solo_group()
    serial = models.GPT(GPT, group=solo, cp_group=solo)
    serial(full_x, full_y).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in serial.parameters()]).item()

    torch.manual_seed(0)
    stage = models.GPT(GPT, group=mesh.tp_group, **stage_options(GPT, mesh))
    tied = None
    if mesh.pp_size > 1 and mesh.in_embedding_group:
        tied = stage.embedding.weight if mesh.is_first_stage else stage.output.weight
        if mesh.is_last_stage:
            tied.shared = True  # the first stage's embedding, held again: counted there
    module = stage
    if wrap == "zero1":
        # gradients summed over cp (each cp rank holds its tokens' share), averaged over dp
        module = DataParallel(stage, group=mesh.group("dp-cp"), average_over=mesh.dp_size, bucket_numel=300,
                              tied=[(tied, mesh.embedding_group)] if tied is not None else ())
    elif wrap == "ddp":  # gradients replicated over dp: counted on one dp rank
        module = torch.nn.parallel.DistributedDataParallel(stage, process_group=mesh.dp_group)
    elif wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        with keep_param_tags(stage):
            module = fully_shard(stage, mesh=mesh.device_mesh["dp"])
    forward_backward(module, mesh, x, y)
    if tied is not None and wrap is None:
        dist.all_reduce(tied.grad, group=mesh.embedding_group)
    norm = clip_grad_norm_(module.parameters(), expected / 2, mesh=mesh)
    assert abs(norm.item() - expected) <= 1e-5 * expected, (norm.item(), expected)
    after = clip_grad_norm_(module.parameters(), 0, mesh=mesh)  # measure only
    assert abs(after.item() - expected / 2) <= 1e-5 * expected

    grads = [g for p in module.parameters() if (g := reduced_grad(p)[0]) is not None and g.numel()]
    if mesh.rank == 0:  # one rank's inf: every rank gets a non-finite norm, and nothing is scaled
        grads[0].view(-1)[0] = math.inf
    before = [g.clone() for g in grads]
    assert not math.isfinite(clip_grad_norm_(module.parameters(), 1e-3, mesh=mesh).item())
    assert all(torch.equal(a, b) for a, b in zip(before, grads) if a.isfinite().all())


@distributed(world_size=2)
def test_bad_values_are_refused_before_any_collective():
    tp.init_mesh()
    with pytest.raises(ValueError, match=r"average_over=0 must be a number > 0"):
        DataParallel(net(None), average_over=0)
    with pytest.raises(ValueError, match=r"bucket_numel=0 must be an integer >= 1"):
        DataParallel(net(None), bucket_numel=0)
    model = DataParallel(net(None))
    with pytest.raises(ValueError, match=r"micro_batches=0 must be an integer >= 1"):
        model.set_micro_batches(0)
    with pytest.raises(ValueError, match=r"params must hold each of the module's trainable parameters once"):
        DistributedOptimizer(model, list(model.parameters())[:2])
    with pytest.raises(TypeError, match=r"needs a tp.optim.DataParallel module, got Sequential"):
        DistributedOptimizer(net(None))
    with pytest.raises(TypeError, match=r"needs a tp.optim.DataParallel module, got Sequential \(or a list of them"):
        DistributedOptimizer([model, net(None)])  # model chunks: each one wrapped
    with pytest.raises(ValueError, match=r"max_norm=-1 must be a number >= 0"):
        clip_grad_norm_(model.parameters(), -1)


# ---- the training job (models.train): zero1, bf16 and clipping end to end ------------------------------------------

JOB = ["--model", "tiny", "--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--steps", "3",
       "--seed", "7"]  # --clip-grad 1.0: Megatron's default


def _train_records(flags, log):
    from models.training.cli import parser, train

    train(parser().parse_args([*JOB, *flags, "--log-jsonl", log]))
    return None


def _records(tmp_path, name, world_size, *flags):
    import json

    from tp.testing import run

    log = str(tmp_path / f"{name}.jsonl")
    run(_train_records, world_size, flags=list(flags), log=log, timeout=300)
    with open(log) as f:
        return [json.loads(line) for line in f]


def test_zero1_bf16_and_clipping_follow_the_serial_run(tmp_path):
    serial = _records(tmp_path, "serial", 1, "--tp", "1", "--pp", "1", "--dp", "1", "--steps", "20")
    assert all(r["grad_norm"] > 1.0 for r in serial[:3])  # clipping is active in the steps compared exactly
    # (ZB-H1: the weight gradients arrive in deferred W passes; the buckets count them whatever the order)
    zero1 = _records(tmp_path, "zero1", 8, "--tp", "2", "--pp", "2", "--dp", "2", "--dp-mode", "zero1",
                     "--schedule", "zb")
    for ours, reference in zip(zero1, serial[:3], strict=True):
        for key in ("loss", "grad_norm"):  # the same loss as one process (and DDP), the same global norm
            assert abs(ours[key] - reference[key]) <= 1e-5 * reference[key], (key, ours[key], reference[key])
    bf16 = _records(tmp_path, "bf16", 8, "--tp", "2", "--pp", "2", "--dp", "2", "--dp-mode", "zero1",
                    "--precision", "bf16", "--steps", "20")
    gap = [abs(b["loss"] - f["loss"]) / f["loss"] for b, f in zip(bf16, serial, strict=True)]
    assert 0 < max(gap) < 0.03, gap  # bf16 compute (not the fp32 curve itself), within a few percent of it
    assert bf16[-1]["loss"] < serial[0]["loss"] - 1.5
    # per rank: bf16 parameters, fp32 gradients, masters + AdamW's moments over dp = 2 (REFERENCE §11: 6 + 12/d)
    assert 2 * bf16[0]["param_bytes"] == zero1[0]["param_bytes"] and bf16[0]["grad_bytes"] == zero1[0]["grad_bytes"]
    assert abs(bf16[0]["optimizer_bytes"] / zero1[0]["optimizer_bytes"] - 12 / 8) < 0.01


def test_a_non_finite_gradient_skips_the_step(tmp_path):
    import json

    records = _records(tmp_path, "nan", 8, "--tp", "2", "--pp", "2", "--dp", "2", "--dp-mode", "zero1",
                       "--nan-grad-at-step", "2", "--fail-rank", "5")  # one rank's NaN: every rank skips
    assert [r["grad_norm"] is None for r in records] == [False, True, False]  # strict JSON: null, not NaN
    assert [r.get("skipped", False) for r in records] == [False, True, False]
    assert all(math.isfinite(r["loss"]) for r in records) and records[2]["loss"] < records[0]["loss"]
    with open(tmp_path / "nan.jsonl") as f:  # readers that reject NaN/Infinity (JSON has none) read every row
        [json.loads(line, parse_constant=lambda name: pytest.fail(f"non-JSON constant {name}")) for line in f]


@pytest.mark.parametrize("flags,message", [
    (["--clip-grad", "-1"], r"--clip-grad=-1.0 must be a finite number >= 0 \(0: no clipping\)"),
    (["--clip-grad", "nan"], r"--clip-grad=nan must be a finite number >= 0"),
    (["--precision", "fp16"],
     r"--precision=fp16 is not supported: fp32, tf32 or bf16 \(fp16 would need loss scaling\)"),
])
def test_bad_training_flags_are_refused_naming_them(flags, message):
    from models.training.cli import parser, validate

    with pytest.raises(ValueError, match=message):
        validate(parser().parse_args(flags))


def test_bench_train_reports_bytes_per_parameter_as_the_table(tmp_path):
    import json

    from bench import train as bench_train

    out = tmp_path / "train.json"
    bench_train.main(["--skip", "bubble", "--splits", "1x1x2", "--dp-mode", "ddp", "zero1", "--precision", "fp32",
                      "bf16", "--steps", "2", "--global-batch-size", "4", "--seq-len", "16", "--out", str(out)])
    rows = json.loads(out.read_text())["throughput"]
    assert [(r["dp_mode"], r["precision"]) for r in rows] == [("ddp", "fp32"), ("ddp", "bf16"), ("zero1", "fp32"),
                                                              ("zero1", "bf16")]
    for row in rows:  # 16, 18, 8 + 8/2, 6 + 12/2 (+ AdamW's step counters; no bucket padding at this size)
        assert row["table_bytes_per_param"] == {"ddp": {"fp32": 16, "bf16": 18},
                                                "zero1": {"fp32": 12, "bf16": 12}}[row["dp_mode"]][row["precision"]]
        assert 0 <= row["bytes_per_param"] - row["table_bytes_per_param"] < 0.01, row


def test_interleaved_chunks_compose_with_zero1_bf16_and_export(tmp_path):
    """--schedule interleaved --virtual-stages 2 at 2x2x2 (a DataParallel per model chunk, one DistributedOptimizer
    over them): zero1 trains the 1x1x1 curve with its grad_norm, logs bench.plan.memory's bytes, and its --export-hf
    (a file per virtual stage) gives its val_loss in transformers; bf16 (ddp: the all-reduce form) follows the curve
    and its checkpoint (the chunks' fp32 masters) resumes at pp=2 with one chunk per rank, FSDP2, fp32."""
    import transformers

    from bench.plan import memory
    from models import config as model_config
    from models.training import data

    interleaved = ["--tp", "2", "--pp", "2", "--dp", "2", "--schedule", "interleaved", "--virtual-stages", "2"]
    serial = _records(tmp_path, "serial", 1, "--tp", "1", "--pp", "1", "--dp", "1")
    exported = tmp_path / "hf"
    zero1 = _records(tmp_path, "zero1", 8, *interleaved, "--dp-mode", "zero1", "--export-hf", str(exported),
                     "--eval-every", "3", "--eval-iters", "1")
    for ours, reference in zip(zero1, serial, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(ours[key] - reference[key]) <= 1e-5 * reference[key], (key, ours[key], reference[key])
    cfg = models.GPTConfig(**(model_config.PRESETS["tiny"] | {"max_seq_len": 256}))
    stages = [memory.parameter_memory(cfg, tp=2, pp=2, stage=s, virtual_stages=2, dp_mode="zero1", precision="fp32",
                                      shards=2) for s in range(2)]
    assert [zero1[0][k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")] == \
        [max(stage[i] for stage in stages) for i in range(3)]

    assert len(list(exported.glob("model-*-of-00004.safetensors"))) == 4  # pp x V files, with an index
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    _, held_out = data.split(data.corpus(), 32)
    (x, y), = data.eval_batches(held_out, dp=1, dp_rank=0, global_batch_size=8, micro_batch_size=8, iters=1)[0]
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    assert abs(loss - zero1[-1]["val_loss"]) <= 1e-5 * loss, (loss, zero1[-1]["val_loss"])

    ckpt = tmp_path / "ckpt"
    bf16 = _records(tmp_path, "bf16", 8, *interleaved, "--precision", "bf16", "--save", str(ckpt), "--save-every", "2")
    gap = [abs(b["loss"] - f["loss"]) / f["loss"] for b, f in zip(bf16, serial, strict=True)]
    assert 0 < max(gap) < 0.01, gap
    resumed = _records(tmp_path, "resumed", 8, "--tp", "2", "--pp", "2", "--dp", "2", "--dp-mode", "fsdp",
                       "--load", str(ckpt / "step-000002"))
    assert [r["step"] for r in resumed] == [3]
    assert abs(resumed[0]["loss"] - serial[2]["loss"]) <= 1e-3 * serial[2]["loss"], (resumed, serial[2])
