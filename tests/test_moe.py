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
from .moe_reference import MARGIN, dense_weights, reference_moe, routing_margin

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


def _run(mesh, moe, dtype, sp, *, seed=1, transform=None, topk, rows=R, batch=B, **ref):
    """Forward and backward of the layer and of the reference; checks outputs, losses and gradients."""
    cp_dp = mesh.size("dp-cp")
    mb = mesh.dp_rank * mesh.cp_size + mesh.cp_rank  # this rank's micro-batch
    X = randn(cp_dp, rows, batch, H, seed=seed, dtype=dtype)
    X = X if transform is None else transform(X)
    G = randn(cp_dp, rows, batch, H, seed=seed + 1, dtype=dtype)
    mine = (lambda t: t[mb].chunk(mesh.tp_size, 0)[mesh.tp_rank]) if sp else (lambda t: t[mb])
    x = mine(X).clone().requires_grad_()
    y = moe(x)
    y.backward(mine(G))
    w = {k: v.clone().requires_grad_() for k, v in dense_weights(moe).items()}
    Xr = X.clone().requires_grad_()
    out, aux, lb, z = reference_moe(Xr.reshape(-1, H), w, topk=topk, **ref)
    ((out.view(X.shape) * G).sum() + aux).backward()
    if dtype == torch.float32:  # fp32 routing is compared across splits: no decision near a tie (moe_reference)
        margin = routing_margin(Xr.detach().reshape(-1, H) @ w["router"].detach().T, topk,
                                score=ref.get("score", "softmax"), capacity_factor=ref.get("capacity_factor"))
        assert margin >= MARGIN, f"the inputs route within {margin:.2g} of a tie: take another seed"
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
    if "capacity_factor" in extra:  # some slots were dropped (somewhere): the policy was exercised
        assert _all_reduce(moe.dropped_slots.clone(), mesh.group("tp-cp-dp")) > 0


@distributed(world_size=4)
def test_replicated_over_tp_any_token_count_routes_as_the_reference():
    """tp 2 without SP: each tp rank routes its share of the micro-batch's tokens, ceil(T/tp) rows and the rest on
    the last rank, so a count tp does not divide (a prompt of odd length, generation's one token per step, a rank
    left without tokens) gives the reference's output, losses and gradients at every dispatcher, with capacity, and
    the sequence-wise aux loss's value."""
    from tp.moe.losses import sequence_aux_loss

    from .moe_reference import route

    torch.set_default_dtype(torch.float64)
    for ep, etp, dispatcher, capacity in ((2, 1, "alltoall", 1.0), (2, 1, "allgather", None), (1, 2, "alltoall", None)):
        mesh = tp.init_mesh(tp=2, ep=ep, etp=etp)
        for rows, batch in ((5, 1), (1, 1), (3, 3)):
            torch.manual_seed(0)
            moe = tp.moe.MoE(H, F, 6, 2, shared_expert_size=SHARED, aux_loss_coeff=0.1, capacity_factor=capacity,
                             dispatcher=dispatcher, data_parallel_size=1)
            _run(mesh, moe, torch.float64, False, topk=2, rows=rows, batch=batch, aux_coeff=0.1,
                 capacity_factor=capacity)
            moe.seq_aux_loss_coeff = 0.1
            x = randn(mesh.dp_size, rows, batch, H, seed=7)
            with torch.no_grad():
                moe(x[mesh.dp_rank])
                _, indices, probs, _ = route(x[mesh.dp_rank].reshape(-1, H), moe.router.weight, 2)
                _, expected = sequence_aux_loss(probs, indices, torch.arange(rows * batch) % batch, batch,
                                                coeff=0.1, group=None)
            assert_close(moe.last.sequence, expected, 1e-12, f"sequence aux loss at {rows}x{batch}")
        tp.destroy_mesh(keep_groups=True)


def test_a_2d_input_is_one_sequence_for_the_sequence_aux_loss():
    """[T, h] is one sequence of T tokens ([T, 1, h]): the sequence-wise loss took h for the batch size."""
    tp.init_mesh()
    try:
        torch.manual_seed(0)
        moe = tp.moe.MoE(H, F, 6, 2, seq_aux_loss_coeff=0.1, data_parallel_size=1)
        x = randn(R, H, seed=3, dtype=torch.float32)
        with torch.no_grad():
            moe(x.unsqueeze(1))
            expected = moe.last.sequence.clone()
            moe(x)
        assert torch.equal(moe.last.sequence, expected)
    finally:
        tp.destroy_mesh()


