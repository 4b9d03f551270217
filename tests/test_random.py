"""Dropout masks: identical across tp ranks outside fork_rng, different inside, reproducible from the seed."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tp
from tp.testing import distributed


def _gather(t, group):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return out


@distributed(world_size=4)
def test_fork_rng_differs_per_tp_rank_and_default_is_shared():
    mesh = tp.init_mesh(tp=2)
    tp.model_parallel_seed(1234)
    replicated = F.dropout(torch.ones(64), p=0.5)
    before = torch.get_rng_state()
    with tp.fork_rng():
        sharded = F.dropout(torch.ones(64), p=0.5)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream continues as if the fork never happened
    reps, shards = _gather(replicated, mesh.tp_group), _gather(sharded, mesh.tp_group)
    assert torch.equal(reps[0], reps[1])  # replicated region: one mask on every tp rank
    assert not torch.equal(shards[0], shards[1])  # tensor-parallel region: each rank its own mask
    dp_shards = _gather(sharded, mesh.dp_group)  # same tp rank in another replica: same seed, same mask
    assert torch.equal(dp_shards[0], dp_shards[1])
    with tp.fork_rng():  # the tracked stream advances: a second draw differs from the first
        assert not torch.equal(F.dropout(torch.ones(64), p=0.5), sharded)


def test_fork_without_seed_raises():
    tp.get_rng_tracker().reset()
    with pytest.raises(RuntimeError, match="is not tracked"):
        with tp.fork_rng():
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
