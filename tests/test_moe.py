"""The MoE layer (tp.moe) against a dense reference written from the definitions (tests/moe_reference.py), at
tp x ep x etp x cp splits: output, input gradient, the load-balancing and z losses, every weight gradient; the
communication per layer; the capacity policy; experts and ranks that get no tokens; bad input; debug checks.

Each rank holds its own tokens: micro-batch (cp rank, dp rank) of the global batch, under sequence parallelism its
tp rank's rows, else the whole micro-batch replicated over tp. The loss is Σ y·g over the global tokens (+ the aux
losses, data_parallel_size=1), so every gradient summed over the ranks holding a copy of the parameter equals the
reference's: router and shared expert over cp·dp (tp inside backward), experts over edp.
"""
import pytest
import torch
import torch.distributed as dist

import tp
from tp.testing import distributed

from .helpers import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER, assert_close, comm_counts, randn
from .moe_reference import dense_weights, reference_moe

H, F, SHARED = 8, 6, 4
R, B = 6, 2  # rows of a micro-batch (split over tp under SP), batch
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def close(actual, expected, tol, what):
    """Max abs error within tol relative to the expected tensor's largest magnitude (at least 1)."""
    assert_close(actual, expected, tol * max(1.0, expected.abs().max().item() if expected.numel() else 0.0), what)


def _all_reduce(t, group):
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def _run(mesh, moe, dtype, sp, *, seed=1, scale=1.0, topk, **ref):
    """Forward and backward of the layer and of the reference; checks outputs, losses and gradients."""
    cp_dp = mesh.size("dp-cp")
    mb = mesh.dp_rank * mesh.cp_size + mesh.cp_rank  # this rank's micro-batch
    X = randn(cp_dp, R, B, H, seed=seed, dtype=dtype) * scale
    G = randn(cp_dp, R, B, H, seed=seed + 1, dtype=dtype)
    mine = (lambda t: t[mb].chunk(mesh.tp_size, 0)[mesh.tp_rank]) if sp else (lambda t: t[mb])
    x = mine(X).clone().requires_grad_()
    y = moe(x)
    y.backward(mine(G))
    w = {k: v.clone().requires_grad_() for k, v in dense_weights(moe).items()}
    Xr = X.clone().requires_grad_()
    out, aux, lb, z = reference_moe(Xr.reshape(-1, H), w, topk=topk, **ref)
    ((out.view(X.shape) * G).sum() + aux).backward()
    tol = TOL[dtype]
    close(y, mine(out.view(X.shape)).detach(), tol, "output")
    close(x.grad, mine(Xr.grad), tol, "input grad")
    if ref.get("aux_coeff") or ref.get("z_coeff"):
        (values,) = tp.moe.aux_losses(moe)
        assert_close(values.load_balancing, lb.float().detach(), 1e-6, "load-balancing loss")
        assert_close(values.z, z.float().detach(), 1e-6, "z loss")
    grads = dense_weights(moe, grads=True)
    for name, grad in grads.items():
        group = mesh.edp_group if name in ("fc1", "fc2") else mesh.group("dp-cp")
        close(_all_reduce(grad.clone(), group), w[name].grad, tol, f"{name} grad")
    return y


SPLITS = {  # tp, sp, ep, etp, cp, dispatcher, topk, dtype, extra
    "tp1-ep2": (1, False, 2, None, 1, "alltoall", 2, torch.float64, {}),
    "tp2sp-ep2": (2, True, 2, None, 1, "alltoall", 3, torch.float64, {}),
    "tp2-ep2-etp1-replicated": (2, False, 2, 1, 1, "alltoall", 1, torch.float64, {}),
    "tp1-ep4-allgather": (1, False, 4, None, 1, "allgather", 2, torch.float32, {}),
    "tp2sp-ep1-etp2-sigmoid": (2, True, 1, None, 1, "alltoall", 2, torch.float64, {"score": "sigmoid"}),
    "tp1-cp2-ep2-capacity": (1, False, 2, None, 2, "alltoall", 2, torch.float64, {"capacity_factor": 1.0}),
    "tp2sp-ep2-etp1-allgather-capacity": (2, True, 2, 1, 1, "allgather", 2, torch.float32,
                                          {"capacity_factor": 0.5}),
    "tp2sp-cp2-ep2-etp2-gelu": (2, True, 2, None, 2, "alltoall", 2, torch.float64, {"activation": "gelu_tanh"}),
}


@pytest.mark.parametrize("split", list(SPLITS))
@distributed(world_size=4)
def test_moe_layer_matches_the_dense_reference(split):
    tp_size, sp, ep, etp, cp, dispatcher, topk, dtype, extra = SPLITS[split]
    mesh = tp.init_mesh(tp=tp_size, cp=cp, ep=ep, etp=etp)
    torch.set_default_dtype(dtype)
    E = 12 if ep == 4 else 6  # not powers of two
    score, activation = extra.get("score", "softmax"), extra.get("activation", "swiglu")
    moe = tp.moe.MoE(H, F, E, topk, activation=activation, score=score, shared_expert_size=SHARED,
                     shared_expert_gate=True, aux_loss_coeff=0.1, z_loss_coeff=0.01,
                     capacity_factor=extra.get("capacity_factor"), dispatcher=dispatcher, sequence_parallel=sp,
                     data_parallel_size=1)
    assert moe.experts.local_experts == E // ep and moe.experts.local_ffn == F // mesh.etp_size
    _run(mesh, moe, dtype, sp, topk=topk, score=score, activation=activation, aux_coeff=0.1, z_coeff=0.01,
         capacity_factor=extra.get("capacity_factor"))