@pytest.mark.parametrize("tp_size,ep,aux", [(1, 2, False), (1, 4, True), (2, 2, False)])
@distributed(world_size=4)
def test_communication_per_layer(tp_size, ep, aux):
    """ep > 1, alltoall: forward one all-gather of the counts and one all-to-all each way, backward the two
    all-to-alls; with etp = tp = 2 (SP) the etp gather / reduce-scatter each way and the router grads' all-reduce
    over tp; aux losses: one all-reduce of the statistics forward."""
    mesh = tp.init_mesh(tp=tp_size, ep=ep)
    moe = tp.moe.MoE(H, F, 8, 2, sequence_parallel=tp_size > 1, aux_loss_coeff=0.1 * aux)
    x = randn(R // tp_size, B, H, seed=mesh.rank, dtype=torch.float32, requires_grad=True)
    ops = (ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER, ALL_REDUCE)
    y, fwd = comm_counts(lambda: moe(x), ops)
    _, bwd = comm_counts(lambda: y.sum().backward(), ops)
    etp = int(mesh.etp_size > 1)
    assert fwd == {ALL_GATHER: 1 + etp, ALL_TO_ALL: 2, REDUCE_SCATTER: etp, ALL_REDUCE: int(aux),
                   "total": 3 + 2 * etp + int(aux)}, fwd
    assert bwd == {ALL_GATHER: etp, ALL_TO_ALL: 2, REDUCE_SCATTER: etp, ALL_REDUCE: int(tp_size > 1),
                   "total": 2 + 2 * etp + int(tp_size > 1)}, bwd


@distributed(world_size=4)
def test_experts_and_ranks_without_tokens():
    """Every token prefers the experts of ep rank 0: rank 1's experts (and expert 0) get nothing on this step. No
    hang, zero gradients there, the output still the reference's."""
    mesh = tp.init_mesh(ep=2)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    moe = tp.moe.MoE(H, F, 6, 2, shared_expert_size=SHARED, data_parallel_size=1)
    u = torch.zeros(H)
    u[0] = 1.0
    with torch.no_grad():
        moe.router.weight.copy_(torch.stack([-3 * u] + [u + 0.1 * torch.randn(H) for _ in range(2)]
                                            + [-u + 0.1 * torch.randn(H) for _ in range(3)]))
    _run(mesh, moe, torch.float64, False, topk=2, seed=3, transform=_shift)
    assert mesh.ep_rank == 0 or not moe.experts.fc1.grad.any()  # rank 1's experts: no token, zero grads
    assert mesh.ep_rank == 1 or not moe.experts.fc1.grad[0].any()  # expert 0: none either


def _shift(x):
    x = x.clone()
    x[..., 0] += 5.0  # every token leans to the experts whose router rows are +u
    return x


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_experts=6, ep=4), r"num_experts=6 is not divisible by ep=4"),
    (dict(topk=7), r"moe_router_topk=7 must be between 1 and num_experts=6"),
    (dict(ffn=5, tp=2, etp=2), r"moe_ffn_hidden_size=5 is not divisible by etp=2"),
    (dict(dispatcher="p2p"), r"moe_dispatcher='p2p' must be one of \('alltoall', 'allgather'\)"),
    (dict(capacity_factor=0), r"moe_capacity_factor=0 must be a positive number"),
])
@distributed(world_size=4)
def test_bad_configurations_raise_on_every_rank(kwargs, message):
    kwargs = dict(dict(num_experts=6, topk=2, ffn=F, tp=1, ep=1, etp=None), **kwargs)
    tp.init_mesh(tp=kwargs.pop("tp"), ep=kwargs.pop("ep"), etp=kwargs.pop("etp"))
    with pytest.raises(ValueError, match=message):
        tp.moe.MoE(H, kwargs.pop("ffn"), kwargs.pop("num_experts"), kwargs.pop("topk"), **kwargs)


