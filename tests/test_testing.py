"""The multi-rank harness itself: a failing rank is reported with its traceback; a hang is killed, not waited on, and
reported with the stuck ranks' stacks; bare asserts in a rank show their values, as in pytest."""
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from tp import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def _assert_value_on_rank_one():
    value = 1337 if dist.get_rank() == 1 else 337
    assert value == 337


def _stuck_in(report, rank, *functions):
    """Whether the report shows `rank` stuck with `functions` on its stack, innermost first."""
    frames = "".join(rf".*line \d+ in {f}\n" for f in functions)
    return re.search(rf"---- rank {rank} stuck here ----\n{frames}", report, re.DOTALL) is not None


def test_failure_on_one_rank_reports_it_and_frees_the_others():
    with pytest.raises(testing.RankError, match=r"failed on ranks \[1\] of 2(.|\n)*ranks \[0\] did not report"
                                                r"(.|\n)*boom on rank one") as failure:
        testing.run(_fail_on_rank_one, world_size=2)
    assert _stuck_in(str(failure.value), 0, "barrier", "_fail_on_rank_one")
    assert testing.run(_rank, world_size=2) == [0, 1]  # a fresh pool replaced the broken one


def test_hang_times_out_and_shows_where_it_hung():
    with pytest.raises(testing.RankTimeout, match=r"ranks \[0\] of 2 did not finish within 4s") as hang:
        testing.run(_hang_on_rank_zero, world_size=2, timeout=4)
    assert _stuck_in(str(hang.value), 0, "barrier", "_hang_on_rank_zero")
    assert "rank 1" not in str(hang.value)  # it finished: no stack
    # the stuck thread first, the worker's own queue threads left out (they buried it)
    assert str(hang.value).split("---- rank 0 stuck here ----\n")[1].startswith("Current thread")
    assert "multiprocessing" not in str(hang.value).split("stuck here")[1]
    assert testing.run(_rank, world_size=2) == [0, 1]


def test_unpicklable_result_is_reported_not_lost():
    with pytest.raises(testing.RankError, match=r"failed on ranks \[0, 1\](.|\n)*(pickle|Pickl)"):
        testing.run(_unpicklable, world_size=2)


def test_bare_assert_in_a_rank_shows_its_values():
    with pytest.raises(testing.RankError, match=r"failed on ranks \[1\] of 2(.|\n)*assert 1337 == 337"):
        testing.run(_assert_value_on_rank_one, world_size=2)


def _python(code, **env):
    env = {k: v for k, v in os.environ.items() if k != "TP_TEST_TIMEOUT"} | env
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, *code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_default_timeout_is_a_minute_and_the_env_overrides_it():
    out = _python(["-c", "import importlib, os, tp.testing as t; d = t.DEFAULT_TIMEOUT; "
                         "os.environ['TP_TEST_TIMEOUT'] = '7'; print(d, importlib.reload(t).DEFAULT_TIMEOUT)"])
    assert out.split() == ["60.0", "7.0"]


