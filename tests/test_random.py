"""Dropout masks: identical across tp ranks outside fork_rng, different inside, reproducible from the seed."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tp
from tp.testing import distributed

from .helpers import rng


def _gather(t, group):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return out


@distributed(world_size=4)
def test_fork_rng_differs_per_tp_rank_and_default_is_shared():
    mesh = tp.init_mesh(tp=2)
    tp.model_parallel_seed(1234)
    replicated = F.dropout(torch.ones(64), p=0.5)
    with tp.fork_rng():
        sharded = F.dropout(torch.ones(64), p=0.5)
    after = _gather(torch.rand(8), mesh.tp_group)
    assert torch.equal(after[0], after[1])  # the default stream continues alike on every tp rank
    reps, shards = _gather(replicated, mesh.tp_group), _gather(sharded, mesh.tp_group)
    assert torch.equal(reps[0], reps[1])  # replicated region: one mask on every tp rank
    assert not torch.equal(shards[0], shards[1])  # tensor-parallel region: each rank its own mask
    dp_shards = _gather(sharded, mesh.dp_group)  # same tp rank in another replica: same seed, same mask
    assert torch.equal(dp_shards[0], dp_shards[1])
    with tp.fork_rng():  # the tracked stream advances: a second draw differs from the first
        assert not torch.equal(F.dropout(torch.ones(64), p=0.5), sharded)


def test_fork_without_seed_raises():
    tp.get_rng_tracker().reset()
    with pytest.raises(RuntimeError, match="is not tracked"), tp.fork_rng():
        pass


@distributed(world_size=4)
def test_pipeline_stages_get_their_own_streams():
    mesh = tp.init_mesh(tp=2, pp=2)
    tp.model_parallel_seed(7)
    replicated = torch.rand(16)
    with tp.fork_rng():
        sharded = torch.rand(16)
    reps, shards = _gather(replicated, mesh.pp_group), _gather(sharded, mesh.pp_group)
    assert not torch.equal(reps[0], reps[1]) and not torch.equal(shards[0], shards[1])  # stages differ
    assert torch.equal(_gather(replicated, mesh.tp_group)[0], _gather(replicated, mesh.tp_group)[1])


def _dropout_in_tp_region(x, w):
    h = x @ w
    with tp.fork_rng():
        h = F.dropout(h, p=0.5)
    return torch.tanh(h) @ w


@pytest.mark.parametrize("use_reentrant", [True, False])
@distributed(world_size=2)
def test_checkpoint_recomputes_the_same_tp_dropout_mask(use_reentrant):
    """Plain torch.utils.checkpoint restores the default generators only; the tp stream must survive it too."""
    mesh = tp.init_mesh(tp=2)
    g = rng(0)
    x0 = torch.randn(16, 16, generator=g, dtype=torch.float64)
    w0 = torch.randn(16, 16, generator=g, dtype=torch.float64)

    def grads(recompute):
        tp.model_parallel_seed(3)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        for _ in range(2):  # the tracked stream has advanced before the second checkpointed call
            if recompute:
                out = torch.utils.checkpoint.checkpoint(_dropout_in_tp_region, x, w, use_reentrant=use_reentrant)
            else:
                out = _dropout_in_tp_region(x, w)
            out.square().sum().backward()
        return out.detach(), x.grad, w.grad

    for plain, recomputed in zip(grads(False), grads(True)):
        assert torch.equal(plain, recomputed)
    shards = _gather(grads(False)[1], mesh.tp_group)
    assert not torch.equal(shards[0], shards[1])  # still a different mask per tp rank


def test_model_parallel_seed_without_a_mesh_raises_before_reseeding():
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="no tensor-parallel mesh"):
        tp.model_parallel_seed(5)
    assert torch.equal(torch.get_rng_state(), state)


def test_the_tracked_streams_draw_on_the_default_device_also_with_a_gpu_present(monkeypatch):
    """(CUDA faked visible.) CPU tensors' dropout draws from the CPU generator: a stream tracked on the GPU would
    leave it unforked and every tp rank would draw the same mask."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    tracker = tp.random.RNGStatesTracker()
    tracker.add("stream", 3)
    assert tracker.get_states()["stream"] == (torch.device("cpu"), 3)