@distributed(world_size=4)
def test_debug_mode_checks_the_router_weight():
    tp.init_mesh(tp=2, ep=2)
    moe = tp.moe.MoE(H, F, 6, 2, sequence_parallel=True)
    if dist.get_rank() == 3:
        with torch.no_grad():
            moe.router.weight[0, 0] += 1e-3  # a drifted copy would route its tokens elsewhere, silently
    x = randn(R // 2, B, H, seed=0, dtype=torch.float32)
    moe(x)  # debug off: nothing checked
    message = r"the router weight of an MoE layer should be replicated but differs .*ranks \[0, 1, 2\] vs ranks \[3\]"
    with tp.set_debug(True), pytest.raises(ValueError, match=message):
        moe(x)


@pytest.mark.parametrize("tp_size,ep", [(1, 2), (2, 2), (1, 4)])
@distributed(world_size=4)
def test_expert_bias_updates_equal_across_splits(tp_size, ep):
    """Sigmoid routing's auxiliary-loss-free bias: after two forwards, every rank's bias equals the update computed
    from the global loads of the serial model (b += rate · sign(mean - load))."""
    mesh = tp.init_mesh(tp=tp_size, ep=ep)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    moe = tp.moe.MoE(H, F, 8, 2, score="sigmoid", sequence_parallel=tp_size > 1)
    router = moe.router.weight.detach().clone()
    loads = torch.zeros(8, dtype=torch.float64)
    for step in range(2):
        X = randn(mesh.dp_size, R, B, H, seed=10 + step)
        x = X[mesh.dp_rank].chunk(tp_size, 0)[mesh.tp_rank]
        moe(x)
        _, indices = route_indices(X.reshape(-1, H), router)
        loads += torch.bincount(indices.flatten(), minlength=8)
    tp.moe.update_expert_bias(moe, rate=0.01)
    expected = 0.01 * torch.sign(loads.mean() - loads)
    assert torch.equal(moe.router.expert_bias.double(), expected.to(moe.router.expert_bias.dtype).double())
    assert not moe.router.expert_load.any()  # reset for the next step
    assert expected.any()


def route_indices(x, router):
    from .moe_reference import route

    weights, indices, _, _ = route(x, router, 2, "sigmoid")
    return weights, indices


@distributed(world_size=4)
def test_initialisation_is_split_invariant():
    """The layer's weights at tp 2 x ep 2 (etp 2) and at ep 4 (etp 1), gathered, equal the one-rank layer's."""
    results = []
    for tp_size, ep, etp in ((2, 2, None), (1, 4, 1), (1, 1, None)):
        tp.init_mesh(tp=tp_size, ep=ep, etp=etp)
        torch.manual_seed(0)
        moe = tp.moe.MoE(H, F, 8, 2, shared_expert_size=SHARED, shared_expert_gate=True)
        results.append(dense_weights(moe))
        tp.destroy_mesh()
    for other in results[:2]:
        assert other.keys() == results[2].keys()
        for name in other:
            assert torch.equal(other[name], results[2][name]), name


def test_moe_benchmark_counts_the_bytes_it_moves(tmp_path):
    """bench.moe at ep 2, one step: the dense FFN sends nothing, allgather exactly its model, alltoall the off-rank
    share of 4·k·h·e per token (its model assumes uniform routing)."""
    import json

    from bench import moe as bench

    out = tmp_path / "moe.json"
    bench.main(["--ep", "2", "--iters", "1", "--warmup", "0", "--job-steps", "0", "--out", str(out)])  # (the job:
    # tests/test_moe_train.py runs it)
    rows = {row["layer"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["dense"]["bytes"] == 0 and rows["allgather"]["bytes"] == rows["allgather"]["model_bytes"]
    assert 0 < rows["alltoall"]["bytes"] <= 4 * bench.TOPK * bench.HIDDEN * 4
    assert all(row["ms"] > 0 for row in rows.values())
    mixtral = bench.model_row("mixtral-8x7b", 8, 8192)
    assert mixtral["bytes_per_token"] == 4 * 2 * 4096 * 2 * 7 / 8  # dispatch + combine, fwd + bwd, bf16
    assert mixtral["alltoall_comm_ms"] == pytest.approx(1e3 * (8192 * mixtral["bytes_per_token"] / 450e9 + 40e-6))
