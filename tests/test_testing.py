"""The multi-rank harness itself: a failing rank is reported with its traceback; a hang is killed, not waited on."""
import pytest
import torch.distributed as dist

from tp import testing


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # the other ranks block on the rank that failed


def _hang_on_rank_zero():
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins


def _rank():
    return dist.get_rank()


def _unpicklable():
    return lambda: None


def test_failure_on_one_rank_reports_it_and_frees_the_others():
    with pytest.raises(testing.RankError, match=r"failed on ranks \[1\] of 2(.|\n)*ranks \[0\] did not report"
                                                r"(.|\n)*boom on rank one"):
        testing.run(_fail_on_rank_one, world_size=2)
    assert testing.run(_rank, world_size=2) == [0, 1]  # a fresh pool replaced the broken one


def test_hang_times_out():
    with pytest.raises(testing.RankTimeout, match=r"ranks \[0\] of 2 did not finish within 10s"):
        testing.run(_hang_on_rank_zero, world_size=2, timeout=10)
    assert testing.run(_rank, world_size=2) == [0, 1]


def test_unpicklable_result_is_reported_not_lost():
    with pytest.raises(testing.RankError, match=r"failed on ranks \[0, 1\](.|\n)*(pickle|Pickl)"):
        testing.run(_unpicklable, world_size=2)
