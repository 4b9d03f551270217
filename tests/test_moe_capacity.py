"""The capacity policy (tp.moe.keep_mask): exactly C slots per expert, ties at the threshold kept in the tokens'
global order, so the decision is a function of the routing weights alone; at tp (SP), cp and pooled dp splits the
layer drops, over several SGD steps on tokens that repeat (exact ties), what the one-rank reference drops."""
import pytest
import torch
import torch.distributed as dist

import tp
from tp.testing import distributed

from .helpers import assert_close, randn
from .moe_reference import capacity_kept, dense_weights, reference_moe, route

H, F, E, TOPK = 8, 6, 4, 2
S, BATCH = 8, 4  # the global sequence and batch (split over tp·cp rows and dp samples)


def test_ties_at_the_threshold_go_to_the_earlier_token():
    """Eight slots for expert 0 (capacity 2): one of weight 0.9, seven tied at 0.5. Exactly the 0.9 and the tied
    slot of the lowest global index are kept, whatever order the rows come in; raising one tied weight by an ulp
    moves one slot (the raised one in, the earlier one out), not the whole run of ties."""
    weights = torch.tensor([0.9] + [0.5] * 7)[:, None]
    indices = torch.zeros(8, 1, dtype=torch.int64)
    order = torch.tensor([3, 7, 6, 5, 4, 2, 1, 0])  # row 7 holds token 0 (the earliest tied one)
    kept, cap = tp.moe.keep_mask(weights, indices, 2, 0.5, None, order=order)
    assert cap.item() == 2 and kept.flatten().tolist() == [True] + [False] * 6 + [True]
    raised = weights.clone()
    raised[2] = torch.nextafter(raised[2], torch.tensor(1.0))
    moved, _ = tp.moe.keep_mask(raised, indices, 2, 0.5, None, order=order)
    assert (moved != kept).sum().item() == 2 and moved[2] and not moved[7]
    assert torch.equal(tp.moe.keep_mask(weights, indices, 2, 0.5, None)[0], torch.ones_like(kept))  # (no order)


def _local(t, mesh, sp):
    """This rank's part of a global [S, BATCH, ...] tensor: its cp share (load-balanced), dp samples, SP rows."""
    t = tp.cp_shard(t, 0, group=mesh.cp_group).chunk(mesh.dp_size, 1)[mesh.dp_rank]
    return t.chunk(mesh.tp_size, 0)[mesh.tp_rank] if sp else t


def _tokens(step):
    """[S, BATCH, H]: three distinct vectors repeated (every expert's slots tie in runs), the mix varying by step."""
    vectors = randn(3, H, seed=100 + step)
    pick = torch.arange(S * BATCH).view(S, BATCH) * (step + 1) % 3
    return vectors[pick]


def _step(moe, w, x_global, g_global, mesh, sp, lr):
    """One forward and SGD step of the split layer and of the reference (weights w): outputs compared, dropped slots
    returned (the layer's, summed over the ranks; the reference's)."""
    x = _local(x_global, mesh, sp).clone()
    y = moe(x)
    (y * _local(g_global, mesh, sp)).sum().backward()
    flat = x_global.transpose(0, 1).reshape(-1, H)  # row b·S + position: the tokens' global order
    w = {k: v.clone().requires_grad_() for k, v in w.items()}
    out, _, _, _ = reference_moe(flat, w, topk=TOPK, capacity_factor=1.0)
    (out * g_global.transpose(0, 1).reshape(-1, H)).sum().backward()
    want = _local(out.detach().view(BATCH, S, H).transpose(0, 1), mesh, sp)
    assert_close(y.detach(), want, 1e-12, "output")
    dropped = moe.dropped_slots.clone()
    dist.all_reduce(dropped, group=mesh.group("tp-cp-dp"))
    with torch.no_grad():
        for p, group in ((moe.router.weight, mesh.group("dp-cp")), (moe.experts.fc1, mesh.edp_group),
                         (moe.experts.fc2, mesh.edp_group)):
            grad = p.grad.clone()
            if dist.get_world_size(group) > 1:
                dist.all_reduce(grad, group=group)
            p -= lr * grad
            p.grad = None
    weights, indices, _, _ = route(flat, w["router"].detach(), TOPK)
    reference_dropped = (~capacity_kept(weights, indices, E, 1.0)).sum().item()
    return dropped.item(), reference_dropped, {k: (v - lr * v.grad).detach() for k, v in w.items()}


@pytest.mark.parametrize("split", [dict(tp=2), dict(cp=2), dict(dp=2)], ids=["tp2-sp", "cp2", "dp2"])
@distributed(world_size=2)
def test_split_layers_drop_what_the_reference_drops_over_steps(split):
    """fp64, capacity factor 1, tokens repeating three vectors: at each of three SGD steps the layer at tp 2 (SP),
    cp 2 or dp 2 (the token group pooling both dp ranks' samples) gives the reference's output (ties broken by the
    global index, sample then position) and drops as many slots as it does, some every step."""
    mesh = tp.init_mesh(**split)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    sp = mesh.tp_size > 1
    moe = tp.moe.MoE(H, F, E, TOPK, capacity_factor=1.0, sequence_parallel=sp, data_parallel_size=mesh.dp_size)
    w = dense_weights(moe)
    for step in range(3):
        g = randn(S, BATCH, H, seed=200 + step)
        dropped, want, w = _step(moe, w, _tokens(step), g, mesh, sp, lr=0.5)
        assert dropped == want and want > 0, (step, dropped, want)
