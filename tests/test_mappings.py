"""Each conjugate mapping, forward and backward, against a hand computation from every rank's data."""
import pytest
import torch

import tp
from tp.testing import distributed

from .helpers import assert_close, comm_counts, noncontiguous, randn

S, B, H = 6, 3, 5  # per-rank sequence / batch / hidden, odd where the mapping allows

# name -> (function, input shape for tp size p, expected output, expected input grad, (fwd, bwd) collective)
# Inputs x[r] and upstream grads g[r] are known for every tp rank r, so each rank can compute the answer itself.
CASES = {
    "copy_to_tp_region": (
        tp.copy_to_tp_region, lambda p: (S, B, H), lambda x, r, p: x[0],
        lambda g, r, p: sum(g), (None, "all_reduce"), True),
    "reduce_from_tp_region": (
        tp.reduce_from_tp_region, lambda p: (S, B, H), lambda x, r, p: sum(x),
        lambda g, r, p: g[r], ("all_reduce", None), False),
    "scatter_to_tp_region": (
        tp.scatter_to_tp_region, lambda p: (S, B, H * p), lambda x, r, p: x[0].chunk(p, -1)[r],
        lambda g, r, p: torch.cat(g, -1), (None, "all_gather"), True),
    "gather_from_tp_region": (
        tp.gather_from_tp_region, lambda p: (S, B, H), lambda x, r, p: torch.cat(x, -1),
        lambda g, r, p: g[0].chunk(p, -1)[r], ("all_gather", None), False),
    "scatter_to_sp_region": (
        tp.scatter_to_sp_region, lambda p: (S * p, B, H), lambda x, r, p: x[0].chunk(p, 0)[r],
        lambda g, r, p: torch.cat(g, 0), (None, "all_gather"), True),
    "gather_from_sp_region": (
        tp.gather_from_sp_region, lambda p: (S, B, H), lambda x, r, p: torch.cat(x, 0),
        lambda g, r, p: sum(g).chunk(p, 0)[r], ("all_gather", "reduce_scatter"), False),
    "gather_from_sp_region(tensor_parallel_output_grad=False)": (
        lambda x: tp.gather_from_sp_region(x, tensor_parallel_output_grad=False), lambda p: (S, B, H),
        lambda x, r, p: torch.cat(x, 0), lambda g, r, p: g[0].chunk(p, 0)[r], ("all_gather", None), False),
    "reduce_scatter_to_sp_region": (
        tp.reduce_scatter_to_sp_region, lambda p: (S * p, B, H), lambda x, r, p: sum(x).chunk(p, 0)[r],
        lambda g, r, p: torch.cat(g, 0), ("reduce_scatter", "all_gather"), False),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("tp_size", [1, 2, 4])
@distributed(world_size=4)
def test_mapping(name, tp_size):
    fn, shape, expect_out, expect_grad, (fwd_op, bwd_op), input_replicated = CASES[name]
    mesh = tp.init_mesh(tp=tp_size)
    p, r = tp_size, mesh.tp_rank
    # Replicated inputs are identical on every tp rank; sharded ones differ. dp replicas get their own data.
    xs = [randn(*shape(p), seed=100 * mesh.dp_rank + (0 if input_replicated else q)) for q in range(p)]
    x = noncontiguous(xs[r]).requires_grad_()
    y, fwd = comm_counts(lambda: fn(x))
    assert_close(y, expect_out(xs, r, p), atol=1e-12, what="forward")
    out_replicated = name in ("reduce_from_tp_region", "gather_from_tp_region",
                              "gather_from_sp_region(tensor_parallel_output_grad=False)")
    gs = [randn(*y.shape, seed=7 + 100 * mesh.dp_rank + (0 if out_replicated else q)) for q in range(p)]
    _, bwd = comm_counts(lambda: y.backward(noncontiguous(gs[r])))
    assert_close(x.grad, expect_grad(gs, r, p), atol=1e-12, what="input grad")
    for counted, op in ((fwd, fwd_op), (bwd, bwd_op)):
        expected_total = int(op is not None and p > 1)
        assert counted["total"] == expected_total, (name, counted)
        if expected_total:
            assert counted[op] == 1, (name, counted)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("tp_size", [2, 4])
@distributed(world_size=4)
def test_the_backward_is_differentiable_its_derivative_the_forward(name, tp_size):
    """A mapping is linear: its backward is its conjugate's forward, whose own backward is the mapping's forward, so
    a second derivative through it (a gradient penalty, create_graph=True) is exact; it raised."""
    fn, shape, expect_out, _, _, input_replicated = CASES[name]
    mesh = tp.init_mesh(tp=tp_size)
    p, r = tp_size, mesh.tp_rank
    xs = [randn(*shape(p), seed=100 * mesh.dp_rank + q) for q in range(p)]
    x = xs[r].requires_grad_()
    y = fn(x)
    grad = randn(*y.shape, seed=7 + 100 * mesh.dp_rank + r).requires_grad_()  # (any: its gradient is the question)
    (x_grad,) = torch.autograd.grad(y, x, grad, create_graph=True)
    vs = [randn(*x.shape, seed=9 + 100 * mesh.dp_rank + (0 if input_replicated else q)) for q in range(p)]
    (grad_grad,) = torch.autograd.grad(x_grad, grad, noncontiguous(vs[r]))
    assert_close(grad_grad, expect_out(vs, r, p), atol=1e-12, what="second derivative")
    if name == "reduce_from_tp_region":  # the in-place all-reduce of a fresh tensor (a row layer's output)
        y = tp.reduce_from_tp_region(x * 1, in_place=True)
        (x_grad,) = torch.autograd.grad(y, x, grad, create_graph=True)
        (grad_grad,) = torch.autograd.grad(x_grad, grad, noncontiguous(vs[r]))
        assert_close(grad_grad, expect_out(vs, r, p), atol=1e-12, what="second derivative, in place")


@distributed(world_size=2)
def test_split_not_divisible_raises_on_every_rank():
    tp.init_mesh(tp=2)
    for fn, shape, what in (
        (tp.scatter_to_tp_region, (4, 2, 5), "last dim"), (tp.scatter_to_sp_region, (5, 2, 4), "sequence"),
        (tp.reduce_scatter_to_sp_region, (3, 2, 4), "sequence"),
    ):
        with pytest.raises(ValueError, match=rf"{what}.* of size [35] .* 2 tensor-parallel ranks"):
            fn(torch.zeros(shape))


@distributed(world_size=2)
def test_reduce_does_not_modify_its_input():
    tp.init_mesh(tp=2)
    x = torch.ones(3, 4)
    y = tp.reduce_from_tp_region(x)
    assert torch.equal(x, torch.ones(3, 4)) and torch.equal(y, torch.full((3, 4), 2.0))


@distributed(world_size=2)
def test_scatter_returns_a_copy_whatever_the_layout():
    """A last-dim chunk of a one-token input is contiguous; it is still copied, so in-place ops leave x alone."""
    tp.init_mesh(tp=2)
    for shape in ((1, 4), (1, 1, 4), (3, 4)):
        x = torch.ones(shape)
        tp.scatter_to_tp_region(x).add_(1)
        assert torch.equal(x, torch.ones(shape)), shape


def test_layers_without_mesh_or_group_raise():
    with pytest.raises(RuntimeError, match="no tensor-parallel mesh"):
        tp.copy_to_tp_region(torch.zeros(2))


@distributed(world_size=2)
def test_sync_grads_over_tp_leaves_other_tensors_grads_alone():
    """The summed grad is the parameter's own: autograd may hand the same grad tensor to a sibling input (an add)."""
    mesh = tp.init_mesh(tp=2)
    r = mesh.tp_rank
    p = torch.nn.Parameter(torch.zeros(4))
    h = torch.full((4,), float(r + 1), requires_grad=True)
    x = h * 1.0  # created before the sync: autograd runs the sync's backward first
    w, = tp.sync_grads_over_tp(p)
    ((x + w) * (r + 1)).sum().backward()  # the add's one grad tensor goes to both branches
    assert torch.equal(p.grad, torch.full((4,), 3.0))  # 1 + 2 over the two ranks
    assert torch.equal(h.grad, torch.full((4,), float(r + 1)))  # this rank's own
