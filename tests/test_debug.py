"""TP_DEBUG: inputs meant to be replicated, and shapes, are checked across the tp group; off, nothing is added."""
import pytest
import torch

import tp
from tp.testing import distributed

from .helpers import comm_counts, rng


def _mlp(sequence_parallel=False):
    torch.manual_seed(0)
    return (tp.ColumnParallelLinear(8, 12, sequence_parallel=sequence_parallel),
            tp.RowParallelLinear(12, 8, sequence_parallel=sequence_parallel))


@distributed(world_size=4)
def test_divergent_replicated_input_raises_on_every_rank_naming_the_ranks():
    mesh = tp.init_mesh(tp=4)
    fc1, fc2 = _mlp()
    x = torch.ones(3, 2, 8)
    if mesh.tp_rank == 2:
        x[0, 0, 0] += 1e-3  # a "replicated" input that silently differs on one rank (pytorch#119343)
    fc2(fc1(x))  # off: no error, wrong numbers
    with tp.set_debug(True):
        with pytest.raises(ValueError, match=r"ColumnParallelLinear should be replicated but differs .*"
                                             r"ranks \[0, 1, 3\] vs ranks \[2\]"):
            fc1(x)
        with pytest.raises(ValueError, match=r"input of CopyToTP should be replicated.*ranks \[2\]"):
            tp.copy_to_tp_region(x)
        torch.manual_seed(1)
        assert fc2(fc1(torch.randn(3, 2, 8))).shape == (3, 2, 8)  # agreeing inputs pass
    assert not tp.is_debug()


@distributed(world_size=2)
def test_non_finite_values_are_compared_by_position():
    """NaN/inf: the same on every rank passes; a NaN/inf at another place, or a divergence beside one, is caught."""
    mesh = tp.init_mesh(tp=2)
    x = torch.randn(4, 8, generator=rng(0))
    x[0, 0], x[2, 3] = float("nan"), float("inf")
    with tp.set_debug(True):
        tp.copy_to_tp_region(x)  # replicated, non-finite values included
        beside = x.clone()
        beside[1, 1] += mesh.tp_rank  # a finite value differs beside the inf
        moved = x.clone()
        moved[3, mesh.tp_rank] = float("-inf")  # same count, other place
        for bad in (beside, moved):
            with pytest.raises(ValueError, match=r"should be replicated but differs .*ranks \[0\] vs ranks \[1\]"):
                tp.copy_to_tp_region(bad)


@distributed(world_size=2)
def test_different_sequence_lengths_raise_on_every_rank_instead_of_garbage_or_abort():
    mesh = tp.init_mesh(tp=2)
    fc1, fc2 = _mlp(sequence_parallel=True)
    x = torch.randn(3 + mesh.tp_rank, 2, 8)  # rank 1 passes a longer sequence chunk
    with tp.set_debug(True):
        with pytest.raises(ValueError, match=r"different shapes across the tp group: ranks \[0\] have shape "
                                             r"\(3, 2, 8\); ranks \[1\] have shape \(4, 2, 8\)"):
            fc2(fc1(x))
        with pytest.raises(ValueError, match="different shapes"):
            tp.gather_from_tp_region(torch.randn(3, 2, 6 + mesh.tp_rank))


@pytest.mark.parametrize("sequence_parallel", [False, True])
@distributed(world_size=2)
def test_debug_off_adds_no_collective_and_on_adds_only_checks(sequence_parallel):
    tp.init_mesh(tp=2)
    fc1, fc2 = _mlp(sequence_parallel)
    x = torch.randn(4, 2, 8, requires_grad=True)

    def step():
        fc2(fc1(x)).sum().backward()

    _, off = comm_counts(step)
    expected = {"all_reduce": 1, "all_gather": 3, "reduce_scatter": 2} if sequence_parallel \
        else {"all_reduce": 2, "all_gather": 0, "reduce_scatter": 0}
    assert {k: off[k] for k in expected} == expected and off["total"] == sum(expected.values()), off
    with tp.set_debug(True):
        _, on = comm_counts(step)
    assert on["all_gather"] == off["all_gather"] + 2 and on["total"] == off["total"] + 2, (off, on)  # fc1, fc2 inputs


@distributed(world_size=2)
def test_vocab_pieces_check_their_replicated_ids_and_targets():
    mesh = tp.init_mesh(tp=2)
    embedding = tp.VocabParallelEmbedding(8, 4)
    ids = torch.tensor([[1, 2], [3, 4 + mesh.tp_rank]])
    logits, targets = torch.randn(2, 2, 4), ids.clone()
    with tp.set_debug(True):
        with pytest.raises(ValueError, match=r"token ids of VocabParallelEmbedding should be replicated.*\[0\] vs"):
            embedding(ids)
        with pytest.raises(ValueError, match=r"targets of vocab_parallel_cross_entropy should be replicated"):
            tp.vocab_parallel_cross_entropy(logits, targets)
        with pytest.raises(ValueError, match=r"logits_shard of vocab_parallel_cross_entropy has different shapes"):
            tp.vocab_parallel_cross_entropy(torch.randn(2, 2 + mesh.tp_rank, 4), torch.zeros(2, 2, dtype=torch.long))