def test_run_from_a_plain_script(tmp_path):
    # Outside pytest nothing is rewritten and the ranks never import pytest.
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch.distributed as dist
        from tp import testing

        def body():
            return dist.get_rank(), "_pytest" in sys.modules

        if __name__ == "__main__":
            print(testing.run(body, world_size=2))
    """))
    assert _python([str(script)]).strip() == "[(0, False), (1, False)]"


def test_a_nested_function_is_refused_before_reaching_the_ranks():
    def body():
        return 1

    with pytest.raises(ValueError, match="test_a_nested_function_is_refused_before_reaching_the_ranks.<locals>.body "
                                         "cannot run on the ranks: pass a module-level function"):
        testing.run(body, 2)


def _die_on_rank_one():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _leave_state_behind():
    import torch

    import tp

    tp.init_mesh(tp=dist.get_world_size())
    tp.model_parallel_seed(0)
    tp.set_debug(True)
    torch.manual_seed(5)


def _state():
    import torch

    import tp

    return tp.is_debug(), tp.get_rng_tracker().get_states(), torch.randn(2).tolist()


def _sleep_then_all_reduce(seconds):
    import time

    import torch

    if dist.get_rank() == 0:
        time.sleep(seconds)
    dist.all_reduce(torch.ones(1))
    return True


def test_a_dead_rank_is_reported_and_the_next_call_gets_fresh_ranks():
    with pytest.raises(testing.RankError, match=r"rank 1 died \(exit code 3\)"):
        testing.run(_die_on_rank_one, world_size=2)
    assert testing.run(_rank, world_size=2) == [0, 1]


def _count_a_group_on_rank_zero_only():
    if dist.get_rank() == 0:  # as a new_group call reached by rank 0 alone (a body that failed on the others)
        dist.distributed_c10d._world.group_count += 1


def _new_group_works():
    group = dist.new_group([0, 1])
    out = torch.zeros(2, dtype=torch.int64)
    dist.all_gather_into_tensor(out, torch.tensor([dist.get_rank()]), group=group)
    return out.tolist()


def test_ranks_out_of_step_on_their_groups_fail_the_call_and_get_fresh_workers():
    """Otherwise the next test's new_group pairs the ranks' groups wrongly: a gloo connection error or a hang."""
    with pytest.raises(testing.RankError, match=r"created different numbers of process groups \(\{0: \d+, 1: \d+\}"):
        testing.run(_count_a_group_on_rank_zero_only, world_size=2)
    assert testing.run(_new_group_works, world_size=2) == [[0, 1], [0, 1]]


def test_each_call_starts_from_a_clean_rank():
    fresh = testing.WorkerPool(2)
    try:
        before = fresh.run(_state)
        fresh.run(_leave_state_behind)
        assert fresh.run(_state) == before  # debug off, no tracked streams, the default generator as at start
    finally:
        fresh.close()


def test_a_call_may_wait_longer_than_twice_the_default_timeout(monkeypatch):
    """The process group's own timeout follows the call's: a rank may block in a collective up to `timeout`."""
    monkeypatch.setenv("TP_TEST_TIMEOUT", "0.5")  # what the spawned ranks read
    fresh = testing.WorkerPool(2, timeout=30)
    try:
        assert fresh.run(_sleep_then_all_reduce, {"seconds": 2}, timeout=30) == [True, True]
    finally:
        fresh.close()


def test_a_longer_timeout_reuses_the_warm_ranks():
    """The shared pools are built for calls up to SHARED_TIMEOUT: a test asking 300 s after one that asked the
    default runs on the same warm ranks (respawning them cost the suite seconds per world size and timeout); only a
    call beyond SHARED_TIMEOUT respawns them."""
    warm = testing.pool(2)
    assert testing.pool(2, timeout=300) is warm and testing.run(_rank, world_size=2, timeout=300) == [0, 1]
    assert testing.pool(2, timeout=testing.SHARED_TIMEOUT) is warm


def test_no_ranks_is_refused():
    with pytest.raises(ValueError, match=r"world_size=0 must be >= 1"):
        testing.run(_rank, world_size=0)


def test_tp_test_device_puts_the_ranks_tensors_on_the_gpu_over_gloo_and_is_a_no_op_without_cuda(monkeypatch):
    """(CUDA faked for the choice only.) cuda: gloo, ranks sharing the GPUs; nccl: one GPU per rank or one line;
    without CUDA every mode is the CPU's."""
    monkeypatch.delenv("TP_TEST_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert testing.device_mode() == "cpu" and testing._backend(4) == "gloo"
    monkeypatch.setenv("TP_TEST_DEVICE", "cuda")
    assert testing.device_mode() == "cpu" and testing.device() == torch.device("cpu")  # no CUDA: a no-op
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert testing.device_mode() == "cuda" and testing._backend(4) == "gloo"  # 4 ranks share the GPU over gloo
    monkeypatch.setenv("TP_TEST_DEVICE", "nccl")
    with pytest.raises(ValueError, match=r"TP_TEST_DEVICE=nccl needs one GPU per rank: 4 ranks, 1 GPUs"):
        testing._backend(4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # nccl for the GPU's tensors, gloo for the host's
    assert testing._backend(4) == "cpu:gloo,cuda:nccl"  # (numbers the package keeps on the host: clocks, flags)
    monkeypatch.setenv("TP_TEST_DEVICE", "gpu")
    with pytest.raises(ValueError, match=r"TP_TEST_DEVICE='gpu' must be one of cpu, cuda, nccl"):
        testing.device_mode()
    monkeypatch.delenv("TP_TEST_DEVICE")
    assert testing._backend(1) == "gloo"  # the default run: CPU tensors even with a GPU
