"""bench.mlp leaves no collective in flight and writes to a scratch path unless told otherwise."""
import os
import tempfile

import pytest
import torch

from bench import mlp
from tp.testing import run


def _bench_then_registry():
    times = mlp.bench_rank(32, 64, 4, iters=2, warmup=1)
    return set(times), torch._C._distributed_c10d._get_work_registry_size()


def test_bench_mlp_waits_for_every_collective_and_writes_to_scratch():
    for names, in_flight in run(_bench_then_registry, 2):
        assert names == {"ours", "dtensor"}
        assert in_flight == 0  # else: "unwaited collective calls" at exit
    out = mlp.parser().parse_args([]).out
    repo = os.path.dirname(os.path.dirname(os.path.abspath(mlp.__file__)))
    assert out.startswith(tempfile.gettempdir()) and not os.path.abspath(out).startswith(repo)


def test_a_tp_that_does_not_divide_the_shapes_is_one_line_before_any_process(capsys):
    with pytest.raises(SystemExit) as done:
        mlp.main(["--tp", "2", "3"])
    assert done.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: --tp 3 must divide the MLP's ffn sizes 512, 2048, 4096")
