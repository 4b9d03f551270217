"""Column/Row parallel linear layers and their compositions against the dense nn.Linear model, at TP = 1, 2, 4 (8).

Every rank builds the dense model from one seed, shards it with `from_linear`, and compares output, input gradient
and every weight/bias gradient with the dense run (fp32, max abs err <= 1e-5), plus the exact collective counts.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels
import tp
from tp.testing import distributed

from .helpers import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, assert_close, comm_counts, randn

S, B = 3, 3  # per-rank sequence chunk (SP) / batch: odd
HIDDEN, FFN = 12, 20  # at tp=4: 3 and 5 per rank
ATOL = 1e-5


def slice_of(t, dim, rank, parts, stride=1):
    """This rank's slice of a dense tensor, stride parts sharded separately (independent of the layers' code)."""
    return torch.cat([part.chunk(parts, dim)[rank] for part in t.chunk(stride, dim)], dim)


def dense_linear(in_f, out_f, bias, seed):
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f, bias=bias)


def expected_grads(layer, dense, rank, parts):
    """Pairs (local grad, expected slice of the dense grad) for a parallel layer."""
    dim, stride = layer.shard_dim, layer.stride
    pairs = [(layer.weight.grad, slice_of(dense.weight.grad, dim, rank, parts, stride), "weight grad")]
    if layer.bias is not None:
        db = dense.bias.grad if dim == 1 else slice_of(dense.bias.grad, 0, rank, parts, stride)
        pairs.append((layer.bias.grad, db, "bias grad"))
    return pairs


def run_both(mesh, parallel, dense, x_full, in_shard, out_shard, *, seq_len):
    """Forward+backward both models; check output and input grad; return the collective counts (fwd, bwd)."""
    p, r = mesh.tp_size, mesh.tp_rank
    x_full = x_full.requires_grad_()
    y_full = dense(x_full)
    g_full = randn(*y_full.shape, seed=11 + mesh.dp_rank, dtype=torch.float32)
    y_full.backward(g_full)
    x = in_shard(x_full.detach(), r, p).clone().requires_grad_()
    y, fwd = comm_counts(lambda: parallel(x))
    assert_close(y, out_shard(y_full.detach(), r, p), ATOL, "output")
    _, bwd = comm_counts(lambda: y.backward(out_shard(g_full, r, p)))
    assert_close(x.grad, in_shard(x_full.grad, r, p), ATOL, "input grad")
    assert seq_len == x_full.shape[0]
    return fwd, bwd


full = lambda t, r, p: t  # noqa: E731
last = lambda t, r, p: t.chunk(p, -1)[r]  # noqa: E731
seq = lambda t, r, p: t.chunk(p, 0)[r]  # noqa: E731


def _x(mesh, in_f):
    return randn(S * mesh.tp_size, B, in_f, seed=5 + mesh.dp_rank, dtype=torch.float32)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("gather_output,sequence_parallel", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("tp_size", [1, 2, 4])
@distributed(world_size=4)
def test_column_parallel_linear(tp_size, gather_output, sequence_parallel, bias):
    mesh = tp.init_mesh(tp=tp_size)
    dense = dense_linear(7, FFN, bias, seed=1)
    layer = tp.ColumnParallelLinear.from_linear(dense, gather_output=gather_output, sequence_parallel=sequence_parallel)
    x = _x(mesh, 7)
    fwd, bwd = run_both(mesh, layer, dense, x, seq if sequence_parallel else full, full if gather_output else last,
                        seq_len=x.shape[0])
    for local, expected, what in expected_grads(layer, dense, mesh.tp_rank, tp_size):
        assert_close(local, expected, ATOL, what)
    if tp_size > 1:
        expect_fwd = {ALL_GATHER: int(sequence_parallel) + int(gather_output)}
        expect_bwd = {REDUCE_SCATTER: 1, ALL_GATHER: 1} if sequence_parallel else {ALL_REDUCE: 1}
        assert fwd["total"] == sum(expect_fwd.values()) and bwd["total"] == sum(expect_bwd.values()), (fwd, bwd)
    else:
        assert fwd["total"] == bwd["total"] == 0


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("input_is_parallel,sequence_parallel,grad_sync", [
    (True, False, True), (False, False, True), (True, True, True), (True, True, False)])
@pytest.mark.parametrize("tp_size", [1, 2, 4])
@distributed(world_size=4)
def test_row_parallel_linear(tp_size, input_is_parallel, sequence_parallel, grad_sync, bias):
    mesh = tp.init_mesh(tp=tp_size)
    dense = dense_linear(FFN, 7, bias, seed=2)
    layer = tp.RowParallelLinear.from_linear(dense, input_is_parallel=input_is_parallel,
                                             sequence_parallel=sequence_parallel, sequence_parallel_grad_sync=grad_sync)
    x = _x(mesh, FFN)
    fwd, bwd = run_both(mesh, layer, dense, x, last if input_is_parallel else full, seq if sequence_parallel else full,
                        seq_len=x.shape[0])
    manual = sequence_parallel and not grad_sync  # SP bias grads stay partial until summed by hand
    assert getattr(layer.bias, "sequence_parallel", False) == (manual and bias)
    if manual and bias:
        tp.allreduce_sequence_parallel_grads(layer)
    for local, expected, what in expected_grads(layer, dense, mesh.tp_rank, tp_size):
        assert_close(local, expected, ATOL, what)
    if tp_size > 1:
        assert fwd["total"] == 1 and fwd[REDUCE_SCATTER if sequence_parallel else ALL_REDUCE] == 1, fwd
        synced_bias = sequence_parallel and grad_sync and bias  # one all-reduce of the bias grad inside backward
        assert bwd == {ALL_REDUCE: int(synced_bias), ALL_GATHER: int(sequence_parallel) + int(not input_is_parallel),
                       REDUCE_SCATTER: 0, "total": int(synced_bias) + int(sequence_parallel) +
                       int(not input_is_parallel)}, bwd


class DenseMLP(nn.Module):
    def __init__(self, activation, seed, ffn=FFN):
        super().__init__()
        torch.manual_seed(seed)
        self.activation = activation
        self.fc1 = nn.Linear(HIDDEN, 2 * ffn if activation == "swiglu" else ffn)
        self.fc2 = nn.Linear(ffn, HIDDEN)

    def forward(self, x):
        h = self.fc1(x)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, -1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(h))


class ParallelMLP(nn.Module):
    """Column -> activation -> Row; the activation fused into the column layer when `fused`."""

    def __init__(self, dense, *, sequence_parallel, fused):
        super().__init__()
        act = dense.activation if fused or dense.activation == "swiglu" else None
        self.unfused_gelu = act is None
        self.fc1 = tp.ColumnParallelLinear.from_linear(dense.fc1, sequence_parallel=sequence_parallel, activation=act)
        self.fc2 = tp.RowParallelLinear.from_linear(dense.fc2, sequence_parallel=sequence_parallel)

    def forward(self, x):  # [s(/tp), b, h]
        h = self.fc1(x)  # [s, b, ffn/tp]
        return self.fc2(F.gelu(h) if self.unfused_gelu else h)  # [s(/tp), b, h]


def check_mlp(mesh, *, sequence_parallel, activation="gelu", fused=False, ffn=FFN):
    p, r = mesh.tp_size, mesh.tp_rank
    dense = DenseMLP(activation, seed=3, ffn=ffn)
    model = ParallelMLP(dense, sequence_parallel=sequence_parallel, fused=fused)
    x = _x(mesh, HIDDEN)
    shard = seq if sequence_parallel else full
    fwd, bwd = run_both(mesh, model, dense, x, shard, shard, seq_len=x.shape[0])
    for layer, dense_layer in ((model.fc1, dense.fc1), (model.fc2, dense.fc2)):
        for local, expected, what in expected_grads(layer, dense_layer, r, p):
            assert_close(local, expected, ATOL, what)
    if p == 1:
        assert fwd["total"] == bwd["total"] == 0
    elif sequence_parallel:  # Megatron: 1 all-gather + 1 reduce-scatter each way, plus the input re-gather,
        # plus the fc2 bias grad summed over tp inside backward
        assert (fwd[ALL_GATHER], fwd[REDUCE_SCATTER], fwd["total"]) == (1, 1, 2), fwd
        assert (bwd[ALL_GATHER], bwd[REDUCE_SCATTER], bwd[ALL_REDUCE], bwd["total"]) == (2, 1, 1, 4), bwd
    else:  # one all-reduce forward, one backward
        assert (fwd[ALL_REDUCE], fwd["total"], bwd[ALL_REDUCE], bwd["total"]) == (1, 1, 1, 1), (fwd, bwd)


@pytest.mark.parametrize("activation,fused", [("gelu", False), ("gelu", True), ("swiglu", True)])
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp_size", [1, 2, 4])
@distributed(world_size=4)
def test_mlp_matches_dense(tp_size, sequence_parallel, activation, fused):
    check_mlp(tp.init_mesh(tp=tp_size), sequence_parallel=sequence_parallel, activation=activation, fused=fused)


@pytest.mark.parametrize("sequence_parallel", [False, True])
@distributed(world_size=8)
def test_mlp_matches_dense_tp8(sequence_parallel):
    check_mlp(tp.init_mesh(tp=8, dp=1), sequence_parallel=sequence_parallel, ffn=24)  # 3 per rank


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@distributed(world_size=4)
def test_init_is_tp_invariant(tp_size):
    mesh = tp.init_mesh(tp=tp_size)
    r = mesh.tp_rank
    for cls, dim, stride in ((tp.ColumnParallelLinear, 0, 1), (tp.ColumnParallelLinear, 0, 2),
                             (tp.RowParallelLinear, 1, 1)):
        torch.manual_seed(42)
        layer = cls(HIDDEN, 2 * FFN, stride=stride)
        torch.manual_seed(42)
        dense = nn.Linear(HIDDEN, 2 * FFN, device="cpu")  # the serial init the TP=1 layer gets (masters are on CPU)
        assert torch.equal(layer.weight.cpu(), slice_of(dense.weight, dim, r, tp_size, stride))
        expected_bias = slice_of(dense.bias, 0, r, tp_size, stride) if dim == 0 else dense.bias
        assert torch.equal(layer.bias.cpu(), expected_bias)
    torch.manual_seed(0)
    custom = tp.ColumnParallelLinear(HIDDEN, FFN, init_method=lambda w: nn.init.normal_(w, std=0.02))
    torch.manual_seed(0)
    expected = nn.init.normal_(torch.empty(FFN, HIDDEN, device="cpu"), std=0.02).chunk(tp_size, 0)[r]
    assert torch.equal(custom.weight.cpu(), expected)
    assert torch.count_nonzero(custom.bias) == 0  # Megatron zeroes biases under a custom init


@pytest.mark.parametrize("tp_size", [1, 2])
@distributed(world_size=2)
def test_main_grad_accumulates_in_fp32(tp_size):
    mesh = tp.init_mesh(tp=tp_size)
    dense = DenseMLP("gelu", seed=4)
    model = ParallelMLP(dense, sequence_parallel=False, fused=True)
    for layer in (model.fc1, model.fc2):
        layer.weight.main_grad = torch.zeros_like(layer.weight, dtype=torch.float32)
    expected = {}
    for step in range(2):  # two micro-batches accumulate
        x = randn(S, B, HIDDEN, seed=20 + step, dtype=torch.float32)
        model(x).square().sum().backward()
        dense(x).square().sum().backward()
    for layer, dense_layer in ((model.fc1, dense.fc1), (model.fc2, dense.fc2)):
        assert layer.weight.grad is None  # no low-precision weight grad next to main_grad
        expected = slice_of(dense_layer.weight.grad, layer.shard_dim, mesh.tp_rank, tp_size)
        assert_close(layer.weight.main_grad, expected, 1e-4, "main_grad")


@distributed(world_size=2)
def test_from_linear_keeps_dtype_and_repr_shows_sharding():
    tp.init_mesh(tp=2)
    dense = nn.Linear(6, 10, dtype=torch.float64)
    col = tp.ColumnParallelLinear.from_linear(dense, gather_output=True)
    row = tp.RowParallelLinear.from_linear(dense)
    assert col.weight.dtype == torch.float64 and col.weight.shape == (5, 6) and col.bias.shape == (5,)
    assert row.weight.shape == (10, 3) and row.bias.shape == (10,)
    assert "tp=2, shard=dim0 (local weight 5x6)" in repr(col) and "gather_output=True" in repr(col)
    assert "shard=dim1 (local weight 10x3)" in repr(row) and "input_is_parallel=True" in repr(row)
    x = torch.randn(3, 6, dtype=torch.float64)
    assert_close(col(x), dense(x), 1e-12, "float64 column output")  # drops into nn.Linear code: [..., h] works
    as_fp32 = tp.ColumnParallelLinear.from_linear(dense, dtype=torch.float32)  # options override the linear's
    assert as_fp32.weight.dtype == torch.float32
    assert torch.equal(as_fp32.weight, dense.weight.float().chunk(2)[tp.get_mesh().tp_rank])


@distributed(world_size=2)
def test_a_second_derivative_through_the_layers_raises_rather_than_missing_terms():
    """docs/layers.md: backward is first-order. A gradient penalty (create_graph=True) whose first backward meets
    gradients that need none (y.sum()'s ones) still reads the weights: its result must refuse a second backward,
    not drop the weights' terms silently (the column layer at tp 2, gathered or not; the fused linear, main_grad)."""
    tp.init_mesh(tp=2)
    torch.manual_seed(0)
    dense = nn.Linear(8, 6, dtype=torch.float64)
    x = torch.randn(5, 8, dtype=torch.float64)
    fused = nn.Linear(8, 6, dtype=torch.float64)
    fused.weight.main_grad = torch.zeros_like(fused.weight)
    first_order = r"^_\w+Backward is first-order: a second derivative through it \(create_graph=True"
    for layer in (tp.ColumnParallelLinear.from_linear(dense, gather_output=True),
                  tp.ColumnParallelLinear.from_linear(dense, gather_output=False),
                  lambda t: kernels.linear(t, fused.weight, fused.bias)):
        xi = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(layer(xi).sum(), xi, create_graph=True)  # (= ones @ W: depends on W)
        assert g.requires_grad
        with pytest.raises(RuntimeError, match=first_order):
            g.square().sum().backward()
        weight = fused.weight if not isinstance(layer, nn.Module) else layer.weight
        with pytest.raises(RuntimeError, match=first_order):  # (was: "appears to not have been used in the graph")
            torch.autograd.grad(g.square().sum(), weight)
    # a collective's backward is linear in the incoming gradient and reads no weight: where that gradient needs none
    # (the layer's output side), a second derivative past it stays exact, as torch's rule has it: a row layer by
    # hand, F.linear on this rank's input columns, then the all-reduce (its backward: the identity)
    rank = tp.get_mesh().tp_rank
    weight = dense.weight.detach().chunk(2, 1)[rank].clone().requires_grad_()
    xi = x.chunk(2, 1)[rank].clone().requires_grad_()
    (g,) = torch.autograd.grad(tp.reduce_from_tp_region(F.linear(xi, weight)).sum(), xi, create_graph=True)
    g.square().sum().backward()
    W, xd = dense.weight.detach().clone().requires_grad_(), x.clone().requires_grad_()
    (g_dense,) = torch.autograd.grad(F.linear(xd, W).sum(), xd, create_graph=True)
    g_dense.square().sum().backward()
    torch.testing.assert_close(weight.grad, W.grad.chunk(2, 1)[rank])


@distributed(world_size=4)
def test_a_group_this_rank_is_not_in_is_one_line():
    """A layer (or mapping) given a group its rank is not a member of: one line naming the rank (was a
    negative-dimension error from the rank's world size of -1); the members build theirs."""
    import torch.distributed as dist

    group = dist.new_group([2, 3])
    if dist.get_rank() in (2, 3):
        assert tp.ColumnParallelLinear(8, 16, group=group).weight.shape == (8, 8)
        return
    with pytest.raises(ValueError, match=rf"^rank {dist.get_rank()} is not a member of the process group it was "
                                         r"given \(build the layer on the group's ranks"):
        tp.ColumnParallelLinear(8, 16, group=group)
    with pytest.raises(ValueError, match="is not a member"):
        tp.copy_to_tp_region(torch.ones(2), group)


@distributed(world_size=2)
def test_bad_layer_arguments_raise_on_every_rank():
    tp.init_mesh(tp=2)
    with pytest.raises(ValueError, match="out_features = 7 is not divisible across 2 ranks"):
        tp.ColumnParallelLinear(4, 7)
    with pytest.raises(ValueError, match="in_features = 5 is not divisible across 2 ranks"):
        tp.RowParallelLinear(5, 4)
    with pytest.raises(ValueError, match=r"parts \(3, 3\) of out_features = 6 is not divisible across 2 ranks"):
        tp.ColumnParallelLinear(4, 6, stride=2)
    with pytest.raises(ValueError, match=r"parts=\(4, 2\) must be positive integers summing to out_features = 8"):
        tp.ColumnParallelLinear(4, 8, parts=(4, 2))
    with pytest.raises(ValueError, match=r"out_features = 8 is not divisible into stride=3 equal parts"):
        tp.ColumnParallelLinear(4, 8, stride=3)
    with pytest.raises(ValueError, match=r"stride=2 contradicts parts=\(2, 2, 4\)"):
        tp.RowParallelLinear(8, 4, stride=2, parts=(2, 2, 4))
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        tp.ColumnParallelLinear(4, 8, activation="tanh")
    with pytest.raises(ValueError, match="needs two equal fused parts"):
        tp.ColumnParallelLinear(4, 8, activation="swiglu", stride=1)
    with pytest.raises(ValueError, match=r"master weight shape \(3, 4\)"):
        tp.ColumnParallelLinear(4, 8).load_master(torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"input's last dim is 5; ColumnParallelLinear expects 4"):
        tp.ColumnParallelLinear(4, 8)(torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"input's last dim is 4; RowParallelLinear expects 2 \(in_features/tp\)"):
        tp.RowParallelLinear(4, 8)(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="input dtype torch.float64 != weight dtype torch.float32"):
        tp.ColumnParallelLinear(4, 8)(torch.zeros(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"master bias shape \(1,\) != \(8,\)"):
        tp.RowParallelLinear(4, 8).load_master(torch.zeros(8, 4), torch.zeros(1))
    with pytest.raises(ValueError, match=r"^the layer has a bias: give load_master\(weight, bias\)"):
        tp.RowParallelLinear(4, 8).load_master(torch.zeros(8, 4))  # (was: the init's bias kept silently)
    with pytest.raises(ValueError, match=r"^the layer has no bias \(bias=False\), but load_master was given one"):
        tp.ColumnParallelLinear(4, 8, bias=False).load_master(torch.zeros(8, 4), torch.zeros(8))
    with pytest.raises(ValueError, match=r"sequence_parallel ColumnParallelLinear needs \[s, b, h\].*got shape \(4,\)"):
        tp.ColumnParallelLinear(4, 8, sequence_parallel=True)(torch.zeros(4))
    layer = tp.ColumnParallelLinear(4, 8)
    layer.weight.main_grad = torch.zeros(4, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"main_grad must be an fp32/fp64 tensor of shape \(4, 4\).*bfloat16"):
        layer(torch.ones(2, 4, requires_grad=True)).sum().backward()


def test_layers_without_mesh_or_group_raise():
    with pytest.raises(RuntimeError, match="no tensor-parallel mesh"):
        tp.ColumnParallelLinear(4, 8)


@pytest.mark.parametrize("tp_size", [2])
@distributed(world_size=2)
def test_mlp_on_triton_kernels(tp_size):
    """The layers' local matmuls through the Triton kernels (interpreted on CPU), fused GELU epilogue."""
    from kernels.triton_ops import LAUNCHES

    before = dict(LAUNCHES)
    with kernels.use_backend("triton"):
        check_mlp(tp.init_mesh(tp=tp_size), sequence_parallel=True, fused=True)
    launched = {k: LAUNCHES[k] - before.get(k, 0) for k in LAUNCHES}
    # two layers: 2 forward GEMMs, 2 dgrad, 2 wgrad
    assert (launched["linear_fwd"], launched["linear_dgrad"], launched["linear_wgrad"]) == (2, 2, 2), launched


@pytest.mark.parametrize("sequence_parallel", [False, True])
@distributed(world_size=2)
def test_backward_overlaps_input_grad_collective_with_wgrad(sequence_parallel):
    """Megatron's schedule: launch the dx all-reduce (SP: reduce-scatter) async, run wgrad, then wait."""
    import torch.distributed as dist

    from tp import linear_functions, mappings

    tp.init_mesh(tp=2)
    events = []

    class Handle:
        def __init__(self, handle, name):
            self.handle, self.name = handle, name

        def wait(self):
            events.append(f"wait {self.name}")
            return self.handle.wait()

    def recording(fn, name):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            if not kwargs.get("async_op"):
                return out
            events.append(f"launch {name}")
            if isinstance(out, tuple):
                return out[0], Handle(out[1], name)
            return Handle(out, name)
        return wrapper

    wgrad = kernels.linear_wgrad
    patches = [(linear_functions.dist, "all_reduce", recording(dist.all_reduce, "all_reduce")),
               (linear_functions, "reduce_scatter_first", recording(mappings.reduce_scatter_first, "reduce_scatter")),
               (linear_functions, "gather_first", recording(mappings.gather_first, "all_gather")),
               (linear_functions.kernels, "linear_wgrad", lambda *a, **k: events.append("wgrad") or wgrad(*a, **k))]
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        layer = tp.ColumnParallelLinear(8, 6, sequence_parallel=sequence_parallel)
        x = torch.randn(4, 2, 8, requires_grad=True)
        layer(x).sum().backward()
    finally:
        for obj, name, value in originals:
            setattr(obj, name, value)
    if sequence_parallel:  # the input re-gather also overlaps dgrad
        assert events == ["launch all_gather", "wait all_gather", "launch reduce_scatter", "wgrad",
                          "wait reduce_scatter"], events
    else:
        assert events == ["launch all_reduce", "wgrad", "wait all_reduce"], events


@distributed(world_size=2)
def test_sequence_parallel_column_saves_only_its_input_shard():
    """Under SP the gathered [s, b, h] input is re-gathered in backward, never kept alive for it."""
    tp.init_mesh(tp=2)
    layer = tp.ColumnParallelLinear(8, 6, sequence_parallel=True)
    x = torch.randn(3, 2, 8, requires_grad=True)  # this rank's [s/tp, b, h]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        y = layer(x)
    assert (3, 2, 8) in saved and (6, 2, 8) not in saved and (12, 8) not in saved, saved
    y.sum().backward()
    assert x.grad.shape == (3, 2, 8)


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp_size", [1, 2])
@distributed(world_size=2)
def test_mlp_under_autocast_matches_dense(tp_size, sequence_parallel):
    """torch.autocast(bf16): the layers compute in bf16 like nn.Linear; fp32 parameters get fp32 gradients."""
    mesh = tp.init_mesh(tp=tp_size)
    dense = DenseMLP("gelu", seed=6)
    model = ParallelMLP(dense, sequence_parallel=sequence_parallel, fused=True)
    model.fc1.weight.main_grad = torch.zeros_like(model.fc1.weight)  # and main_grad still accumulates in fp32
    x_full = _x(mesh, HIDDEN)
    shard = seq if sequence_parallel else full
    x = shard(x_full, mesh.tp_rank, tp_size).clone().requires_grad_()
    x_full.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_dense = model(x), dense(x_full)
    assert y.dtype == y_dense.dtype == torch.bfloat16
    y.float().square().sum().backward()
    y_dense.float().square().sum().backward()
    if sequence_parallel:
        assert x.grad.dtype == torch.float32
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(y, shard(y_dense, mesh.tp_rank, tp_size)) < 2e-2
    assert rel(x.grad, shard(x_full.grad, mesh.tp_rank, tp_size)) < 3e-2
    assert model.fc1.weight.grad is None and model.fc1.weight.main_grad.dtype == torch.float32
    assert rel(model.fc1.weight.main_grad, slice_of(dense.fc1.weight.grad, 0, mesh.tp_rank, tp_size)) < 3e-2
    assert model.fc2.weight.grad.dtype == torch.float32
    assert rel(model.fc2.weight.grad, slice_of(dense.fc2.weight.grad, 1, mesh.tp_rank, tp_size)) < 3e-2


@pytest.mark.parametrize("tp_size", [2, 4])
@distributed(world_size=4)
def test_fused_parts_with_layer_internal_collectives_keep_the_dense_order(tp_size):
    """stride / unequal fused parts with gather_output (column) or a full input (row): dense order in and out."""
    mesh = tp.init_mesh(tp=tp_size)
    for options in (dict(stride=2), dict(stride=3), dict(parts=(8, 4, 4))):
        dense = dense_linear(7, 16 if "parts" in options else 24, True, seed=6)
        col = tp.ColumnParallelLinear.from_linear(dense, gather_output=True, **options)
        fwd, bwd = run_both(mesh, col, dense, _x(mesh, 7), full, full, seq_len=S * tp_size)
        assert fwd[ALL_GATHER] == 1 and bwd[ALL_REDUCE] == 1, (fwd, bwd)
        dense = dense_linear(16 if "parts" in options else 24, 5, True, seed=7)
        row = tp.RowParallelLinear.from_linear(dense, input_is_parallel=False, **options)
        fwd, bwd = run_both(mesh, row, dense, _x(mesh, dense.in_features), full, full, seq_len=S * tp_size)
        assert fwd[ALL_REDUCE] == 1 and bwd[ALL_GATHER] == 1, (fwd, bwd)
        assert_close(row.weight.grad, row.shard_dense(dense.weight.grad), ATOL, f"row weight grad {options}")


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@distributed(world_size=4)
def test_swiglu_with_gather_output_gives_the_dense_activation(tp_size):
    """SwiGLU's output is F wide and each rank's slice is its chunk of F: gathered as is (not reordered as parts)."""
    mesh = tp.init_mesh(tp=tp_size)
    dense = dense_linear(7, 2 * 8, True, seed=6)  # fused [gate; up], F = 8
    col = tp.ColumnParallelLinear.from_linear(dense, activation="swiglu", gather_output=True)
    x_full = _x(mesh, 7).requires_grad_()
    gate, up = dense(x_full).chunk(2, -1)
    (F.silu(gate) * up).square().sum().backward()
    x = x_full.detach().clone().requires_grad_()
    y = col(x)
    assert_close(y, F.silu(gate) * up, ATOL, "output")
    y.square().sum().backward()
    assert_close(x.grad, x_full.grad, ATOL, "input grad")
    assert_close(col.weight.grad, col.shard_dense(dense.weight.grad), ATOL, "weight grad")


@pytest.mark.parametrize("tp_size", [1, 2])
@distributed(world_size=2)
def test_fp64_layers_stay_fp64_under_autocast(tp_size):
    """autocast leaves fp64 alone (F.linear does): fp64 layers compute in fp64 at any tp, main_grad or not."""
    tp.init_mesh(tp=tp_size)
    torch.manual_seed(0)
    d1, d2 = nn.Linear(6, 8, dtype=torch.float64), nn.Linear(8, 6, dtype=torch.float64)
    col, row = tp.ColumnParallelLinear.from_linear(d1), tp.RowParallelLinear.from_linear(d2)
    x = torch.randn(3, 6, dtype=torch.float64)
    for main_grad in (False, True):
        if main_grad:
            col.weight.main_grad = torch.zeros_like(col.weight)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, y_dense = row(col(x)), d2(d1(x))
        assert y.dtype == y_dense.dtype == torch.float64, (main_grad, y.dtype)
        assert_close(y, y_dense, 1e-12, f"output (main_grad={main_grad})")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@distributed(world_size=2)
def test_master_weight_is_drawn_in_the_layer_dtype(dtype):
    mesh = tp.init_mesh(tp=2)
    for cls, dim in ((tp.ColumnParallelLinear, 0), (tp.RowParallelLinear, 1)):
        torch.manual_seed(3)
        layer = cls(24, 12, dtype=dtype)
        torch.manual_seed(3)
        dense = nn.Linear(24, 12, dtype=dtype)
        assert torch.equal(layer.weight, dense.weight.detach().chunk(2, dim)[mesh.tp_rank])
        assert torch.equal(layer.bias, dense.bias.detach().chunk(2)[mesh.tp_rank] if dim == 0 else dense.bias.detach())


@distributed(world_size=4)
def test_main_grad_under_ddp_is_refused_and_reduced_by_allreduce_main_grads():
    """DDP reduces .grad, never main_grad: refuse loudly; tp.allreduce_main_grads is the supported reducer."""
    from torch.nn.parallel import DistributedDataParallel

    mesh = tp.init_mesh(tp=2)  # dp = 2
    x = torch.full((2, 4), float(mesh.dp_rank + 1))  # replica d feeds d + 1: dW = 2(d + 1), mean over dp = 3
    for attempt in ("refused", "supported"):
        torch.manual_seed(0)
        layer = tp.ColumnParallelLinear(4, 4)
        layer.weight.main_grad = torch.zeros_like(layer.weight)
        if attempt == "refused":
            with pytest.raises(ValueError, match=r"weight\.main_grad.*DistributedDataParallel.*allreduce_main_grads"):
                DistributedDataParallel(layer, process_group=mesh.dp_group)(x)
    tp.ddp_ignore_main_grads(layer)  # DDP keeps the bias; the weight's main_grad is ours to reduce
    ddp = DistributedDataParallel(layer, process_group=mesh.dp_group)
    ddp(x).sum().backward()
    tp.allreduce_main_grads(layer, mesh.dp_group)
    assert layer.weight.grad is None and torch.all(layer.weight.main_grad == 3.0), layer.weight.main_grad
    assert torch.all(layer.bias.grad == 2.0)  # DDP's mean of 2 tokens on each replica


@distributed(world_size=2)
def test_in_place_reduce_marks_its_input_dirty():
    """A tensor saved for backward and then reduced in place must make backward fail, never give wrong grads."""
    from tp.mappings import _ReduceFromTPInPlace

    mesh = tp.init_mesh(tp=2)
    w = torch.ones(3, requires_grad=True)
    y = w.exp()  # exp saves its output for backward
    z = _ReduceFromTPInPlace.apply(y, mesh.tp_group)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


@pytest.mark.parametrize("tp_size", [2, 4])
@distributed(world_size=4)
def test_replicated_parts_hold_whole_chunks_and_sum_their_grads(tp_size):
    """GQA with fewer kv heads than ranks: q split, k/v chunks held by several ranks, their grads summed."""
    mesh = tp.init_mesh(tp=tp_size)
    head, q_heads, kv_heads = 2, 4, 1  # MQA: every rank holds the one kv head
    parts, replicas = (q_heads * head, kv_heads * head, kv_heads * head), (1, tp_size, tp_size)
    dense = dense_linear(5, sum(parts), True, seed=8)
    layer = tp.ColumnParallelLinear.from_linear(dense, parts=parts, part_replicas=replicas)
    assert layer.weight.shape == (q_heads * head // tp_size + 2 * head, 5)
    assert f"parts={parts}, part_replicas={replicas}" in repr(layer)
    columns = layer.shard_dense(torch.arange(sum(parts)))
    assert torch.equal(layer.weight, dense.weight.detach()[columns])
    x = _x(mesh, 5).requires_grad_()
    y_dense = dense(x)
    g = randn(*y_dense.shape, seed=9, dtype=torch.float32)
    y_dense.backward(g)
    x_local = x.detach().clone().requires_grad_()
    y = layer(x_local)
    assert_close(y, y_dense.detach()[..., columns], ATOL, "output")
    # Downstream, only the first replica of a chunk uses the replicated columns: their uses sum to the dense one.
    g_local = g[..., columns].clone()
    g_local[..., q_heads * head // tp_size:] *= float(mesh.tp_rank == 0)
    _, bwd = comm_counts(lambda: y.backward(g_local))
    assert bwd[ALL_REDUCE] == 2, bwd  # the input grad, and the replicated rows' weight/bias grads (one buffer)
    layer.weight.main_grad = torch.zeros_like(layer.weight)  # would take wgrad before the replicas are summed
    with pytest.raises(ValueError, match=r"weight.main_grad with part_replicas=\(1, \d, \d\) is not supported"):
        layer(x_local)
    assert_close(x_local.grad, x.grad, ATOL, "input grad")
    assert_close(layer.weight.grad, dense.weight.grad[columns], ATOL, "weight grad")
    assert_close(layer.bias.grad, dense.bias.grad[columns], ATOL, "bias grad")


@pytest.mark.parametrize("tp_size", [2, 4])
@distributed(world_size=4)
def test_column_layers_sharing_one_input_reduce_its_grad_once(tp_size):
    """q, k, v reading one copy_to_tp_region(x) with disable_grad_reduce: one all-reduce backward, not three."""
    mesh = tp.init_mesh(tp=tp_size)
    denses = [dense_linear(7, 8, True, seed=10 + i) for i in range(3)]
    layers = [tp.ColumnParallelLinear.from_linear(d, disable_grad_reduce=True) for d in denses]
    assert "disable_grad_reduce=True" in repr(layers[0])
    x_full = _x(mesh, 7).requires_grad_()
    sum(d(x_full).square().sum() for d in denses).backward()
    x = x_full.detach().clone().requires_grad_()
    shared = tp.copy_to_tp_region(x)
    _, bwd = comm_counts(lambda: sum(layer(shared).square().sum() for layer in layers).backward())
    assert bwd[ALL_REDUCE] == bwd["total"] == 1, bwd
    assert_close(x.grad, x_full.grad, ATOL, "input grad")
    for layer, dense in zip(layers, denses):
        assert_close(layer.weight.grad, layer.shard_dense(dense.weight.grad), ATOL, "weight grad")
    with pytest.raises(ValueError, match="disable_grad_reduce=True with sequence_parallel=True"):
        tp.ColumnParallelLinear(4, 8, disable_grad_reduce=True, sequence_parallel=True)


@distributed(world_size=2)
def test_deepcopy_shares_the_process_group():
    """copy.deepcopy of a parallel model (EMA, a reference copy) copies the weights and shares the group handle."""
    import copy

    tp.init_mesh(tp=2)
    torch.manual_seed(0)
    model = nn.Sequential(tp.ColumnParallelLinear(HIDDEN, FFN), tp.RowParallelLinear(FFN, HIDDEN),
                          tp.VocabParallelEmbedding(10, HIDDEN))
    twin = copy.deepcopy(model)
    assert twin[0].group is model[0].group and twin[2].group is model[2].group
    assert twin[0].weight is not model[0].weight and torch.equal(twin[0].weight, model[0].weight)
    x = randn(S, B, HIDDEN, seed=1, dtype=torch.float32)
    assert torch.equal(twin[1](twin[0](x)), model[1](model[0](x)))


@distributed(world_size=2)
def test_from_linear_refuses_what_is_not_a_linear():
    tp.init_mesh(tp=2)
    for cls in (tp.ColumnParallelLinear, tp.RowParallelLinear):
        with pytest.raises(TypeError, match="from_linear needs an nn.Linear .* got Conv2d"):
            cls.from_linear(nn.Conv2d(2, 2, 1))


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp_size", [1, 2])
@distributed(world_size=2)
def test_skip_bias_add_returns_the_bias_for_the_caller_to_add(tp_size, sequence_parallel):
    """Megatron's skip_bias_add: forward returns (output without the bias, bias) for a fused bias-dropout-add; the
    caller's `y + b` gives the plain layer's output and every gradient (the row bias's summed over the sequence
    shards under SP, replicated parts' rows over their replicas)."""
    mesh = tp.init_mesh(tp=tp_size)
    options = dict(sequence_parallel=sequence_parallel, dtype=torch.float64)
    layers = {  # kind: (build, input features, whether the input differs per rank)
        "column": (lambda **o: tp.ColumnParallelLinear(6, 10, parts=(6, 2, 2), part_replicas=(1, tp_size, tp_size),
                                                       **o), 6, sequence_parallel),
        "row": (lambda **o: tp.RowParallelLinear(10, 7, **o), 10 // tp_size, True)}
    for kind, (build, features, sharded) in layers.items():
        torch.manual_seed(0)
        plain = build(**options)
        torch.manual_seed(0)
        skipping = build(**options, skip_bias_add=True)
        rows = 6 // tp_size if sequence_parallel and kind == "column" else 6  # (SP: the column's input is a shard)
        x = randn(rows, 3, features, seed=1 + (mesh.tp_rank if sharded else 0), dtype=torch.float64)
        want = plain(x)
        y, bias = skipping(x)
        assert_close(y + bias, want, atol=1e-12, what=kind)
        want.square().sum().backward()
        (y + bias).square().sum().backward()
        for (name, a), b in zip(plain.named_parameters(), skipping.parameters()):
            assert_close(b.grad, a.grad, atol=1e-12, what=f"{kind} {name}.grad")
        assert "skip_bias_add=True" in repr(skipping)
    with pytest.raises(ValueError, match=r"^skip_bias_add=True with activation='gelu': the bias is added before the "
                                         r"activation"):
        tp.ColumnParallelLinear(6, 10, activation="gelu", skip_bias_add=True)


@distributed(world_size=2)
def test_kernels_are_tuned_for_the_bias_the_forward_fuses(monkeypatch):
    """tune_kernels tunes the matmul the forward runs: without the bias where the caller adds it (skip_bias_add) or
    a row layer adds it after its all-reduce (the autotune key holds HAS_BIAS: it tuned the other variant)."""
    tp.init_mesh(tp=2)
    tuned = []
    monkeypatch.setattr(kernels, "tune_linear", lambda weight, bias, act, **_: tuned.append(bias is None) or True)
    for layer in (tp.ColumnParallelLinear(8, 16), tp.ColumnParallelLinear(8, 16, skip_bias_add=True),
                  tp.RowParallelLinear(16, 8)):
        layer.tune_kernels(32)
    assert tuned == [False, True, True]
